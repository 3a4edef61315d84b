"""Plain weights out of a checkpoint: a consolidated state_dict as safetensors, streamed unit by unit.

The files follow Hugging Face's sharded layout (``model.safetensors``, or
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``), so
``model.load_state_dict`` and ``from_pretrained`` read them. Memory stays near one
output file plus one unit, whatever the model's size: each unit's values are read from
the rank files (ShardReader), cut into parameters, and a file is written as soon as the
next tensor would push it past ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.checkpoint import CheckpointError, ShardReader, partitions, read_meta, resolve, verify

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_dir(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """A checkpoint's directory from itself, or from its save_dir (``latest`` or ``tag``)."""
    path = Path(path)
    if tag is None and (path / "meta.json").is_file():
        return path
    return resolve(path, tag)


@dataclass
class ExportResult:
    files: list[str]
    tensors: int
    total_bytes: int


def export_weights(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "fp32",
                   max_shard_bytes: int = 5 << 30, tag: str | None = None) -> ExportResult:
    """Write the checkpoint's model weights (fp32 masters cast to ``dtype``; buffers as they are)."""
    from safetensors.torch import save_file
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = checkpoint_dir(checkpoint, tag)
    meta = read_meta(path)
    if "params" not in meta:
        raise CheckpointError(f"{path} predates exportable checkpoints (no parameter map in meta.json)")
    verify(path, meta, [f"rank{r}.{ext}" for r in range(partitions(meta)) for ext in ("bin", "json")]
           + ["rank0.pt"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_unit: dict[int, list[list[Any]]] = defaultdict(list)
    for key, unit, offset, shape in meta["params"]:
        by_unit[unit].append([key, offset, shape])
    buffers = torch.load(path / "rank0.pt", weights_only=False)["buffers"]
    target = DTYPES[dtype]
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = count = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            file = out / f".part-{len(written) + 1:05d}.safetensors"
            save_file(pending, str(file), metadata={"format": "pt"})
            written.append((file, list(pending)))
            pending, pending_bytes = {}, 0

    def add(key: str, t: torch.Tensor) -> None:
        nonlocal pending_bytes, total, count
        nbytes = t.numel() * t.element_size()
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending[key] = t
        pending_bytes += nbytes
        total += nbytes
        count += 1

    reader = ShardReader(path, meta)
    try:
        for index, unit in enumerate(meta["units"]):
            if index not in by_unit:
                continue
            flat = reader.read(index, "master" if unit["trained"] else "shard", 0, unit["numel"])
            for key, offset, shape in by_unit[index]:
                n = int(torch.Size(shape).numel())
                add(key, flat[offset:offset + n].view(shape).to(target).clone())
            del flat
    finally:
        reader.close()
    for key, t in buffers.items():
        add(key, t.contiguous())
    flush()
    return _name_files(out, written, total, count)


def _name_files(out: Path, written: list[tuple[Path, list[str]]], total: int, count: int) -> ExportResult:
    """Give the parts their final names (the count is known only now) and write the index."""
    index_path = out / "model.safetensors.index.json"
    if len(written) == 1:
        final = out / "model.safetensors"
        os.replace(written[0][0], final)
        index_path.unlink(missing_ok=True)
        return ExportResult([final.name], count, total)
    names, weight_map = [], {}
    for i, (file, keys) in enumerate(written, 1):
        name = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        os.replace(file, out / name)
        names.append(name)
        weight_map.update({k: name for k in keys})
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return ExportResult(names + [index_path.name], count, total)


def load_exported(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state_dict an export wrote (every file of it), for checks and small models."""
    from safetensors.torch import load_file
    out = Path(out_dir)
    state: dict[str, torch.Tensor] = {}
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    for name in files:
        state.update(load_file(str(out / name)))
    return state


def describe(checkpoint: str | os.PathLike[str], tag: str | None = None) -> str:
    """What a checkpoint holds, as a table for `offload inspect`."""
    path = checkpoint_dir(checkpoint, tag)
    meta = read_meta(path)
    units = meta["units"]
    trained = sum(u["numel"] for u in units if u["trained"])
    frozen = sum(u["numel"] for u in units if not u["trained"])
    item = getattr(torch, meta["compute_dtype"]).itemsize
    zero = meta["config"].get("zero_optimization", {})
    rows = [
        ("checkpoint", str(path)),
        ("tag", meta["tag"]),
        ("written by", f"offload {meta['version']} (format {meta['format']})"),
        ("world size", f"{meta['world_size']} (state in {partitions(meta)} rank file(s))"),
        ("steps", f"{meta['global_steps']} ({meta['skipped_steps']} skipped), {meta['micro_steps']} micro-batches, "
                  f"{meta['adam_steps']} Adam steps"),
        ("parameters", f"{trained + frozen:,} in {len(units)} units ({trained:,} trained, {frozen:,} frozen)"),
        ("compute dtype", meta["compute_dtype"]),
        ("fp32 master", _mib(4 * trained)),
        ("Adam moments", _mib(8 * trained)),
        ("frozen shards", _mib(item * frozen)),
        ("files", _mib(sum((path / name).stat().st_size for name in meta["files"] if (path / name).is_file()))
         + f" in {len(meta['files'])} files (+ meta.json)"),
        ("ZeRO", f"stage {zero.get('stage')}, optimizer on {zero.get('offload_optimizer', {}).get('device', 'none')}, "
                 f"parameters on {zero.get('offload_param', {}).get('device', 'none')}"),
        ("optimizer", json.dumps(meta["config"].get("optimizer"))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
