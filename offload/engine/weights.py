"""Whole weights out of a live engine: gathered for inspection, a full state_dict, a 16-bit model file.

Each gathers one unit at a time (a collective: every rank calls it), so no rank ever
holds more than one unit's full buffer beyond what it returns; offload/export.py does
the same from checkpoint files, without an engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.weights_file import TensorSpec, stream_for
from offload.zero.collectives import all_gather, all_ok

logger = logging.getLogger("offload.engine")


def state_dict_layout(engine: Any) -> tuple[list[tuple[str, int, Any]], dict[str, torch.Tensor]]:
    """Each state_dict key that is a parameter as (key, unit index, its ParamSlot), and the buffers (on the
    host); tied parameters appear under every key they have."""
    where = {id(s.param): (u.index, s) for u in engine.units for s in u.slots}
    params, buffers = [], {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in where:
            params.append((key, *where[id(t)]))
        else:
            buffers[key] = t.detach().cpu().clone()
    return params, buffers


@contextlib.contextmanager
def gathered_parameters(engine: Any) -> Iterator[nn.Module]:
    """Every unit gathered (full compute-dtype parameters readable on the module) inside the block; units start
    and end sharded, so the runtime's count of gathered elements is untouched."""
    engine.optimizer.drain()  # an early step still writing shards (in-place units read them directly)
    engine.runtime.reshard_all()
    for unit in engine.units:
        unit.unshard(engine.runtime.h2d)
        if unit.in_place:  # the flat buffer is the shard: a copy back may still be writing it (on a GPU)
            engine.params.await_home(unit.index)
    try:
        yield engine.module
    finally:
        for unit in engine.units:
            unit.reshard()


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The model's state_dict on the CPU with fp32 master values for trained parameters."""
    values: dict[int, torch.Tensor] = {}
    device = engine.accel.device
    for unit in engine.units:
        shard = (engine.optimizer.master_of(unit.index) if unit.index in engine.optimizer.shards
                 else engine.params.read(unit.index).float())
        full = torch.empty(unit.padded, dtype=torch.float32, device=device)
        all_gather(full, shard.to(device), unit.group)
        full = full.cpu()
        for s in unit.slots:
            values[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    # keep_vars: the entries are the Parameter objects themselves (their storage may be empty now).
    return {key: values[id(t)] if id(t) in values else t.detach().cpu().clone()
            for key, t in engine.module.state_dict(keep_vars=True).items()}


def save_16bit_model(engine: Any, save_dir: str | os.PathLike[str], save_filename: str,
                     exclude_frozen_parameters: bool) -> bool:
    """``write_weights``, only with stage3_gather_16bit_weights_on_model_save, as in DeepSpeed (returns whether it
    saved)."""
    if not engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        logger.warning("save_16bit_model saved nothing: zero_optimization.stage3_gather_16bit_weights_on_model_"
                       "save is false (as DeepSpeed does); set it to true, or save_checkpoint and then "
                       "`offload export-weights`, which never gathers the whole model")
        return False
    write_weights(engine, save_dir, save_filename, exclude_frozen_parameters)
    return True


def write_weights(engine: Any, save_dir: str | os.PathLike[str], save_filename: str,
                  exclude_frozen_parameters: bool = False) -> None:
    """Rank 0 streams the gathered compute-dtype weights to one file (torch.save, or safetensors by the file's
    name), unit by unit: it never holds the whole state dict. A collective: when rank 0's write fails (a full
    disk), it keeps taking part in the gathers, and every rank then raises, none is left waiting."""
    layout, buffers = state_dict_layout(engine)
    by_unit: dict[int, list[tuple[str, Any]]] = {}
    for key, index, slot in layout:
        if not (exclude_frozen_parameters and not slot.param.requires_grad):
            by_unit.setdefault(index, []).append((key, slot))
    dtype, device = engine.compute_dtype, engine.accel.device
    path = Path(save_dir) / save_filename
    writer = _RankZeroWriter(path) if engine.group.rank == 0 else None
    if writer is not None:
        specs = [TensorSpec(key, dtype, tuple(slot.shape)) for unit in engine.units
                 for key, slot in by_unit.get(unit.index, ())]
        specs += [TensorSpec(key, t.dtype, tuple(t.shape)) for key, t in buffers.items()]
        written = {s.key for s in specs}
        writer.open(specs, [key for key in engine.module.state_dict(keep_vars=True) if key in written])
    for unit in engine.units:  # one unit gathered at a time
        full = torch.empty(unit.padded, dtype=dtype, device=device)
        all_gather(full, engine.params.read(unit.index).to(device), unit.group)
        if writer is not None and writer.error is None:
            host = full.cpu()
            for key, s in by_unit.get(unit.index, ()):
                writer.write(key, host[s.offset:s.offset + s.numel].view(s.shape))
        del full
    if writer is not None:
        for key, t in buffers.items():
            writer.write(key, t)
        writer.finish()
    # Also what keeps the other ranks from returning before rank 0's file is in place.
    if not all_ok(writer is None or writer.error is None, engine.group, device):
        if writer is not None and writer.error is not None:
            raise writer.error
        raise OSError(f"rank {engine.group.rank}: rank 0 could not write {path} (its error says why); nothing was "
                      "written")


class _RankZeroWriter:
    """Rank 0's side of ``write_weights``: the file stream and its first error, after which it writes nothing
    more (the gathers go on, so the other ranks reach the check that tells them) and the partial file goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stream: Any = None
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def _first_error(self) -> Iterator[None]:
        try:
            yield
        except Exception as e:  # noqa: BLE001 - raised on this rank once every rank knows
            self.error = e

    def open(self, specs: list[TensorSpec], order: list[str]) -> None:
        with self._first_error():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.stream = stream_for(self.path, specs, metadata={"format": "pt"}, key_order=order)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self.error is None:
            with self._first_error():
                self.stream.write(key, tensor)

    def finish(self) -> None:
        """Close the file (renamed into place) if all went well, else remove what was written."""
        if self.error is None:
            with self._first_error():
                self.stream.close()
        if self.error is not None and self.stream is not None:
            self.stream.abort()
