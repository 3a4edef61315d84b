"""Plain weights out of a checkpoint: a consolidated state_dict as safetensors, streamed unit by unit.

The files follow Hugging Face's sharded layout (``model.safetensors``, or
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``), so
``model.load_state_dict`` and ``from_pretrained`` read them. Memory stays near one unit,
whatever the model's size: the files and their headers are planned from the layout
(a file ends where the next tensor would push it past ``max_shard_bytes``), then each
unit's values are read from the rank files (ShardReader), cut into parameters and
streamed into their file (offload/files/weights_file.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.files import small_state
from offload.files.training_checkpoint import CheckpointError, ShardReader, partitions, read_meta, resolve, verify
from offload.files.weights_file import SafetensorsStream, TensorSpec
from offload.store.state_format import FP32, StateFormat

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
                   max_shard_bytes: int = 5 << 30, tag: str | None = None, replace: bool = False) -> ExportResult:
    """Write the checkpoint's model weights (fp32 masters cast to ``dtype``; buffers as they are).

    A directory that already holds weights is refused unless ``replace``; then the new files are written beside
    the old ones first, and the old shards and index go together just before the new ones take their names, so
    the directory never holds a mix of the two exports."""
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
    old = _weight_files(out)
    if old and not replace:
        raise FileExistsError(f"{out} already holds weights ({', '.join(p.name for p in old[:3])}"
                              f"{' ...' if len(old) > 3 else ''}); choose an empty directory, or replace them "
                              "(--replace, replace=True)")
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        result = _export(path, meta, staging, DTYPES[dtype], max_shard_bytes)
        for file in old:
            file.unlink()
        for name in result.files:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _weight_files(out: Path) -> list[Path]:
    """What an export writes (and so what a new one replaces) in ``out``."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name == "model.safetensors.index.json"
                  or (p.name.startswith("model") and p.name.endswith(".safetensors")))


def _export(path: Path, meta: dict[str, Any], out: Path, target: torch.dtype, max_shard_bytes: int) -> ExportResult:
    by_unit: dict[int, list[list[Any]]] = defaultdict(list)
    for key, unit, offset, shape in meta["params"]:
        by_unit[unit].append([key, offset, shape])
    buffers = small_state.read(path / "rank0.pt")["buffers"]
    specs = [TensorSpec(key, target, tuple(shape)) for index in range(len(meta["units"]))
             for key, _, shape in by_unit.get(index, ())]
    specs += [TensorSpec(key, t.dtype, tuple(t.shape)) for key, t in buffers.items()]
    files = split_files(specs, max_shard_bytes)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        """In ``specs``' order, one unit's values in memory at a time."""
        reader = ShardReader(path, meta)
        try:
            for index, unit in enumerate(meta["units"]):
                if index not in by_unit:
                    continue
                flat = reader.read(index, "master" if unit["trained"] else "shard", 0, unit["numel"])
                for key, offset, shape in by_unit[index]:
                    n = int(torch.Size(shape).numel())
                    yield key, flat[offset:offset + n].view(shape).to(target)
                del flat
        finally:
            reader.close()
        yield from buffers.items()

    source = tensors()
    for name, part in files:
        with SafetensorsStream(out / name, part, metadata={"format": "pt"}) as f:
            for _ in part:
                f.write(*next(source))
    index_path = out / "model.safetensors.index.json"
    total = sum(s.nbytes for s in specs)
    if len(files) == 1:
        return ExportResult([files[0][0]], len(specs), total)
    weight_map = {s.key: name for name, part in files for s in part}
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return ExportResult([name for name, _ in files] + [index_path.name], len(specs), total)


def split_files(specs: list[TensorSpec], max_bytes: int) -> list[tuple[str, list[TensorSpec]]]:
    """Hugging Face's sharded names for ``specs`` cut into files of at most ``max_bytes`` (a larger tensor
    alone in its file): ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``."""
    parts: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if parts[-1] and size + spec.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(spec)
        size += spec.nbytes
    if len(parts) == 1:
        return [("model.safetensors", parts[0])]
    return [(f"model-{i:05d}-of-{len(parts):05d}.safetensors", part) for i, part in enumerate(parts, 1)]


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
    """What a checkpoint holds, as a table for `offload inspect`, after checking every file it lists against its
    checksum (CheckpointError naming the damaged or missing one)."""
    path = checkpoint_dir(checkpoint, tag)
    meta = read_meta(path)
    verify(path, meta, sorted(meta["files"]))
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
                  f"{meta['adam_steps']} optimizer steps"),
        ("parameters", f"{trained + frozen:,} in {len(units)} units ({trained:,} trained, {frozen:,} frozen)"),
        ("compute dtype", meta["compute_dtype"]),
        *_state_rows(meta.get("state_format", FP32.meta()), trained),
        ("frozen shards", _mib(item * frozen)),
        ("files", _mib(sum((path / name).stat().st_size for name in meta["files"]))
         + f" in {len(meta['files'])} files (+ meta.json), every checksum verified"),
        ("ZeRO", f"stage {zero.get('stage')}, optimizer on {zero.get('offload_optimizer', {}).get('device', 'none')}, "
                 f"parameters on {zero.get('offload_param', {}).get('device', 'none')}"),
        ("optimizer", json.dumps(meta["config"].get("optimizer"))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _state_rows(meta: dict[str, Any], trained: int) -> list[tuple[str, str]]:
    """The master's and the moments' bytes as the checkpoint holds them (its ``state_format``: a 16+16 master saved
    as the float32 it is, a bf16 one in 2 bytes; the moments the update keeps, in their dtype)."""
    fmt = StateFormat.from_meta(meta)
    moments = len(fmt.held) * fmt.moment_bytes
    return [(f"{meta['master']} master", _mib(fmt.master_bytes * trained)),
            ("moments", f"{_mib(moments * trained)} ({', '.join(fmt.held) or 'none kept'}, {meta['moments']})")]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
