"""Training checkpoint files: all or nothing, checksummed, streamed shard by shard (the on-disk format).

Layout of ``save_dir``::

    latest                  the newest complete tag (replaced atomically, last)
    <tag>/meta.json         version, world size, unit layout, counters, config, file checksums
    <tag>/rank<r>.bin       partition r's arrays, unit by unit: fp32 master, exp_avg, exp_avg_sq of
                            trained units, the compute-dtype shard of frozen ones (ZeRO stage 0
                            replicates the state: only rank 0 writes it, as partition 0)
    <tag>/rank<r>.json      where each unit's arrays sit in rank<r>.bin
    <tag>/rank<r>.pt        rank r's small state: RNG states, scheduler, loss scaler, client state,
                            as plain data (offload/files/small_state.py)
    <tag>/client_state.pt   the script's client_state values that are not plain data, if any

A save writes everything under ``.tmp-<tag>``, fsyncs each file, then rank 0 writes
``meta.json`` (with every file's sha256), renames the directory into place and
replaces ``latest``. A process killed at any moment leaves the previous checkpoint
loadable (``latest`` still names it) and the new one either complete or absent.
A load verifies every checksum before it changes any state.

[Note: stale writes] Rank 0 holds ``save_dir/.lock`` (flock) for the whole of a save.
What a killed save leaves behind (``.tmp-<tag>``, or ``.old-<tag>`` when it was
replacing a tag) belongs to no live writer exactly when that lock can be taken, so the
next save (which holds it) or load (which takes it briefly, and sweeps nothing while a
save runs) removes the ``.tmp-*`` directories, puts an ``.old-<tag>`` back where its
tag is missing (the save died between moving the old copy aside and renaming the new
one in), and logs what it did.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

logger = logging.getLogger("offload.checkpoint")  # one logger for the format and the engine glue

FORMAT = 2  # 2: rank<r>.pt holds plain data only (see [Note: checkpoints run no code] in small_state.py)
READS = (1, 2)  # 1: numpy's RNG state as an array; client_state as the script gave it
LATEST = "latest"
CHUNK = 8 << 20  # bytes hashed per read while verifying

# A test sets this in a child process to kill it at a named point of a save (crash injection).
phase_hook: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, or does not fit this engine; the message names the file."""


class CheckpointDiskFull(CheckpointError):
    """A save that ran out of room on its file system; the partial save is removed. ``errno`` is the system's
    (ENOSPC, or EDQUOT for a quota)."""

    def __init__(self, message: str, error_number: int) -> None:
        super().__init__(message)
        self.errno = error_number


FULL = (errno.ENOSPC, errno.EDQUOT)


def full_disk_errno(error: BaseException | None) -> int | None:
    """The errno of a full file system in ``error`` or what caused it, else None."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in FULL:
            return error.errno
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def phase(name: str) -> None:
    if phase_hook is not None:
        phase_hook(name)


@dataclass(frozen=True)
class Entry:
    """One array in a rank file: ``unit``'s ``kind`` (master, exp_avg, exp_avg_sq or shard)."""

    unit: int
    kind: str
    dtype: str
    numel: int
    offset: int


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or its old content, never a mix (a crash in between leaves a .tmp file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    # numpy's stubs give ndarray __buffer__ only from Python 3.12 (the checked version is 3.10)
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


class RankWriter:
    """Streams one rank's arrays into ``rank<r>.bin`` while hashing them."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / f"rank{rank}.bin"
        self.index_path = directory / f"rank{rank}.json"
        self._f: BinaryIO = open(self.path, "wb")
        self._hash = hashlib.sha256()
        self._offset = 0
        self.entries: list[Entry] = []

    def add(self, unit: int, kind: str, t: torch.Tensor) -> None:
        data = _raw_bytes(t)
        self._f.write(data)
        self._hash.update(data)
        self.entries.append(Entry(unit, kind, str(t.dtype).removeprefix("torch."), t.numel(), self._offset))
        self._offset += len(data)

    def close(self) -> dict[str, str]:
        """Flush and fsync both files; returns their sha256 by file name."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        index = json.dumps([e.__dict__ for e in self.entries]).encode()
        with open(self.index_path, "wb") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        return {self.path.name: self._hash.hexdigest(), self.index_path.name: hashlib.sha256(index).hexdigest()}


def save_small(path: Path, obj: Any) -> str:
    """torch.save ``obj`` to ``path`` (fsynced); returns its sha256."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return file_sha256(path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tmp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".tmp-{tag}"


LOCK = ".lock"


@contextlib.contextmanager
def writer_lock(save_dir: Path, wait: bool = True) -> Iterator[bool]:
    """Hold ``save_dir``'s writer lock inside the block (see [Note: stale writes]); yields False, holding
    nothing, when ``wait`` is false and another process holds it."""
    fd = os.open(save_dir / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def sweep_stale(save_dir: Path) -> list[str]:
    """Undo what killed saves left in ``save_dir``; the caller holds the writer lock. Returns what it did."""
    done: list[str] = []
    for entry in sorted(save_dir.iterdir()):
        if entry.name.startswith(".tmp-") and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry.name} (an unfinished save)")
        elif entry.name.startswith(".old-") and entry.is_dir():
            tag = entry.name.removeprefix(".old-")
            if (save_dir / tag / "meta.json").is_file():
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"removed {entry.name} (replaced by a complete {tag})")
            else:
                shutil.rmtree(save_dir / tag, ignore_errors=True)
                os.replace(entry, save_dir / tag)
                done.append(f"restored {tag} from {entry.name} (a save replacing it died half-way)")
    if done:
        fsync_dir(save_dir)
        logger.warning("checkpoint directory %s: %s", save_dir, "; ".join(done))
    return done


def publish(save_dir: Path, tag: str, meta: dict[str, Any], update_latest: bool = True) -> Path:
    """Rank 0, after every rank's files are written: meta.json, then the directory, then ``latest``."""
    tmp = tmp_dir(save_dir, tag)
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode())
    phase("meta-written")
    final = save_dir / tag
    old = save_dir / f".old-{tag}"
    if final.exists():  # saving a tag again: the old one moves aside and goes only once the new one is in
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    phase("renamed")
    if update_latest:
        write_atomic(save_dir / LATEST, tag.encode())
        phase("latest-written")
    shutil.rmtree(old, ignore_errors=True)
    return final


def latest_tag(save_dir: Path) -> str | None:
    """The tag ``latest`` names in ``save_dir`` (None: no pointer there)."""
    pointer = save_dir / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def resolve(load_dir: Path, tag: str | None) -> Path:
    """The checkpoint directory for ``tag`` (``latest``'s when None), checked to be complete."""
    if tag is None:
        tag = latest_tag(load_dir)
        if tag is None:
            where = (f"{load_dir} holds no complete checkpoint" if load_dir.is_dir() else
                     f"{load_dir} does not exist, so it holds no complete checkpoint")
            raise CheckpointError(f"{load_dir / LATEST} does not exist: {where} (name one by its tag to load a "
                                  "specific one: tag= in Python, --tag on the command line)")
    path = load_dir / tag
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path / 'meta.json'} does not exist: no complete checkpoint with tag {tag!r} in "
                              f"{load_dir} (tags there: {', '.join(tags(load_dir)) or 'none'})")
    return path


def tags(load_dir: Path) -> list[str]:
    return sorted(p.name for p in load_dir.iterdir() if (p / "meta.json").is_file()) if load_dir.is_dir() else []


def retire_old(root: Path, keep_last: int | None) -> list[str]:
    """After a save is published: the oldest complete checkpoints beyond the newest ``keep_last`` removed (None:
    every one kept), never the one ``latest`` names; rank 0, holding the writer lock, so no save is under way.
    Returns the tags removed."""
    if keep_last is None:
        return []
    complete = sorted((root / t for t in tags(root) if not t.startswith(".")),
                      key=lambda p: (p / "meta.json").stat().st_mtime_ns)
    keep = {p.name for p in complete[-keep_last:]} | {latest_tag(root)}
    gone = [p.name for p in complete if p.name not in keep]
    for name in gone:
        # moved aside first, so a kill part-way leaves a name the next save sweeps, never a half-removed tag
        aside = root / f".tmp-retired-{name}"
        os.replace(root / name, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if gone:
        fsync_dir(root)
        logger.info("checkpoints in %s: removed %s (keeping the newest %d)", root, ", ".join(gone), keep_last)
    return gone


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'meta.json'} cannot be read as a checkpoint's metadata: {e}") from e


def verify(path: Path, meta: dict[str, Any], names: list[str]) -> None:
    """The named files match the checksums meta.json recorded for them."""
    for name in names:
        file = path / name
        if name not in meta["files"] or not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if file_sha256(file) != meta["files"][name]:
            raise CheckpointError(f"{file} is damaged: its sha256 differs from the one recorded when it was saved "
                                  "(a flipped or truncated file); load another tag")


def partitions(meta: dict[str, Any]) -> int:
    """How many rank files a checkpoint's unit buffers are cut into (its world size, or 1 for stage 0)."""
    return meta.get("partitions", meta["world_size"])


class ShardReader:
    """Ranges of a unit's flat arrays out of the rank files of a checkpoint written by any number of ranks.

    A unit's flat buffer was cut into ``padded / W`` elements per rank; element i sits in rank
    i // shard's file. Reading a range touches only the files that hold it, one slice each, so a
    reader holds no more than the range asked for (padding reads as zeros).
    """

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.world = partitions(meta)
        self.units = meta["units"]
        self.dtype = getattr(torch, meta["compute_dtype"])  # of frozen units' shards; the state: as its entries say
        self._index: dict[int, dict[tuple[int, str], Entry]] = {}
        self._files: dict[int, io.BufferedReader] = {}

    def _entry(self, rank: int, unit: int, kind: str) -> Entry:
        if rank not in self._index:
            entries = json.loads((self.path / f"rank{rank}.json").read_text())
            self._index[rank] = {(e["unit"], e["kind"]): Entry(**e) for e in entries}
            self._files[rank] = open(self.path / f"rank{rank}.bin", "rb")
        try:
            return self._index[rank][(unit, kind)]
        except KeyError:
            raise CheckpointError(f"{self.path / f'rank{rank}.json'} has no {kind} for unit {unit}") from None

    def read(self, unit: int, kind: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the unit's ``kind`` array (beyond its parameters: zeros), in the dtype it was
        saved in (the optimizer state as it was held: fp32, or bf16 in a format of fewer bytes)."""
        numel = self.units[unit]["numel"]
        shard = self.units[unit]["padded"] // self.world
        dtype = self.dtype if kind == "shard" else torch.float32
        if start < min(stop, numel):
            dtype = getattr(torch, self._entry(start // shard, unit, kind).dtype)
        out = torch.zeros(stop - start, dtype=dtype)
        raw = out.view(torch.int16) if dtype.itemsize == 2 else out
        i = start
        while i < min(stop, numel):
            rank, offset = divmod(i, shard)
            n = min(stop, (rank + 1) * shard, numel) - i
            entry = self._entry(rank, unit, kind)
            f = self._files[rank]
            f.seek(entry.offset + offset * dtype.itemsize)
            # numpy's stubs give ndarray __buffer__ only from Python 3.12 (as in _raw_bytes)
            view = memoryview(raw[i - start:i - start + n].numpy()).cast("B")  # type: ignore[arg-type]
            if f.readinto(view) != len(view):
                raise CheckpointError(f"{self.path / f'rank{rank}.bin'} ends before unit {unit}'s {kind} (a "
                                      "truncated file)")
            i += n
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
