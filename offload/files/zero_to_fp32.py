#!/usr/bin/env python3
"""fp32 weights out of an offload checkpoint with nothing but Python and torch: copied beside every checkpoint.

    python zero_to_fp32.py SAVE_DIR OUT_DIR [--tag TAG] [--max_shard_size 5GB] [--safe_serialization]

takes DeepSpeed's flags and writes what DeepSpeed's script writes for them: ``OUT_DIR/pytorch_model.bin``
(or ``pytorch_model-0000i-of-0000N.bin`` with ``pytorch_model.bin.index.json``), torch.save's format, one
shard in memory at a time; with ``--safe_serialization`` ``model.safetensors`` (or its shards and index),
streamed one unit's values at a time, which ``safetensors.torch.load_file`` and ``from_pretrained``
read. Every file it reads is checked against the sha256 in meta.json first; nothing is unpickled but
the buffers, by torch's restricted unpickler.

[Note: a recovery script with no offload] It is DeepSpeed's ``zero_to_fp32.py`` for
offload: for the person who has the checkpoint folder and not the package (another
machine, years later). So it imports only the standard library and torch, and repeats
what it needs of offload's format (offload/files/training_checkpoint.py: the rank files,
ShardReader's cut; offload/files/weights_file.py: the safetensors header) instead of
importing it. ``offload export-weights`` is the same output for those who have offload;
a test holds the two equal and keeps this file free of offload imports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

Spec = tuple[str, torch.dtype, list[int], int]  # key, dtype, shape, bytes

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def checkpoint_dir(path: Path, tag: str | None) -> Path:
    if tag is None and (path / "meta.json").is_file():
        return path
    if tag is None:
        if not (path / "latest").is_file():
            sys.exit(f"{path} holds no meta.json and no `latest`: pass a checkpoint directory, or --tag")
        tag = (path / "latest").read_text().strip()
    return path / tag


def verify(path: Path, meta: dict[str, Any], names: list[str]) -> None:
    for name in names:
        digest = hashlib.sha256()
        with open(path / name, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
        if digest.hexdigest() != meta["files"].get(name):
            sys.exit(f"{path / name} is damaged or missing from meta.json (its sha256 differs): use another tag")


class Units:
    """A unit's flat fp32 master (or frozen shard) from the rank files that hold its slices."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.units = path, meta["units"]
        self.world = meta.get("partitions", meta["world_size"])
        self.frozen_dtype = getattr(torch, meta["compute_dtype"])
        self.index = [{(e["unit"], e["kind"]): e for e in json.loads((path / f"rank{r}.json").read_text())}
                      for r in range(self.world)]

    def read(self, unit: int) -> torch.Tensor:
        """The unit's master as fp32 (a bf16 one, of a state held in fewer bytes, widened: exact)."""
        info = self.units[unit]
        kind, dtype = ("master", torch.float32) if info["trained"] else ("shard", self.frozen_dtype)
        numel, shard = info["numel"], info["padded"] // self.world
        if numel:
            dtype = getattr(torch, self.index[0][(unit, kind)]["dtype"])
        out = torch.empty(numel, dtype=dtype)
        raw = memoryview(out.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
        size = dtype.itemsize
        i = 0
        while i < numel:
            rank, offset = divmod(i, shard)
            n = min((rank + 1) * shard, numel) - i
            entry = self.index[rank][(unit, kind)]
            with open(self.path / f"rank{rank}.bin", "rb") as f:
                f.seek(entry["offset"] + offset * size)
                if f.readinto(raw[i * size:(i + n) * size]) != n * size:
                    sys.exit(f"{self.path / f'rank{rank}.bin'} ends early (a truncated file)")
            i += n
        return out.float() if kind == "master" else out


def header(specs: list[Spec]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape, nbytes in specs:
        head[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _opened(save_dir: Path, tag: str | None, exclude_frozen: bool = False
            ) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor], dict[int, list[tuple[str, int, list[int]]]]]:
    """A checkpoint checked: its directory, meta, buffers, and its parameters by unit (the units nothing trained
    left out with ``exclude_frozen``)."""
    path = checkpoint_dir(save_dir, tag)
    meta = json.loads((path / "meta.json").read_text())
    world = meta.get("partitions", meta["world_size"])
    verify(path, meta, [f"rank{r}.{ext}" for r in range(world) for ext in ("bin", "json")] + ["rank0.pt"])
    buffers = torch.load(path / "rank0.pt", weights_only=True, map_location="cpu")["buffers"]
    by_unit: dict[int, list[tuple[str, int, list[int]]]] = {}
    for key, unit, offset, shape in meta["params"]:
        if exclude_frozen and not meta["units"][unit]["trained"]:
            continue
        by_unit.setdefault(unit, []).append((key, offset, shape))
    return path, meta, buffers, by_unit


def fp32_state_dict(save_dir: Path, tag: str | None = None, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """The whole model as an fp32 state dict in memory (DeepSpeed's get_fp32_state_dict_from_zero_checkpoint):
    parameters from the masters (a frozen unit's from its shard), then buffers as saved."""
    path, meta, buffers, by_unit = _opened(Path(save_dir), tag, exclude_frozen)
    units = Units(path, meta)
    out: dict[str, torch.Tensor] = {}
    for unit in sorted(by_unit):
        flat = units.read(unit).float()
        for key, offset, shape in by_unit[unit]:
            out[key] = flat[offset:offset + int(torch.Size(shape).numel())].clone().view(shape)
    out.update(buffers)
    return out


def _shard_names(stem: str, ext: str, count: int) -> list[str]:
    return [f"{stem}.{ext}"] if count == 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def recover(save_dir: Path, out: Path, tag: str | None = None, max_shard_bytes: int = 5 << 30,
            safe_serialization: bool = True, exclude_frozen: bool = False) -> list[str]:
    """The checkpoint's fp32 weights into ``out``: safetensors files (``model.safetensors``, or shards with their
    index) streamed a unit at a time; or, not ``safe_serialization``, as DeepSpeed's script writes by default,
    ``pytorch_model.bin`` (or its shards and ``pytorch_model.bin.index.json``), torch.save's format, one shard in
    memory at a time."""
    path, meta, buffers, by_unit = _opened(save_dir, tag, exclude_frozen)
    specs: list[Spec] = []  # in the order they are written
    for unit in sorted(by_unit):
        for key, _, shape in by_unit[unit]:
            specs.append((key, torch.float32, list(shape), 4 * int(torch.Size(shape).numel())))
    specs += [(key, t.dtype, list(t.shape), t.numel() * t.element_size()) for key, t in buffers.items()]
    files: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec[3] > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec[3]
    names = _shard_names("model", "safetensors", len(files)) if safe_serialization else \
        _shard_names("pytorch_model", "bin", len(files))

    def values() -> Iterator[torch.Tensor]:
        units = Units(path, meta)
        for unit in sorted(by_unit):
            flat = units.read(unit).float()
            for _key, offset, shape in by_unit[unit]:
                yield flat[offset:offset + int(torch.Size(shape).numel())]
        yield from buffers.values()

    out.mkdir(parents=True, exist_ok=True)
    source = values()
    for name, part in zip(names, files, strict=True):
        tmp = out / f".{name}.tmp"
        if safe_serialization:
            with open(tmp, "wb") as f:
                f.write(header(part))
                for _ in part:
                    t = next(source).contiguous()
                    f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            torch.save({key: next(source).clone().view(shape) for key, _, shape, _ in part}, tmp)
        os.replace(tmp, out / name)
    if len(files) > 1:
        weight_map = {spec[0]: name for name, part in zip(names, files, strict=True) for spec in part}
        index = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        (out / index).write_text(json.dumps(
            {"metadata": {"total_size": sum(s[3] for s in specs)}, "weight_map": weight_map}, indent=1))
        names.append(index)
    return names


def shard_size(text: str) -> int:
    """A shard size as DeepSpeed's script takes it: bytes, or digits and a unit ("5GB" is 5e9, "5GiB" 5 x 2**30)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    digits = text.strip().upper().rstrip("BKMGTI")
    unit = text.strip().upper()[len(digits):]
    if not digits.replace(".", "", 1).isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or digits and a unit (5GB, 500MiB)")
    return int(float(digits) * units[unit])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the save_dir (its `latest` is used) or a checkpoint directory")
    parser.add_argument("out", type=Path, help="where the weight files go")
    parser.add_argument("-t", "--tag", default=None, help="a tag inside save_dir instead of `latest`")
    parser.add_argument("--max_shard_size", "--max-shard-size", type=shard_size, default=5 * 10**9,
                        help="the largest file before the weights are sharded: bytes, or as DeepSpeed's 5GB (the "
                             "default)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="safetensors (model.safetensors); without it, as DeepSpeed's script, pytorch_model.bin")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters of units nothing trained")
    parser.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's flag: nothing more is printed")
    args = parser.parse_args()
    for name in recover(args.checkpoint, args.out, args.tag, args.max_shard_size, args.safe_serialization,
                        args.exclude_frozen_parameters):
        print(args.out / name)


if __name__ == "__main__":
    main()
