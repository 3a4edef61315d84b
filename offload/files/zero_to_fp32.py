#!/usr/bin/env python3
"""fp32 weights out of an offload checkpoint with nothing but Python and torch: copied beside every checkpoint.

    python zero_to_fp32.py SAVE_DIR OUT_DIR [--tag TAG] [--max-shard-size BYTES]

writes ``OUT_DIR/model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json``), which ``model.load_state_dict(safetensors.torch.load_file(...))``
and ``from_pretrained`` read, streaming one unit's values at a time: memory stays near one
unit whatever the model's size. Every file it reads is checked against the sha256 in
meta.json first; nothing is unpickled but the buffers, by torch's restricted unpickler.

[Note: a recovery script with no offload] It is DeepSpeed's ``zero_to_fp32.py`` for
offload: for the person who has the checkpoint folder and not the package (another
machine, years later). So it imports only the standard library and torch, and repeats
what it needs of offload's format (offload/files/checkpoint_files.py: the rank files,
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


def recover(save_dir: Path, out: Path, tag: str | None = None, max_shard_bytes: int = 5 << 30) -> list[str]:
    path = checkpoint_dir(save_dir, tag)
    meta = json.loads((path / "meta.json").read_text())
    world = meta.get("partitions", meta["world_size"])
    verify(path, meta, [f"rank{r}.{ext}" for r in range(world) for ext in ("bin", "json")] + ["rank0.pt"])
    buffers = torch.load(path / "rank0.pt", weights_only=True, map_location="cpu")["buffers"]
    by_unit: dict[int, list[tuple[str, int, list[int]]]] = {}
    for key, unit, offset, shape in meta["params"]:
        by_unit.setdefault(unit, []).append((key, offset, shape))
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
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])

    def values() -> Iterator[torch.Tensor]:
        units = Units(path, meta)
        for unit in sorted(by_unit):
            flat = units.read(unit).float()
            for key, offset, shape in by_unit[unit]:
                yield flat[offset:offset + int(torch.Size(shape).numel())]
        yield from buffers.values()

    out.mkdir(parents=True, exist_ok=True)
    source = values()
    for name, part in zip(names, files):
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(header(part))
            for _ in part:
                t = next(source).contiguous()
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        os.replace(tmp, out / name)
    if len(files) > 1:
        weight_map = {spec[0]: name for name, part in zip(names, files) for spec in part}
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(s[3] for s in specs)}, "weight_map": weight_map}, indent=1))
        names.append("model.safetensors.index.json")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the save_dir (its `latest` is used) or a checkpoint directory")
    parser.add_argument("out", type=Path, help="where the safetensors files go")
    parser.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    parser.add_argument("--max-shard-size", type=int, default=5 << 30, help="bytes per file at most (5 GiB)")
    args = parser.parse_args()
    for name in recover(args.checkpoint, args.out, args.tag, args.max_shard_size):
        print(args.out / name)


if __name__ == "__main__":
    main()
