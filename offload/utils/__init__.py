"""DeepSpeed's ``deepspeed.utils`` helpers that training scripts call on a ZeRO-3 parameter, under ``import offload as
deepspeed``: the whole fp32 weight of one parameter (a collective: every rank calls it for the same parameter, as
under DeepSpeed). Those this engine does not give one parameter at a time raise an EngineError that names what
gives the same (never an AttributeError)."""

from __future__ import annotations

from typing import Any

import torch

from offload.engine import EngineError, weights
from offload.engine.life import Life
from offload.zero.plan import engine_of

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "zero_to_fp32"]


def _engine_of(param: torch.Tensor) -> Any:
    engine = engine_of(param)
    if engine is None or engine.life.state is Life.CLOSED:
        raise EngineError("this parameter belongs to no open offload engine: pass a parameter of the model "
                          "offload.initialize returned, before engine.close()")
    if engine.life.state is Life.LENT:
        engine.life.check()  # its states are offloaded: says to reload them first
    return engine


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The parameter's whole fp32 value: its master weights where the optimizer trains it, else its compute copy
    in fp32; on the engine's device, in the parameter's whole shape (``ds_shape``)."""
    engine = _engine_of(param)
    for unit in engine.units:
        for s in unit.slots:
            if s.param is param:
                return weights.full_values(engine, unit)[s.offset:s.offset + s.numel].view(s.shape).clone()
    raise EngineError("this parameter is not one of its engine's (it was replaced after offload.initialize)")


def _not_one_at_a_time(what: str, instead: str) -> EngineError:
    return EngineError(f"{what} is not given one parameter at a time by offload; {instead}")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor:
    raise _not_one_at_a_time("safe_get_full_grad", "gradients land in each unit's shard as backward runs and are "
                             "consumed by the step: read engine.get_global_grad_norm() after step(), or train with "
                             "the gradient hooks of plain PyTorch to inspect one")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    raise _not_one_at_a_time(f"safe_get_full_optimizer_state({optim_state_key!r})",
                             "save a checkpoint (engine.save_checkpoint) and read its optimizer state with "
                             "`offload inspect`, or export it")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    raise _not_one_at_a_time("safe_set_full_fp32_param", "write it inside `with engine.gathered_parameters("
                             "modifier_rank=0):` (the fp32 masters take what rank 0 writes), or load whole weights "
                             "with engine.load_full_state_dict(sd, strict=False)")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    raise _not_one_at_a_time(f"safe_set_full_optimizer_state({optim_state_key!r})",
                             "load a checkpoint that holds the state you want (engine.load_checkpoint)")


from offload.utils import zero_to_fp32  # noqa: E402 - DeepSpeed's deepspeed.utils.zero_to_fp32, over the files
