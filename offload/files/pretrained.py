"""Pretrained weights read straight into shards from a local Hugging Face checkpoint directory.

[Note: reading a checkpoint into shards] The engine builds one unit at a time (see
offload/zero/init.py); with pretrained weights each unit's values come from the
checkpoint's safetensors files instead of an initialiser. A rank reads only the
elements its shard holds (the whole unit where the unit keeps a full buffer: ZeRO
stages 0-2, or W = 1): for each parameter overlapping that range, the rows that cover
it, through safetensors' memory-mapped slices, converted to fp32 (the master weights'
dtype) in a buffer of the range's size. So building needs memory for about one unit
beyond the shards, every rank reads the files itself (no broadcast), and the model is
never whole in memory.

Which file key feeds which parameter is settled before anything is allocated
(``PretrainedWeights.bind``): every name a parameter is reached by is tried (tied
weights are stored once, under either name), with the model's ``base_model_prefix``
added or dropped when the checkpoint was saved from the bare model or with a head; a
parameter no key feeds, a key nothing reads, or a shape that differs is an error that
names them, except the keys the model class itself says to ignore
(``_keys_to_ignore_on_load_missing`` / ``_unexpected``), as ``from_pretrained`` does. With
``strict=False`` (a new head on a pretrained base) a missing parameter is initialised by the
model instead and a key nothing reads is skipped, each named in a warning: a unit holding
such a parameter is built as a fresh one (initialised, broadcast from rank 0, so every rank
agrees) and the checkpoint's values are written over the rest of it.
Persistent buffers stored in the checkpoint (a BatchNorm's running statistics) are
loaded too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offload.zero.plan import UnitPlan

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LISTED = 8  # names an error message lists before "and N more"
logger = logging.getLogger("offload.files.pretrained")


class PretrainedError(ValueError):
    """A checkpoint directory that cannot be read into this model; the message says what and why."""


@dataclass(frozen=True)
class StoredTensor:
    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def local_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` as a local checkpoint directory, or a PretrainedError that says why it is not one: offload never
    downloads."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise PretrainedError(
            f"{path}: not a local directory. offload reads checkpoints from disk and never downloads; fetch it "
            "first (for example `hf download NAME --local-dir DIR`, `huggingface-cli download` in older "
            "huggingface_hub) and pass that directory")
    if not (where / SINGLE_FILE).is_file() and not (where / INDEX_FILE).is_file():
        others = sorted(p.name for p in where.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f"; it has {', '.join(others[:3])}: convert it to safetensors (save_pretrained with "
                "safe_serialization=True)") if others else ""
        raise PretrainedError(f"{where}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return where


class Checkpoint:
    """Every tensor of a local checkpoint directory (``model.safetensors``, or the shards its index names), from the
    files' headers alone."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open
        self.path = local_checkpoint(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise PretrainedError(f"{index}: not a safetensors index (no readable weight_map): {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE_FILE]
        self.tensors: dict[str, StoredTensor] = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise PretrainedError(f"{index}: names {name}, which is not in {self.path}")
            try:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                        if dtype is None:
                            raise PretrainedError(f"{file}: tensor {key!r} has dtype {piece.get_dtype()}, which "
                                                  "offload does not read")
                        self.tensors[key] = StoredTensor(key, file, dtype, tuple(piece.get_shape()))
            except PretrainedError:
                raise
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
                raise PretrainedError(f"{file}: not a readable safetensors file ({e})") from None

    def read_range(self, tensor: StoredTensor, start: int, stop: int, handles: dict[Path, object]) -> torch.Tensor:
        """Elements [start, stop) of ``tensor`` in row-major order, in its stored dtype: the rows that cover them,
        memory-mapped, then trimmed (``handles``: files already open)."""
        f = handles.get(tensor.file)
        if f is None:
            from safetensors import safe_open
            f = handles[tensor.file] = safe_open(tensor.file, framework="pt")
        if not tensor.shape:
            return f.get_tensor(tensor.key).reshape(1)[start:stop]  # type: ignore[attr-defined]
        row = math.prod(tensor.shape[1:])
        first, last = start // row, -(-stop // row)
        rows = f.get_slice(tensor.key)[first:last]  # type: ignore[attr-defined]
        return rows.reshape(-1)[start - first * row:stop - first * row]


class PretrainedWeights:
    """Where each parameter and persistent buffer of a model comes from in a checkpoint; reads ranges of a unit's
    flat buffer for the engine (see [Note: reading a checkpoint into shards])."""

    def __init__(self, path: str | os.PathLike[str], strict: bool = True) -> None:
        """``strict`` false: a parameter the checkpoint lacks is initialised by the model (a new head on a base
        model) and a key nothing reads is skipped, each named in a warning, as transformers' from_pretrained does;
        a shape that differs is an error either way."""
        self.checkpoint = Checkpoint(path)
        self.strict = strict
        self._params: dict[int, StoredTensor] = {}
        self._buffers: dict[str, StoredTensor] = {}
        self.fresh: set[int] = set()  # parameters the model initialises: no key feeds them (ignored or not strict)
        self.skipped: list[str] = []  # keys nothing reads (not strict)
        self.elements_read = 0  # flat elements read into units so far (a rank's shards, or whole resident units)
        self.largest_read = 0  # the most elements read at once (one unit's range)

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    def bind(self, model: nn.Module) -> None:
        """Match every parameter and persistent buffer of ``model`` to a stored tensor; a PretrainedError names
        every parameter no key feeds, every key nothing reads and every shape that differs."""
        stored = self.checkpoint.tensors
        lookup = _prefix_rule(model, stored)
        ignore_missing = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
        ignore_unexpected = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None))
        names_of: dict[int, list[str]] = {}
        entries: dict[int, torch.Tensor] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(name)
            entries[id(tensor)] = tensor
        params = {id(p) for p in model.parameters()}
        used: set[str] = set()
        missing, mismatched = [], []
        self._params, self._buffers, self.fresh = {}, {}, set()
        for ident, names in names_of.items():
            keys = [lookup(n) for n in names]
            found = [k for k in keys if k in stored]
            used.update(found)
            if not found:
                # A buffer the checkpoint lacks keeps the value the model computed for it (from_pretrained's rule);
                # a parameter is initialised by the model where it may be, else named as missing.
                if ident in params:
                    if self.strict and not any(_matches(n, ignore_missing) for n in names):
                        missing.append(names[0])
                    else:
                        self.fresh.add(ident)
                        if not any(_matches(n, ignore_missing) for n in names):
                            logger.warning("%s: %s is not in the checkpoint: the model initialises it",
                                           self.path, names[0])
                continue
            source = stored[found[0]]
            shape = tuple(entries[ident].shape)
            if source.shape != shape:
                mismatched.append(f"{found[0]}: {list(source.shape)} in the checkpoint, {list(shape)} in the model")
                continue
            if ident in params:
                self._params[ident] = source
            else:
                self._buffers[names[0]] = source
        unexpected = [k for k in stored if k not in used and not _matches(k, ignore_unexpected)]
        if not self.strict and unexpected:
            logger.warning("%s: %d checkpoint key(s) match nothing in %s and are skipped: %s", self.path,
                           len(unexpected), type(model).__name__, _listed(unexpected))
            self.skipped, unexpected = unexpected, []
        problems: list[str] = []
        if mismatched:
            problems.append(f"{len(mismatched)} shape(s) differ: {_listed(mismatched)}")
        if missing:
            problems.append(f"{len(missing)} model tensor(s) have no key in the checkpoint: {_listed(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} checkpoint key(s) match nothing in the model: {_listed(unexpected)}")
        if problems:
            raise PretrainedError(f"{self.path} does not fit {type(model).__name__}: " + "; ".join(problems) +
                                  ". Build the model class the checkpoint was saved from, with its config.json" +
                                  ("; or, for a new head on a pretrained base, load with strict=False (the model "
                                   "initialises what the checkpoint lacks)" if missing or unexpected else ""))

    def needs_init(self, plan: UnitPlan) -> bool:
        """Whether unit ``plan`` holds a parameter the model initialises (so the unit is built as a fresh one and
        the checkpoint's values written over the rest)."""
        return any(id(s.param) in self.fresh for s in plan.slots)

    def fill_bound(self, plan: UnitPlan, values: torch.Tensor) -> None:
        """Write every parameter of unit ``plan`` that the checkpoint feeds into ``values`` (its whole fp32 flat
        buffer), leaving the freshly initialised ones as they are."""
        handles: dict[Path, object] = {}
        for s in plan.slots:
            source = self._params.get(id(s.param))
            if source is not None:
                values[s.offset:s.offset + s.numel].copy_(self.checkpoint.read_range(source, 0, s.numel, handles))
                self.elements_read += s.numel

    def read_flat(self, plan: UnitPlan, padded: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of unit ``plan``'s flat buffer (``padded`` long, zeros past the parameters) as
        fp32, read from the checkpoint."""
        if not 0 <= start <= stop <= padded:
            raise ValueError(f"range [{start}, {stop}) is outside unit {plan.name!r}'s {padded} elements")
        out = torch.zeros(stop - start, dtype=torch.float32)
        self.elements_read += stop - start
        self.largest_read = max(self.largest_read, stop - start)
        handles: dict[Path, object] = {}
        for s in plan.slots:
            lo, hi = max(start, s.offset), min(stop, s.offset + s.numel)
            if lo >= hi:
                continue
            source = self._params.get(id(s.param))
            if source is None:
                raise PretrainedError(f"parameter {s.name!r} was not bound to the checkpoint (bind the model first)")
            out[lo - start:hi - start].copy_(self.checkpoint.read_range(source, lo - s.offset, hi - s.offset,
                                                                         handles))
        return out

    def load_buffers(self, model: nn.Module) -> None:
        """Give each persistent buffer stored in the checkpoint its stored value (in the buffer's dtype); a buffer
        left on the meta device by offload.zero.Init gets memory here."""
        if not self._buffers:
            return
        handles: dict[Path, object] = {}
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, source in self._buffers.items():
            owner_name, _, key = name.rpartition(".")
            owner = modules[owner_name]
            buf = owner._buffers[key]
            assert buf is not None
            value = self.checkpoint.read_range(source, 0, source.numel, handles).reshape(source.shape)
            owner._buffers[key] = value.to(dtype=buf.dtype, device="cpu" if buf.is_meta else buf.device).clone()
            for module in modules.values():  # the same buffer held by another module too
                for k, b in module._buffers.items():
                    if b is buf:
                        module._buffers[k] = owner._buffers[key]


def _prefix_rule(model: nn.Module, stored: dict[str, StoredTensor]):  # type: ignore[no-untyped-def]
    """The checkpoint key of a model name: a checkpoint of the bare model loads into one with a head (drop the
    base model's prefix) and the other way round (add it), as from_pretrained allows."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return lambda name: name
    dotted = prefix + "."
    stored_has = any(k.startswith(dotted) for k in stored)
    model_has = any(n.startswith(dotted) for n in model.state_dict(keep_vars=True))
    if model_has and not stored_has:
        return lambda name: name[len(dotted):] if name.startswith(dotted) else name
    if stored_has and not model_has:
        return lambda name: dotted + name
    return lambda name: name


def _patterns(value: Iterable[str] | None) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (value or ())]


def _matches(name: str, patterns: list[re.Pattern[str]]) -> bool:
    return any(p.search(name) for p in patterns)


def _listed(names: list[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")
