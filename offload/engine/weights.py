"""Whole weights out of a live engine: gathered for inspection, a full state_dict, a 16-bit model file.

Each gathers one unit at a time (a collective: every rank calls it), so no rank ever
holds more than one unit's full buffer beyond what it returns; offload/files/export.py does
the same from checkpoint files, without an engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload.engine.errors import EngineError
from offload.files.weights_file import TensorSpec, stream_for
from offload.store.state_format import StateSlot
from offload.zero.collectives import all_gather, all_ok, broadcast
from offload.zero.runtime import live_state_dict

logger = logging.getLogger("offload.engine")


def live_buffers(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state_dict entries outside the units (its persistent buffers): the live tensors, by key."""
    sharded = {id(s.param) for u in engine.units for s in u.slots}
    return {k: t for k, t in live_state_dict(engine.module).items() if id(t) not in sharded}


def state_dict_layout(engine: Any) -> tuple[list[tuple[str, int, Any]], dict[str, torch.Tensor]]:
    """Each state_dict key that is a parameter as (key, unit index, its ParamSlot), and the buffers (on the
    host); tied parameters appear under every key they have."""
    where = {id(s.param): (u.index, s) for u in engine.units for s in u.slots}
    params, buffers = [], {}
    for key, t in live_state_dict(engine.module).items():
        if id(t) in where:
            params.append((key, *where[id(t)]))
        else:
            buffers[key] = t.detach().cpu().clone()
    return params, buffers


@contextlib.contextmanager
def gathered_parameters(engine: Any, modifier_rank: int | None = None,
                        only: set[int] | None = None) -> Iterator[nn.Module]:
    """Every unit (``only``: these unit indices) gathered (full compute-dtype parameters readable on the module)
    inside the block; units start and end sharded, so the runtime's count of gathered elements is untouched. With
    ``modifier_rank`` what that rank wrote inside the block is kept on every rank (see [Note: writing through
    gathered parameters])."""
    if modifier_rank is not None and not 0 <= modifier_rank < engine.group.world:
        raise ValueError(f"modifier_rank {modifier_rank} is not a rank of this group (0 to {engine.group.world - 1})")
    units = [u for u in engine.units if only is None or u.index in only]
    if modifier_rank is not None:
        engine.optimizer.publish()  # the parameters a delayed update holds back would be written back as edits
    engine.optimizer.drain()  # an early step still writing shards (in-place units read them directly)
    engine.optimizer.repair_stale()  # a shard a failed write left stale is rewritten before it is gathered
    engine.runtime.reshard_all()
    for unit in units:
        unit.unshard(engine.runtime.h2d)
        if unit.in_place:  # the flat buffer is the shard: a copy back may still be writing it (on a GPU)
            engine.params.await_home(unit.index)
    # Units that keep their buffer have their shard inside it: what the block writes there is compared with this.
    # Where that shard is also a 16+16 master's high half (see [Note: the weights are the high half] in
    # offload/store/optimizer_state.py), a write no rank keeps would change the master: it is undone at the end.
    lent = {u.index for u in units if engine.optimizer is not None and engine.optimizer.lends_weights(u.index)}
    before = {u.index: engine.params.read(u.index).clone() for u in units
              if u.keeps_full and (modifier_rank is not None or u.index in lent)}
    edits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        yield engine.module
        if modifier_rank is not None:
            edits = _edits(engine, modifier_rank, before, units)
    except BaseException:
        for unit in units:  # the block failed: its writes into shards are undone, none is kept
            if unit.index in before:
                unit.full[unit.shard_start:unit.shard_start + unit.shard_numel].copy_(before[unit.index])
        raise
    finally:
        for unit in units:
            if modifier_rank is None and unit.index in before:  # a lent high half: the block's writes are not kept
                unit.full[unit.shard_start:unit.shard_start + unit.shard_numel].copy_(before[unit.index])
            unit.reshard()
    if edits:
        _apply_edits(engine, edits)
    if modifier_rank is not None:
        spread_rewritten(engine)  # on every rank, whether its own shards were edited or not


# [Note: writing through gathered parameters]
# As DeepSpeed's GatheredParameters(modifier_rank=r), what rank r wrote into the gathered parameters is kept on
# every rank; here in the fp32 master weights as well as the compute copies. At the block's end rank r's buffers are
# broadcast, and each rank compares its shard of them with the shard as it was (bit for bit): only the elements
# that differ are written, into the fp32 master (trained units) and the compute copy. An element nobody wrote keeps
# its fp32 master, so a bf16 model's masters are not rounded by passing through the block; Adam's moments and the
# step count stay. A block that raises keeps nothing.


def _edits(engine: Any, modifier_rank: int, before: dict[int, torch.Tensor], units: list[Any]
           ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each unit's written elements of this rank's shard: (positions, new values in fp32)."""
    edits = {}
    for unit in units:  # a collective: every rank, the same units in the same order
        broadcast(unit.full, engine.group, src=modifier_rank)
        new = unit.full[unit.shard_start:unit.shard_start + unit.shard_numel]
        old = before[unit.index] if unit.index in before else engine.params.read(unit.index).to(new.device)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
        where = (new.view(bits) != old.to(new.device).view(bits)).nonzero().flatten()
        if where.numel():
            edits[unit.index] = (where.cpu(), new[where].float().cpu())
    return edits


def rewrite_units(engine: Any, *, read: bool, state: Callable[[int, StateSlot], bool],
                  shard: Callable[[int], torch.Tensor | None]) -> None:
    """New weights into a live engine, one sub-group of optimizer state in memory at a time: ``state`` writes a
    trained unit's (master, exp_avg, exp_avg_sq) views (``read``: as they were first) and says whether it did,
    then the unit's compute copy follows its master (a 16+16 master's high half); ``shard`` gives an untrained
    unit's new compute shard (None: it keeps its own). For checkpoint and state-dict loads and kept edits; the
    caller has drained the optimizer and resharded the units, and calls ``spread_rewritten`` after it on every
    rank."""
    for g in engine.optimizer.one_at_a_time(read=read, write=True):
        for m in g.members:
            views = g.views(m)
            if state(m.unit, views):
                engine.params.overwrite(m.unit, views[0])
    for unit in engine.units:
        if not engine.optimizer.trains(unit.index):
            values = shard(unit.index)
            if values is not None:
                engine.params.overwrite(unit.index, values)


def spread_rewritten(engine: Any) -> None:
    """After ``rewrite_units`` (on ranks whose shards changed: edits reach only some), on every rank: the new
    values reach where ranks keep copies of one another's shards (a collective)."""
    if engine.stage.resident_params:
        engine.runtime.spread_partitions()
    engine.runtime.refresh_kept()


def _apply_edits(engine: Any, edits: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    def edit_master(unit: int, views: StateSlot) -> bool:
        if unit not in edits:
            return False
        where, values = edits[unit]
        master = views.master_fp32()  # held in 16 bits, or as two halves: edited whole, stored back as held
        master[where.to(master.device)] = values.to(master.device)
        views.set_master(master)
        return True

    def edited_shard(unit: int) -> torch.Tensor | None:
        if unit not in edits:
            return None
        where, values = edits[unit]
        shard = engine.params.read(unit).float().cpu().clone()
        shard[where] = values
        return shard

    rewrite_units(engine, read=True, state=edit_master, shard=edited_shard)


def full_values(engine: Any, unit: Any) -> torch.Tensor:
    """One unit's whole flat fp32 values on the device (a collective): its master weights where the optimizer
    trains it, else its compute copy."""
    device = engine.accel.device
    shard = (engine.optimizer.master_of(unit.index) if engine.optimizer.trains(unit.index)
             else engine.params.read(unit.index).float())
    full = torch.empty(unit.padded, dtype=torch.float32, device=device)
    all_gather(full, shard.to(device), unit.group)
    return full


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The model's state_dict on the CPU with fp32 master values for trained parameters."""
    values: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        full = full_values(engine, unit).cpu()
        for s in unit.slots:
            values[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    # keep_vars: the entries are the Parameter objects themselves (their storage may be empty now).
    return {key: values[id(t)] if id(t) in values else t.detach().cpu().clone()
            for key, t in live_state_dict(engine.module).items()}


def load_full_state_dict(engine: Any, state_dict: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
    """Whole weights into a live engine, the inverse of ``full_state_dict``: each rank cuts its shards out of the
    same full state dict; trained parameters' fp32 masters take the values (Adam's moments and step count stay),
    the compute copies follow. Checked first on every rank (keys with ``strict``, shapes, types), then written, so
    a bad dict changes nothing. Returns (missing, unexpected) keys, as ``nn.Module.load_state_dict`` does."""
    live = live_state_dict(engine.module)
    where = {id(s.param): (u, s) for u in engine.units for s in u.slots}
    missing = [k for k in live if k not in state_dict]
    unexpected = [k for k in state_dict if k not in live]
    problems = []
    if strict and missing:
        problems.append(f"missing keys: {_some(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys: {_some(unexpected)}")
    for key, t in live.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        shape = tuple(where[id(t)][1].shape) if id(t) in where else tuple(t.shape)
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != shape:
            problems.append(f"{key} has shape {tuple(value.shape)}, the model's is {shape}")
    if not all_ok(not problems, engine.group, engine.accel.device):
        raise EngineError("the state dict does not fit the model: " + "; ".join(problems) if problems else
                          "another rank's state dict does not fit the model (see its error); nothing was loaded")
    engine.optimizer.publish()  # a delayed update's parameters first, so units the dict leaves out have theirs
    engine.optimizer.drain()
    given = {id(t) for key, t in live.items() if key in state_dict}
    keys = {id(t): key for key, t in live.items() if key in state_dict}  # a tied parameter: its last key, as torch
    shards: dict[int, torch.Tensor] = {}  # this rank's new shard of each unit the dict covers, fp32 on the host
    for unit in engine.units:
        if not any(id(s.param) in given for s in unit.slots):
            continue
        flat = torch.zeros(unit.padded, dtype=torch.float32)
        if not all(id(s.param) in given for s in unit.slots):  # the parameters the dict leaves out keep their values
            flat[unit.shard_start:unit.shard_start + unit.shard_numel] = (
                engine.optimizer.master_of(unit.index) if engine.optimizer.trains(unit.index)
                else engine.params.read(unit.index).float()).cpu()
        for s in unit.slots:
            if id(s.param) in given:
                flat[s.offset:s.offset + s.numel] = state_dict[keys[id(s.param)]].detach().reshape(-1).float().cpu()
        shards[unit.index] = flat[unit.shard_start:unit.shard_start + unit.shard_numel].clone()
    def load_master(unit: int, views: StateSlot) -> bool:
        values = shards.get(unit)
        if values is not None:
            views.set_master(values.to(views.master.device))
        return values is not None

    engine.runtime.reshard_all()
    try:
        with torch.no_grad():  # the module's tensors outside the units (buffers)
            for key, t in live.items():
                if key in state_dict and id(t) not in where:
                    t.copy_(state_dict[key])
        rewrite_units(engine, read=True, state=load_master, shard=shards.get)
        spread_rewritten(engine)
    except BaseException as e:
        engine.close()
        raise EngineError(f"loading the state dict failed part-way ({e}); the engine's weights are half replaced, "
                          "so it was closed: create a new engine and load again") from e
    return missing, unexpected


def _some(keys: list[str], most: int = 8) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


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


def _kept_by_unit(layout: list[tuple[str, int, Any]], exclude_frozen_parameters: bool
                  ) -> dict[int, list[tuple[str, Any]]]:
    """The state_dict keys to gather, with their slots, by unit (frozen parameters left out when asked)."""
    by_unit: dict[int, list[tuple[str, Any]]] = {}
    for key, index, slot in layout:
        if not (exclude_frozen_parameters and not slot.param.requires_grad):
            by_unit.setdefault(index, []).append((key, slot))
    return by_unit


def _gathered_units(engine: Any) -> Iterator[tuple[int, torch.Tensor]]:
    """Each unit's whole compute-dtype values on the device, one unit gathered at a time (a collective: every rank
    iterates to the end). The caller drops its ``full`` before asking for the next, so that one unit's buffer is
    alive at a time."""
    for unit in engine.units:
        full = torch.empty(unit.padded, dtype=engine.compute_dtype, device=engine.accel.device)
        all_gather(full, engine.params.read(unit.index).to(engine.accel.device), unit.group)
        yield unit.index, full
        del full


def consolidated_16bit_state_dict(engine: Any, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state_dict in the compute dtype on rank 0's host, gathered unit by unit (a collective; the
    other ranks get ``{}``), as DeepSpeed's ``_zero3_consolidated_16bit_state_dict`` answers accelerate's
    ``get_state_dict``: rank 0 holds the whole model once, so ``write_weights`` is the way for a model that does not
    fit the host."""
    layout, buffers = state_dict_layout(engine)
    by_unit = _kept_by_unit(layout, exclude_frozen_parameters)
    rank0 = engine.group.rank == 0
    values: dict[str, torch.Tensor] = {}
    for index, full in _gathered_units(engine):
        if rank0:
            host = full.cpu()
            for key, s in by_unit.get(index, ()):
                values[key] = host[s.offset:s.offset + s.numel].view(s.shape).clone()
        del full
    if not rank0:
        return {}
    values.update(buffers)
    return {key: values[key] for key in live_state_dict(engine.module) if key in values}


def write_weights(engine: Any, save_dir: str | os.PathLike[str], save_filename: str,
                  exclude_frozen_parameters: bool = False) -> None:
    """Rank 0 streams the gathered compute-dtype weights to one file (torch.save, or safetensors by the file's
    name), unit by unit: it never holds the whole state dict. A collective: when rank 0's write fails (a full
    disk), it keeps taking part in the gathers, and every rank then raises, none is left waiting."""
    layout, buffers = state_dict_layout(engine)
    by_unit = _kept_by_unit(layout, exclude_frozen_parameters)
    dtype = engine.compute_dtype
    path = Path(save_dir) / save_filename
    writer = _RankZeroWriter(path) if engine.group.rank == 0 else None
    if writer is not None:
        specs = [TensorSpec(key, dtype, tuple(slot.shape)) for unit in engine.units
                 for key, slot in by_unit.get(unit.index, ())]
        specs += [TensorSpec(key, t.dtype, tuple(t.shape)) for key, t in buffers.items()]
        written = {s.key for s in specs}
        writer.open(specs, [key for key in live_state_dict(engine.module) if key in written])
    for index, full in _gathered_units(engine):
        if writer is not None and writer.error is None:
            host = full.cpu()
            for key, s in by_unit.get(index, ()):
                writer.write(key, host[s.offset:s.offset + s.numel].view(s.shape))
        del full
    if writer is not None:
        for key, t in buffers.items():
            writer.write(key, t)
        writer.finish()
    # Also what keeps the other ranks from returning before rank 0's file is in place.
    if not all_ok(writer is None or writer.error is None, engine.group, engine.accel.device):
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
