"""Checkpoints on disk: all or nothing, checksummed, streamed shard by shard.

Layout of ``save_dir``::

    latest                  the newest complete tag (replaced atomically, last)
    <tag>/meta.json         version, world size, unit layout, counters, config, file checksums
    <tag>/rank<r>.bin       partition r's arrays, unit by unit: fp32 master, exp_avg, exp_avg_sq of
                            trained units, the compute-dtype shard of frozen ones (ZeRO stage 0
                            replicates the state: only rank 0 writes it, as partition 0)
    <tag>/rank<r>.json      where each unit's arrays sit in rank<r>.bin
    <tag>/rank<r>.pt        rank r's small state: RNG states, scheduler, loss scaler, client state

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
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

logger = logging.getLogger("offload.checkpoint")

FORMAT = 1
LATEST = "latest"
CHUNK = 8 << 20  # bytes hashed per read while verifying

# A test sets this in a child process to kill it at a named point of a save (crash injection).
phase_hook: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, or does not fit this engine; the message names the file."""


def _phase(name: str) -> None:
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
    return memoryview(t.numpy()).cast("B")


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
    _phase("meta-written")
    final = save_dir / tag
    old = save_dir / f".old-{tag}"
    if final.exists():  # saving a tag again: the old one moves aside and goes only once the new one is in
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    _phase("renamed")
    if update_latest:
        write_atomic(save_dir / LATEST, tag.encode())
        _phase("latest-written")
    shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(load_dir: Path, tag: str | None) -> Path:
    """The checkpoint directory for ``tag`` (``latest``'s when None), checked to be complete."""
    if tag is None:
        pointer = load_dir / LATEST
        if not pointer.is_file():
            raise CheckpointError(f"{pointer} does not exist: {load_dir} holds no complete checkpoint (pass tag= "
                                  "to load a specific one)")
        tag = pointer.read_text().strip()
    path = load_dir / tag
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path / 'meta.json'} does not exist: no complete checkpoint with tag {tag!r} in "
                              f"{load_dir} (tags there: {', '.join(tags(load_dir)) or 'none'})")
    return path


def tags(load_dir: Path) -> list[str]:
    return sorted(p.name for p in load_dir.iterdir() if (p / "meta.json").is_file()) if load_dir.is_dir() else []


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
        self.dtype = getattr(torch, meta["compute_dtype"])  # of frozen units' shards; the rest is fp32
        self._index: dict[int, dict[tuple[int, str], Entry]] = {}
        self._files: dict[int, BinaryIO] = {}

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
        """Elements [start, stop) of the unit's ``kind`` array (beyond its parameters: zeros)."""
        numel = self.units[unit]["numel"]
        shard = self.units[unit]["padded"] // self.world
        dtype = self.dtype if kind == "shard" else torch.float32
        out = torch.zeros(stop - start, dtype=dtype)
        raw = out.view(torch.int16) if dtype.itemsize == 2 else out
        i = start
        while i < min(stop, numel):
            rank, offset = divmod(i, shard)
            n = min(stop, (rank + 1) * shard, numel) - i
            entry = self._entry(rank, unit, kind)
            f = self._files[rank]
            f.seek(entry.offset + offset * dtype.itemsize)
            view = memoryview(raw[i - start:i - start + n].numpy()).cast("B")
            if f.readinto(view) != len(view):
                raise CheckpointError(f"{self.path / f'rank{rank}.bin'} ends before unit {unit}'s {kind} (a "
                                      "truncated file)")
            i += n
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# --------------------------------------------------------------------------- the engine's state


def _rng_state(cuda: bool) -> dict[str, Any]:
    import random

    import numpy as np
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_new_rank(saved: dict[str, Any], rank: int) -> None:
    """A rank the checkpoint did not have: generators of its own (no two ranks draw the same numbers),
    derived deterministically from the saved rank's torch state and this rank's number."""
    import random

    import numpy as np
    digest = hashlib.sha256(saved["torch"].numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _layout(engine: Any) -> list[dict[str, Any]]:
    return [{"name": u.name, "numel": u.numel, "padded": u.padded, "trained": u.index in engine.optimizer.shards}
            for u in engine.units]


def partitions(meta: dict[str, Any]) -> int:
    """How many rank files a checkpoint's unit buffers are cut into (its world size, or 1 for stage 0)."""
    return meta.get("partitions", meta["world_size"])


def _same_model(layout: list[dict[str, Any]]) -> list[tuple[str, int, bool]]:
    """What must match between a checkpoint and an engine (the padding depends on the world size)."""
    return [(u["name"], u["numel"], u["trained"]) for u in layout]


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


def _barrier(group: Any) -> None:
    if group.pg is not None:
        torch.distributed.barrier(group=group.pg)


def _gather_objects(obj: Any, group: Any) -> list[Any]:
    if group.pg is None:
        return [obj]
    out: list[Any] = [None] * group.world
    torch.distributed.all_gather_object(out, obj, group=group.pg)
    return out


def _all_ok(ok: bool, engine: Any) -> bool:
    """Whether every rank says ok (so no rank is left waiting in a collective when one of them fails)."""
    from offload.zero.collectives import all_reduce_sum
    flag = torch.tensor([0.0 if ok else 1.0], device=engine.accel.device)
    all_reduce_sum(flag, engine.group)
    return float(flag) == 0.0


def save(engine: Any, save_dir: str | os.PathLike[str], tag: str | None, client_state: dict[str, Any] | None,
         save_latest: bool = True) -> Path:
    """Every rank calls it; see the module docstring for what lands where."""
    rank = engine.group.rank
    tag = tag or f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"tag {tag!r} cannot name a checkpoint directory (no '/', no leading '.', not "
                              f"{LATEST!r})")
    tag = _agreed_tag(tag, engine)
    root = Path(save_dir)
    with contextlib.ExitStack() as held:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            held.enter_context(writer_lock(root))
            sweep_stale(root)
            tmp_dir(root, tag).mkdir()
        _barrier(engine.group)
        return _save_locked(engine, root, tag, client_state, save_latest)


def _agreed_tag(tag: str, engine: Any) -> str:
    """checkpoint.tag_validation: every rank must save under the same tag. Fail raises on every rank before
    anything is written; Warn logs it and every rank saves under rank 0's tag (one checkpoint, not a torn one)."""
    mode = engine.config.checkpoint.tag_validation
    if mode == "Ignore" or engine.group.world == 1:
        return tag
    tags = _gather_objects(tag, engine.group)
    if len(set(tags)) == 1:
        return tag
    message = (f"ranks save under different tags ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))}); "
               f"pass the same tag on every rank (checkpoint.tag_validation is {mode})")
    if mode == "Fail":
        raise CheckpointError(message)
    if engine.group.rank == 0:
        logger.warning("%s; saving under rank 0's tag %r", message, tags[0])
    return tags[0]


def _save_locked(engine: Any, root: Path, tag: str, client_state: dict[str, Any] | None,
                 save_latest: bool) -> Path:
    import offload
    group, rank = engine.group, engine.group.rank
    tmp = tmp_dir(root, tag)
    files: dict[str, str] = {}
    if rank < engine.partition.world:  # stage 0: every rank holds the same state; rank 0 writes it
        writer = RankWriter(tmp, rank)
        try:
            for g in engine.optimizer.store.one_at_a_time(read=True, write=False):
                for m in g.members:
                    for kind, values in zip(("master", "exp_avg", "exp_avg_sq"), g.views(m)):
                        writer.add(m.unit, kind, values)
                        _phase("writing")
            for unit in engine.units:
                if unit.index not in engine.optimizer.shards:
                    writer.add(unit.index, "shard", unit.authoritative_shard)
        finally:
            files = writer.close()
    small: dict[str, Any] = {"rng": _rng_state(engine.accel.is_cuda)}
    if rank == 0:
        scheduler = engine.lr_scheduler
        layout, buffers = state_dict_layout(engine)
        params = [[key, unit, slot.offset, list(slot.shape)] for key, unit, slot in layout]
        small.update(client_state=client_state or {}, loss_scaler=dict(engine.loss_scaler.__dict__), buffers=buffers,
                     lr_scheduler=scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
                     param_groups=[{k: v for k, v in g.items() if k != "params"}
                                   for g in engine.optimizer.param_groups])
    files[f"rank{rank}.pt"] = save_small(tmp / f"rank{rank}.pt", small)
    _phase("rank-files-written")
    every = _gather_objects(files, group)
    if rank == 0:
        meta = {"format": FORMAT, "version": offload.__version__, "tag": tag, "world_size": group.world,
                "partitions": engine.partition.world,
                "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                "micro_steps": engine.micro_steps, "adam_steps": engine.optimizer.adam_steps,
                "compute_dtype": str(engine.compute_dtype).removeprefix("torch."), "units": _layout(engine),
                "params": params,
                "config": engine.config.to_dict(), "files": {k: v for f in every for k, v in f.items()}}
        publish(root, tag, meta, update_latest=save_latest)
    _barrier(group)
    return root / tag


def load(engine: Any, load_dir: str | os.PathLike[str], tag: str | None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> tuple[Path, dict[str, Any]]:
    """Every rank calls it. Checks first (layout, world size, checksums on every rank), then changes state.

    As DeepSpeed documents them: ``load_module_only`` restores the weights alone (optimizer state, counters, loss
    scale, schedule and RNG stay as the engine has them); ``load_optimizer_states=False`` keeps the engine's own
    Adam moments, step count and hyperparameters; ``load_lr_scheduler_states=False`` keeps its schedule.
    """
    rank = engine.group.rank
    if rank == 0 and Path(load_dir).is_dir():
        with writer_lock(Path(load_dir), wait=False) as free:
            if free:  # else a save is running there, and what looks stale is its work
                sweep_stale(Path(load_dir))
    path = resolve(Path(load_dir), tag)
    meta = read_meta(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / 'meta.json'} has format {meta.get('format')!r}; this offload reads {FORMAT}")
    old_world, old_parts, parts = meta["world_size"], partitions(meta), engine.partition
    ours = _layout(engine)
    if _same_model(meta["units"]) != _same_model(ours):
        diff = next((f"{a} in the checkpoint, {b} here" for a, b in zip(_same_model(meta["units"]),
                                                                          _same_model(ours)) if a != b),
                    f"{len(meta['units'])} units in the checkpoint, {len(ours)} here")
        raise CheckpointError(f"{path} does not fit this model and config: the units differ ({diff}); build the "
                              "same model with the same offload.unit_bytes and compute dtype")
    # Same partitioning: this rank's own files. Another: a rank's range may lie in any old partition's file.
    sources = [parts.rank] if old_parts == parts.world else list(range(old_parts))
    small_from = rank % old_world
    names = [f"rank{r}.{ext}" for r in sources for ext in ("bin", "json")]
    names += sorted({f"rank{small_from}.pt", "rank0.pt"})
    error = None
    try:
        verify(path, meta, names)
    except CheckpointError as e:
        error = e
    if not _all_ok(error is None, engine):
        raise error or CheckpointError(f"{path}: another rank found a damaged or missing file (see its error)")
    if old_parts != parts.world:
        logger.info("loading %s cut into %d partitions into %d: each rank reads its ranges from the old ones", path,
                    old_parts, parts.world)
    engine.optimizer.drain()
    engine.runtime.reshard_all()
    reader = ShardReader(path, meta)

    def take(unit: Any, kind: str) -> torch.Tensor:
        return reader.read(unit.index, kind, unit.shard_start, unit.shard_start + unit.shard_numel)

    units = {u.index: u for u in engine.units}
    moments = load_optimizer_states and not load_module_only
    # zero_optimization.load_from_fp32_weights false: the master weights are rebuilt from the checkpoint's
    # compute-dtype weights (rounded), as DeepSpeed does from its 16-bit ones.
    rounded = None if engine.config.zero_optimization.load_from_fp32_weights else getattr(torch, meta["compute_dtype"])
    try:
        for g in engine.optimizer.store.one_at_a_time(read=not moments, write=True):
            for m in g.members:
                unit = units[m.unit]
                master, exp_avg, exp_avg_sq = g.views(m)
                saved = take(unit, "master")
                master.copy_(saved if rounded is None else saved.to(rounded).float())
                if moments:
                    exp_avg.copy_(take(unit, "exp_avg"))
                    exp_avg_sq.copy_(take(unit, "exp_avg_sq"))
                engine.set_unit_values(unit, master)
        for unit in engine.units:
            if unit.index not in engine.optimizer.shards:
                engine.set_unit_values(unit, take(unit, "shard"))
        if engine.stage.resident_params:
            engine.runtime.spread_partitions()
    except BaseException as e:
        engine.close()
        raise CheckpointError(f"loading {path} failed part-way ({e}); the engine's state is half replaced, so it "
                              "was closed: create a new engine and load again") from e
    finally:
        reader.close()
    small = torch.load(path / f"rank{small_from}.pt", weights_only=False)
    main = small if small_from == 0 else torch.load(path / "rank0.pt", weights_only=False)
    engine.optimizer.clear_grads()
    engine._pending_micro = 0
    if not load_module_only:
        if rank < old_world:
            _set_rng_state(small["rng"])
        else:
            _seed_new_rank(small["rng"], rank)
        engine.global_steps, engine.skipped_steps = meta["global_steps"], meta["skipped_steps"]
        engine.micro_steps = meta["micro_steps"]
        if load_optimizer_states:
            engine.optimizer.adam_steps = meta["adam_steps"]
            for g, saved in zip(engine.optimizer.param_groups, main["param_groups"]):
                g.update(saved)
        engine.loss_scaler.__dict__.update(main["loss_scaler"])
        scheduler = engine.lr_scheduler
        if load_lr_scheduler_states and main["lr_scheduler"] is not None and hasattr(scheduler, "load_state_dict"):
            scheduler.load_state_dict(main["lr_scheduler"])
    return path, main["client_state"]
