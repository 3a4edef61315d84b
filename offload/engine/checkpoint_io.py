"""Saving and resuming an engine: which of its state goes into which training checkpoint file, and back.

The files and their guarantees (all or nothing, checksums, locks, sweeping what a killed
save left) are offload/files/training_checkpoint.py's. This room reads the engine only through
what it exposes: its units' layout, the optimizer's state store, the parameter store, the
module's state_dict and ``train_state()`` / ``load_train_state()`` for the counters and
the loss scale.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from offload.engine.weights import live_buffers, rewrite_units, spread_rewritten, state_dict_layout
from offload.files import small_state
from offload.files.training_checkpoint import (
    FORMAT,
    LATEST,
    READS,
    CheckpointDiskFull,
    CheckpointError,
    RankWriter,
    ShardReader,
    full_disk_errno,
    latest_tag,
    partitions,
    phase,
    publish,
    read_meta,
    resolve,
    retire_old,
    save_small,
    sweep_stale,
    tmp_dir,
    tree_bytes,
    verify,
    write_atomic,
    writer_lock,
)
from offload.store.state_format import FP32, MOMENTS, StateFormat, StateSlot
from offload.version import __version__
from offload.zero.collectives import all_ok

logger = logging.getLogger("offload.checkpoint")


def _rng_state(cuda: bool) -> dict[str, Any]:
    import random

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": small_state.numpy_state_plain()}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    small_state.set_numpy_state(state["numpy"])
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
    return [{"name": u.name, "numel": u.numel, "padded": u.padded, "trained": engine.optimizer.trains(u.index)}
            for u in engine.units]


def _same_model(layout: list[dict[str, Any]]) -> list[tuple[str, int, bool]]:
    """What must match between a checkpoint and an engine (the padding depends on the world size)."""
    return [(u["name"], u["numel"], u["trained"]) for u in layout]


def _saved_params(engine: Any, meta: dict[str, Any], path: Path) -> dict[str, tuple[int, int]]:
    """Where the checkpoint holds each of this engine's parameters (saved unit, element offset in it), when its
    units are cut differently; CheckpointError where the parameters themselves differ."""
    saved = {key: (unit, offset, tuple(shape)) for key, unit, offset, shape in meta["params"]}
    trained = {i for i, u in enumerate(meta["units"]) if u["trained"]}
    units = {u.index: u for u in engine.units}
    ours = {key: (units[index], slot) for key, index, slot in state_dict_layout(engine)[0]}  # tied: every key
    problems = [f"{k}: not in the checkpoint" for k in ours if k not in saved]
    problems += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in ours]
    problems += [f"{k}: {list(saved[k][2])} in the checkpoint, {list(slot.shape)} here"
                 for k, (_, slot) in ours.items() if k in saved and saved[k][2] != tuple(slot.shape)]
    problems += [f"{k}: frozen in the checkpoint (no optimizer state saved), trained here"
                 for k, (unit, _) in ours.items() if k in saved and engine.optimizer.trains(unit.index)
                 and saved[k][0] not in trained]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{path} does not fit this model: {shown}")
    logger.info("loading %s: its units are cut differently (another offload.unit_bytes or compute dtype); each "
                "rank reads its ranges parameter by parameter", path)
    return {k: (v[0], v[1]) for k, v in saved.items()}


def _read_relaid(reader: ShardReader, meta: dict[str, Any], saved_at: dict[str, tuple[int, int]], unit: Any,
                 kind: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's range of ``unit``'s ``kind`` array, gathered from the saved units that hold its parameters
    (zeros in the padding): ``master`` and the moments in fp32, ``shard`` in this engine's compute dtype (from a
    unit the checkpoint trained, its master rounded, which is what its compute copy held)."""
    lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
    out = torch.zeros(hi - lo, dtype=dtype if kind == "shard" else torch.float32)
    for slot in unit.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            continue
        index, offset = saved_at[slot.name]
        source = kind if kind != "shard" or not meta["units"][index]["trained"] else "master"
        values = reader.read(index, source, offset + a - slot.offset, offset + b - slot.offset)
        out[a - lo:b - lo] = values.to(getattr(torch, meta["compute_dtype"])) if source != kind else values
    return out


def _format_text(meta: dict[str, Any]) -> str:
    held = StateFormat.from_meta(meta).held
    moments = "moments" if held == MOMENTS else " ".join(held) if held else "no moments"
    return f"master {meta['master']}, {moments} {meta['moments']}"


def _barrier(group: Any) -> None:
    if group.pg is not None:
        torch.distributed.barrier(group=group.pg)


def _gather_objects(obj: Any, group: Any) -> list[Any]:
    if group.pg is None:
        return [obj]
    out: list[Any] = [None] * group.world
    torch.distributed.all_gather_object(out, obj, group=group.pg)
    return out


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
    group, rank = engine.group, engine.group.rank
    tmp = tmp_dir(root, tag)
    layout, buffers = state_dict_layout(engine) if rank == 0 else ([], {})
    plain, pickled, kinds = small_state.split_client_state(client_state or {}) if rank == 0 else ({}, {}, {})
    if kinds:
        logger.warning("save_checkpoint: client_state %s not plain data (tensors, numbers, strings, lists, dicts): "
                       "saved pickled in %s, which load_checkpoint unpickles only when passed "
                       "trust_client_state=True (see docs/checkpoints.md)",
                       ", ".join(f"{k!r} ({v})" for k, v in kinds.items()) + (" is" if len(kinds) == 1 else " are"),
                       small_state.PICKLED_CLIENT_STATE)
    error: BaseException | None = None
    try:
        files = _write_rank_files(engine, tmp, plain, pickled, buffers)
    except Exception as e:  # noqa: BLE001 - raised once every rank knows (see all_ok)
        error, files = e, {}
    # A rank whose write failed (a full disk) says so before the next collective, so none is left waiting in it;
    # nothing is published, and the last checkpoint stays what `latest` names.
    if not all_ok(error is None, group, engine.accel.device):
        raise _failed(engine, root, tag, error)
    every = _gather_objects(files, group)
    error = None
    if rank == 0:
        try:
            _publish(engine, root, tag, layout, kinds, every, save_latest)
        except Exception as e:  # noqa: BLE001 - raised once every rank knows (meta.json on a full disk, say)
            error = e
    if not all_ok(error is None, group, engine.accel.device):
        raise _failed(engine, root, tag, error)
    if rank == 0 and save_latest:
        retire_old(root, engine.config.offload.checkpoints.keep_last)
    _barrier(group)
    return root / tag


def _failed(engine: Any, root: Path, tag: str, error: BaseException | None) -> BaseException:
    """What every rank raises when some rank's part of a save failed: the partial save is removed at once (rank 0,
    once every rank has stopped writing), and a full disk is said in one message, the same on every rank."""
    group, rank = engine.group, engine.group.rank
    full = full_disk_errno(error)
    fulls = _gather_objects(full, group)  # a collective every rank reaches: all of them are here
    if rank == 0:
        shutil.rmtree(tmp_dir(root, tag), ignore_errors=True)
    _barrier(group)
    number = next((n for n in fulls if n is not None), None)
    if number is not None:
        # rank 0's count of the bytes free, for every rank: each measuring its own would tell ranks different
        # numbers while anything else writes to that disk
        free = _gather_objects(shutil.disk_usage(root).free if rank == 0 else None, group)[0]
        message = _disk_full_message(engine, root, tag, number, free)
        full_error = CheckpointDiskFull(message, number)
        if error is not None:
            full_error.__cause__ = error
        return full_error
    return error or CheckpointError(f"rank {rank}: another rank could not write its part of checkpoint {tag!r} "
                                    f"under {root} (its error says why); nothing was published, the last "
                                    "checkpoint is intact")


def _disk_full_message(engine: Any, root: Path, tag: str, number: int, free: int) -> str:
    """Bytes a checkpoint takes (the last complete one's, else this rank's state times the ranks), bytes free,
    the checkpoint to resume from, and what to do."""
    tag_now = latest_tag(root)
    last = root / tag_now if tag_now is not None else None
    if last is not None and last.is_dir():
        needed = tree_bytes(last)
    else:
        last = None
        # what a checkpoint holds an element: a lent 16+16 high half is saved too (its master as one float32)
        needed = engine.partition.world * engine.optimizer.saved_bytes()
    return (f"checkpoint {tag!r} did not fit in {root}: its file system is full ({errno.errorcode[number]}); a "
            f"checkpoint of this run takes about {needed:,} bytes and {free:,} are free there. The partial save "
            f"was removed, so the disk is as it was; "
            + (f"the last complete checkpoint is {last} (resume from it). " if last is not None
               else "there is no complete checkpoint to resume from. ")
            + "Free space there, save to another disk, or keep fewer checkpoints (offload.checkpoints.keep_last, "
              "--keep-last)")


def _publish(engine: Any, root: Path, tag: str, layout: list[Any], kinds: dict[str, str],
             every: list[dict[str, str]], save_latest: bool) -> None:
    """Rank 0: the checkpoint's meta.json, then the directory, then ``latest`` (training_checkpoint.publish)."""
    group = engine.group
    train = engine.train_state()
    params = [[key, unit, slot.offset, list(slot.shape)] for key, unit, slot in layout]
    meta = {"format": FORMAT, "version": __version__, "tag": tag, "world_size": group.world,
            "partitions": engine.partition.world,
            "global_steps": train["global_steps"], "skipped_steps": train["skipped_steps"],
            "micro_steps": train["micro_steps"], "global_samples": train["global_samples"],
            "adam_steps": engine.optimizer.adam_steps, "state_format": engine.optimizer.state_format.meta(),
            "compute_dtype": str(engine.compute_dtype).removeprefix("torch."), "units": _layout(engine),
            "params": params,
            "config": engine.config.to_dict(), "files": {k: v for f in every for k, v in f.items()}}
    if kinds:
        meta["client_state_pickled"] = kinds
    publish(root, tag, meta, update_latest=save_latest)
    _place_recovery_script(root)


def _write_rank_files(engine: Any, tmp: Path, client_state: dict[str, Any], pickled: dict[str, Any],
                      buffers: dict[str, Any]) -> dict[str, str]:
    """This rank's files of a checkpoint into ``tmp`` (rank-local: no collective; rank 0's holds the model's
    ``buffers``, and the script's ``client_state``: its plain values, and the ``pickled`` others beside, see
    [Note: checkpoints run no code]); returns name -> checksum."""
    rank = engine.group.rank
    files: dict[str, str] = {}
    if rank < engine.partition.world:  # stage 0: every rank holds the same state; rank 0 writes it
        writer = RankWriter(tmp, rank)
        try:
            for g in engine.optimizer.one_at_a_time(read=True, write=False):
                for m in g.members:
                    for kind, values in zip(("master", *MOMENTS), g.views(m).held(), strict=True):
                        if kind == "master" or kind in g.fmt.held:  # a moment not held is no array
                            writer.add(m.unit, kind, values)
                            phase("writing")
            for unit in engine.units:
                if not engine.optimizer.trains(unit.index):
                    writer.add(unit.index, "shard", engine.params.read(unit.index))
        finally:
            files = writer.close()
    small: dict[str, Any] = {"rng": _rng_state(engine.accel.is_cuda)}
    if rank == 0:
        scheduler = engine.lr_scheduler
        train = engine.train_state()
        small.update(client_state=client_state, loss_scaler=train["loss_scaler"], buffers=buffers,
                     lr_scheduler=scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
                     param_groups=[{k: v for k, v in g.items() if k != "params"}
                                   for g in engine.optimizer.param_groups])
        small_state.check_plain(small["lr_scheduler"], "the LR scheduler's state_dict()",
                                "give the schedule a state_dict() of numbers, strings, lists and dicts")
        small_state.check_plain(small["param_groups"], "the optimizer's param_groups",
                                "keep a param group's entries to numbers, strings, lists and dicts")
        if pickled:
            files[small_state.PICKLED_CLIENT_STATE] = save_small(tmp / small_state.PICKLED_CLIENT_STATE, pickled)
        files[RECOVERY] = _place_recovery_script(tmp)
    files[f"rank{rank}.pt"] = save_small(tmp / f"rank{rank}.pt", small)
    phase("rank-files-written")
    return files


RECOVERY = "zero_to_fp32.py"


def _place_recovery_script(directory: Path) -> str:
    """The recovery script (see [Note: a recovery script with no offload]) in ``directory``, as DeepSpeed puts
    its zero_to_fp32.py beside its checkpoints; returns its sha256."""
    from offload.files import zero_to_fp32
    source = Path(zero_to_fp32.__file__).read_bytes()
    target = directory / RECOVERY
    if not target.is_file() or target.read_bytes() != source:
        write_atomic(target, source)
        target.chmod(0o755)
    return hashlib.sha256(source).hexdigest()


def _deepspeed_keys(meta: dict[str, Any], main: dict[str, Any], samples: int, optimizer_loaded: bool,
                    scheduler_loaded: bool) -> dict[str, Any]:
    """What DeepSpeed 0.19.8's load_checkpoint returns in client_state besides the script's own keys (its
    checkpoint's entries it does not restore itself), so that a script reading them finds them."""
    trained = {u["name"] for u in meta["units"] if u["trained"]}
    unit_names = [u["name"] for u in meta["units"]]
    shapes: dict[bool, OrderedDict[str, torch.Size]] = {True: OrderedDict(), False: OrderedDict()}
    first: dict[tuple[int, int], str] = {}
    shared: dict[str, str] = {}  # a tied parameter's other names -> its first, as DeepSpeed's shared_params
    for key, unit, offset, shape in meta.get("params", []):
        if first.setdefault((unit, offset), key) != key:
            shared[key] = first[(unit, offset)]
            continue
        shapes[unit_names[unit] in trained][key] = torch.Size(shape)
    keys: dict[str, Any] = {
        "buffer_names": list(main.get("buffers", {})), "param_shapes": [shapes[True]],
        "frozen_param_shapes": shapes[False] if meta["config"].get("zero_optimization", {}).get("stage", 0) >= 2
        else None,
        "shared_params": shared, "frozen_param_fragments": None,
        "global_samples": samples,
        "ds_config": meta["config"], "ds_version": meta["version"]}
    if not optimizer_loaded:
        keys["optimizer"] = None  # a ZeRO checkpoint's, as DeepSpeed's: the state is in the partitions
    if not scheduler_loaded:
        keys["lr_scheduler"] = main["lr_scheduler"]
    return keys


def _pickled_client_state(path: Path, meta: dict[str, Any], trusted: bool) -> dict[str, Any]:
    """The script's client_state values saved pickled (see [Note: checkpoints run no code]): unpickled only when
    the caller trusts the checkpoint; otherwise left out, and said."""
    kinds = meta.get("client_state_pickled")
    if not kinds:
        return {}
    if not trusted:
        logger.warning("load_checkpoint: client_state %s left out: saved pickled as objects in %s, and unpickling "
                       "runs code the file chooses; pass trust_client_state=True if you trust this checkpoint",
                       ", ".join(f"{k!r} ({v})" for k, v in kinds.items()), small_state.PICKLED_CLIENT_STATE)
        return {}
    verify(path, meta, [small_state.PICKLED_CLIENT_STATE])
    values = small_state.read_trusted(path / small_state.PICKLED_CLIENT_STATE)
    return values if isinstance(values, dict) else {}


def found_latest(engine: Any, load_dir: str | os.PathLike[str]) -> bool:
    """Whether ``load_dir`` has a ``latest`` checkpoint to resume from, agreed by every rank: one that saw none
    while another did would leave that one alone in the load's collectives, so ranks that disagree all raise."""
    latest = Path(load_dir) / LATEST
    found, group, device = latest.is_file(), engine.group, engine.accel.device
    if group.world == 1:
        return found
    if all_ok(not found, group, device):  # no rank found it
        return False
    if all_ok(found, group, device):
        return True
    raise CheckpointError(f"rank {group.rank}: {latest} is {'there' if found else 'missing'} on this rank but not on "
                          "every rank; to resume, every rank must see the same directory (a shared file system)")


def _buffers_to_load(engine: Any, saved: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's buffers for the module's, checked before anything is written: the same keys and shapes."""
    live = live_buffers(engine)
    problems = [f"{k} is not in the checkpoint" for k in live if k not in saved]
    problems += [f"{k} is in the checkpoint, not in the module" for k in saved if k not in live]
    problems += [f"{k} has shape {tuple(saved[k].shape)}, the module's is {tuple(t.shape)}"
                 for k, t in live.items() if k in saved and saved[k].shape != t.shape]
    if problems:
        raise CheckpointError(f"{path}: its buffers do not fit the module's: " + "; ".join(problems))
    return saved


def _groups_to_load(engine: Any, saved: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """The checkpoint's optimizer param groups, checked before anything is written: as many as the engine's (each
    group's hyperparameters are restored into the group at its place)."""
    ours = len(engine.optimizer.param_groups)
    if len(saved) != ours:
        raise CheckpointError(f"{path}: it holds {len(saved)} optimizer param group(s), this engine's optimizer has "
                              f"{ours}; their hyperparameters (lr, betas, weight decay) are restored group by group, "
                              "so build the engine with the param groups the checkpoint was saved with, or pass "
                              "load_optimizer_states=False to keep this engine's own")
    return saved


def load(engine: Any, load_dir: str | os.PathLike[str], tag: str | None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False, trust_client_state: bool = False
         ) -> tuple[Path, dict[str, Any]]:
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
    if meta.get("format") not in READS:
        raise CheckpointError(f"{path / 'meta.json'} has format {meta.get('format')!r}; this offload reads "
                              f"{', '.join(map(str, READS))}")
    old_world, old_parts, parts = meta["world_size"], partitions(meta), engine.partition
    ours = _layout(engine)
    # Units cut another way (another offload.unit_bytes or compute dtype, another offload version's plan): each
    # unit's ranges are read parameter by parameter from where the checkpoint put them.
    saved_at = None if _same_model(meta["units"]) == _same_model(ours) else _saved_params(engine, meta, path)
    # Same partitioning: this rank's own files. Another: a rank's range may lie in any old partition's file.
    sources = [parts.rank] if old_parts == parts.world else list(range(old_parts))
    small_from = rank % old_world
    names = [f"rank{r}.{ext}" for r in sources for ext in ("bin", "json")]
    names += sorted({f"rank{small_from}.pt", "rank0.pt"})
    error = None
    try:
        verify(path, meta, names)
        small = small_state.read(path / f"rank{small_from}.pt")
        main = small if small_from == 0 else small_state.read(path / "rank0.pt")
        buffers = _buffers_to_load(engine, main["buffers"], path)
        if load_optimizer_states and not load_module_only:
            groups = _groups_to_load(engine, main["param_groups"], path)
    except CheckpointError as e:
        error = e
    if not all_ok(error is None, engine.group, engine.accel.device):
        raise error or CheckpointError(f"{path}: another rank found a damaged or missing file (see its error)")
    if old_parts != parts.world:
        logger.info("loading %s cut into %d partitions into %d: each rank reads its ranges from the old ones", path,
                    old_parts, parts.world)
    engine.optimizer.drain()
    engine.runtime.reshard_all()
    reader = ShardReader(path, meta)

    def take(unit: Any, kind: str) -> torch.Tensor:
        if saved_at is not None:
            return _read_relaid(reader, meta, saved_at, unit, kind, engine.compute_dtype)
        return reader.read(unit.index, kind, unit.shard_start, unit.shard_start + unit.shard_numel)

    units = {u.index: u for u in engine.units}
    moments = load_optimizer_states and not load_module_only
    # zero_optimization.load_from_fp32_weights false: the master weights are rebuilt from the checkpoint's
    # compute-dtype weights (rounded), as DeepSpeed does from its 16-bit ones.
    rounded = None if engine.config.zero_optimization.load_from_fp32_weights else getattr(torch, meta["compute_dtype"])
    # absent in a checkpoint from before the formats: fp32
    saved_format, our_format = meta.get("state_format", FP32.meta()), engine.optimizer.state_format.meta()
    if saved_format != our_format and rank == 0:
        logger.warning("loading %s: its optimizer state is held as %s and this engine holds it as %s: converted "
                       "(to fp32 or 16+16 exactly, to a bf16 master or bf16 moments rounded to nearest; a moment this "
                       "engine does not keep is left out)", path,
                       _format_text(saved_format), _format_text(our_format))
    saved_held, ours_held = set(StateFormat.from_meta(saved_format).held), engine.optimizer.state_format.held
    lacking = [kind for kind in ours_held if kind not in saved_held]
    if moments and lacking:  # zeros there would not be a fresh optimizer's: the step count comes with the rest
        held = " and ".join(sorted(saved_held)) or "no moment"
        raise CheckpointError(f"loading {path}: its optimizer state holds {held} and this engine's update keeps "
                              f"{' and '.join(lacking)} too (the checkpoint is another optimizer's); load it with "
                              "load_optimizer_states=False to start this optimizer's state fresh from the "
                              "checkpoint's weights")

    def load_state(index: int, views: StateSlot) -> bool:
        saved = take(units[index], "master")
        views.set_master(saved if rounded is None else saved.to(rounded).float())
        if moments:  # the moments this engine keeps (the checkpoint holds each: checked above)
            for kind, view in zip(MOMENTS, (views.exp_avg, views.exp_avg_sq), strict=True):
                if kind in ours_held:
                    view.copy_(take(units[index], kind))
        return True

    try:
        rewrite_units(engine, read=not moments, state=load_state, shard=lambda index: take(units[index], "shard"))
        spread_rewritten(engine)
        with torch.no_grad():  # rank 0's buffers on every rank, as DeepSpeed's one module file gives them
            for key, live in live_buffers(engine).items():
                live.copy_(buffers[key])
    except BaseException as e:
        engine.close()
        raise CheckpointError(f"loading {path} failed part-way ({e}); the engine's state is half replaced, so it "
                              "was closed: create a new engine and load again") from e
    finally:
        reader.close()
    # a checkpoint written before global_samples was kept: the steps at this run's batch size
    samples = meta.get("global_samples", meta["global_steps"] * engine.train_batch_size())
    client_state = _deepspeed_keys(meta, main, samples, load_optimizer_states, load_lr_scheduler_states)
    client_state.update(main["client_state"])
    client_state.update(_pickled_client_state(path, meta, trust_client_state))
    engine.discard_gradients()
    if not load_module_only:
        if rank < old_world:
            _set_rng_state(small["rng"])
        else:
            _seed_new_rank(small["rng"], rank)
        engine.load_train_state({"global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
                                 "micro_steps": meta["micro_steps"], "loss_scaler": main["loss_scaler"],
                                 "global_samples": samples})
        if load_optimizer_states:
            engine.optimizer.restore_counters(meta["adam_steps"], groups)
        scheduler = engine.lr_scheduler
        if load_lr_scheduler_states and main["lr_scheduler"] is not None and hasattr(scheduler, "load_state_dict"):
            scheduler.load_state_dict(main["lr_scheduler"])
    return path, client_state
