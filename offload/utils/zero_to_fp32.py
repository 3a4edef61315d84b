"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` in a script: a checkpoint's fp32 weights as a state dict, into a
model, or written as DeepSpeed writes them, over the reader of the recovery script beside every checkpoint
(offload/files/zero_to_fp32.py, which needs no offload import)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from offload.files import zero_to_fp32 as recovery

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights in fp32, in memory (``lazy_mode``: DeepSpeed's deferred tensors; here they are
    read at once, which is what its callers do with them)."""
    return recovery.fp32_state_dict(Path(checkpoint_dir), tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> torch.nn.Module:
    """The checkpoint's fp32 weights into ``model``, moved to the CPU first (as DeepSpeed's: a model outside any
    engine); returns it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """DeepSpeed's script as a function: ``pytorch_model.bin`` (or ``model.safetensors`` with
    ``safe_serialization``), sharded past ``max_shard_size``; returns the files written."""
    size = max_shard_size if isinstance(max_shard_size, int) else recovery.shard_size(max_shard_size)
    return recovery.recover(Path(checkpoint_dir), Path(output_dir), tag, size, safe_serialization,
                            exclude_frozen_parameters)
