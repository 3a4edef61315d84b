"""DeepSpeed's ``deepspeed.comm`` as training scripts call it, over torch.distributed: ``import offload as
deepspeed`` keeps ``deepspeed.comm.get_rank()`` and ``deepspeed.init_distributed()`` working.

``init_distributed`` starts the default process group the way DeepSpeed's does when a launcher (torchrun,
``deepspeed``, ``offload.machine.launch``) set RANK / WORLD_SIZE / MASTER_ADDR, and a group of one on this machine
when nothing did (a plain ``python train.py``); the backend is NCCL with a GPU, gloo without. A group already
started is left as it is. The collectives are torch.distributed's own, under DeepSpeed's names.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast",
           "get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_available", "is_initialized",
           "reduce_scatter_tensor"]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start the default process group unless one is running (DeepSpeed's arguments; MPI discovery is not done:
    a launcher's environment variables, or ``rank`` and ``world_size`` with ``init_method``, say who is who)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if rank < 0 and "RANK" not in os.environ:  # nothing launched this process: a group of one, as DeepSpeed makes
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        rank, world_size = 0, 1
        os.environ.setdefault("LOCAL_RANK", "0")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (0 before a group is started, as DeepSpeed answers)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """The rank on this machine, as the launcher set LOCAL_RANK (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    return dist.all_gather_into_tensor(output, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter_tensor(output, tensor, op=op, group=group, async_op=async_op)
