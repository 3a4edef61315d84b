"""Checkpoints: a resumed run equals the run that never stopped, a save killed at any point leaves the
previous checkpoint loadable, and damaged or mismatched checkpoints are clear errors that change nothing."""

import logging
import math
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_cases import SEQ, VOCAB, base_config, batches, loss_of, make_model

import offload
from offload.files import training_checkpoint as checkpoint
from offload.files.training_checkpoint import CheckpointError
from offload.machine.launch import RankError, run_ranks
from offload.models import GPT, GPTConfig

STEPS = 10
CRASH_STOP = 6  # the crash tests train this far


def ckpt_config(world, optimizer="cpu", path=None):
    config = base_config(2, 2, world)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 5}}
    if optimizer == "split":  # part of the state on the host, the rest on NVMe
        config["zero_optimization"]["sub_group_size"] = 3000
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path / "swap")}
        config["offload"]["budgets"] = {"host": 900_000}
    if optimizer == "params-on-host":  # offload_param cpu: the shards' home is host memory
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if optimizer == "params-on-nvme":  # offload_param nvme, every shard: a resume reads them back from NVMe
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(path / "params"),
                                                        "max_in_cpu": 0}
    if optimizer == "speculative":  # saved after an odd number of steps: the current state is in the second slot
        config["offload"]["speculative_step"] = "on"
    if optimizer == "ratio-half":  # half the optimizer state on the device, stepped there
        config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    return config


def train(rank, world, config, save_dir, start=0, stop=STEPS, save_at=None, resume=False, kill_at=None):
    """Steps [start, stop) of one fixed run; optionally resume first, save after step ``save_at``, or die
    (SIGKILL) at a named point of that save."""
    if kill_at is not None:
        from offload.files import training_checkpoint as checkpoint
        checkpoint.phase_hook = lambda phase: os.kill(os.getpid(), signal.SIGKILL) if phase == kill_at else None
    torch.manual_seed(0)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    client = {}
    if resume:
        _, client = engine.load_checkpoint(save_dir)
    data = batches(stop, 8 * world, seed=3)
    losses = []
    for step in range(start, stop):
        rows = data[step][rank * 8:(rank + 1) * 8]
        total = 0.0
        for micro in rows.split(2)[:2]:
            loss = loss_of(engine, "gpt", micro)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / 2)
        if step == save_at:
            engine.save_checkpoint(save_dir, client_state={"next_step": step + 1, "rank": rank})
    out = {"losses": losses, "state": engine.full_state_dict(), "lr": engine.get_lr(), "client": client,
           "steps": engine.global_steps, "random": torch.rand(3)}
    engine.close()
    return out


@pytest.fixture(scope="module")
def straight_w1(tmp_path_factory):
    return run_ranks(train, 1, config=ckpt_config(1), save_dir=tmp_path_factory.mktemp("unused"), stop=CRASH_STOP)[0]


@pytest.mark.parametrize("world,optimizer", [(2, "cpu"), (1, "split"), (1, "params-on-host"), (1, "params-on-nvme"),
                                             (1, "speculative"), (2, "ratio-half")])
def test_a_resumed_run_equals_the_run_that_never_stopped(tmp_path, world, optimizer):
    config = ckpt_config(world, optimizer, tmp_path)
    straight = run_ranks(train, world, config=config, save_dir=tmp_path / "a")
    run_ranks(train, world, config=config, save_dir=tmp_path / "ckpt", stop=5, save_at=4)
    resumed = run_ranks(train, world, config=config, save_dir=tmp_path / "ckpt", start=5, resume=True)
    for full, half in zip(straight, resumed):
        # rank 0's client state, on every rank (beside the keys DeepSpeed adds)
        assert {k: half["client"][k] for k in ("next_step", "rank")} == {"next_step": 5, "rank": 0}
        assert half["losses"] == full["losses"][5:]  # bitwise: fp32 on the CPU
        assert half["steps"] == full["steps"] and half["lr"] == full["lr"]
        assert torch.equal(half["random"], full["random"])  # the RNG continues where it was
        for key, value in full["state"].items():
            assert torch.equal(half["state"][key], value), key


@pytest.mark.parametrize("phase,latest", [("writing", "global_step2"), ("rank-files-written", "global_step2"),
                                          ("meta-written", "global_step2"),
                                          ("renamed", "global_step2"), ("latest-written", "global_step4")])
def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(tmp_path, straight_w1, phase, latest):
    config = ckpt_config(1)
    run_ranks(train, 1, config=config, save_dir=tmp_path, stop=3, save_at=1)  # tag global_step2
    with pytest.raises(RankError, match="died without a result"):  # would have saved global_step4
        run_ranks(train, 1, config=config, save_dir=tmp_path, stop=5, save_at=3, kill_at=phase)
    assert (tmp_path / "latest").read_text() == latest
    start = int(latest.removeprefix("global_step"))
    resumed = run_ranks(train, 1, config=config, save_dir=tmp_path, start=start, stop=CRASH_STOP, resume=True)[0]
    assert resumed["losses"] == straight_w1["losses"][start:]
    for key, value in straight_w1["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    # The next save clears what the killed one left behind.
    run_ranks(train, 1, config=config, save_dir=tmp_path, stop=5, save_at=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "global_step2", "global_step4", "latest",
                                                          "zero_to_fp32.py"]


def _engine(unit_bytes=8192):
    torch.manual_seed(0)
    config = base_config(2, 1, 1, unit_bytes=unit_bytes)
    return offload.initialize(model=make_model("gpt"), config=config)[0]


def _steps(engine, n, seed=5):
    for tokens in batches(n, 2, seed=seed):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()


@pytest.fixture
def saved(tmp_path):
    engine = _engine()
    _steps(engine, 2)
    engine.save_checkpoint(tmp_path)
    engine.close()
    return tmp_path / "global_step2"


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_an_error_naming_the_file_and_changes_nothing(saved, damage):
    data = bytearray((saved / "rank0.bin").read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-100:]
    (saved / "rank0.bin").write_bytes(bytes(data))
    engine = _engine()
    _steps(engine, 1, seed=9)
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=r"rank0\.bin is damaged"):
        engine.load_checkpoint(saved.parent)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    _steps(engine, 1)  # still usable
    engine.close()


def _auto_resume(rank, world, dirs):
    """DeepSpeed's auto-resume idiom on directory ``dirs[rank]``: what load_checkpoint returned (or raised), and
    whether the engine's weights stayed as they were."""
    torch.manual_seed(0)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, world))
    before = engine.full_state_dict()
    try:
        out: object = engine.load_checkpoint(dirs[rank])
    except CheckpointError as e:
        out = f"CheckpointError: {e}"
    after = engine.full_state_dict()
    engine.close()
    return out, all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("world", [1, 2])
def test_auto_resume_from_nothing_saved_warns_and_returns_none(tmp_path, world, caplog):
    """An empty or missing directory (no 'latest') is DeepSpeed's (None, None) and a warning, on every rank, and
    the engine's state is untouched; a script's `_, client = engine.load_checkpoint(d)` then starts fresh."""
    (tmp_path / "empty").mkdir()
    for where in ("empty", "missing"):
        out = run_ranks(_auto_resume, world, dirs=[str(tmp_path / where)] * world)
        assert out == [((None, None), True)] * world, where
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1), device="cpu")[0]
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        assert engine.load_checkpoint(tmp_path / "missing") == (None, None)
    engine.close()
    assert "holds no checkpoint ('latest' is missing)" in caplog.text


def test_ranks_that_disagree_on_latest_all_raise(tmp_path, saved):
    """Rank 0 sees a checkpoint and rank 1 none (no shared file system): both raise rather than one loading alone
    (its collectives would wait for a rank that never joins)."""
    (tmp_path / "empty").mkdir()
    out = run_ranks(_auto_resume, 2, dirs=[str(saved.parent), str(tmp_path / "empty")])
    assert out[0][0].startswith("CheckpointError: rank 0: ") and "is there on this rank but not on every" in out[0][0]
    assert out[1][0].startswith("CheckpointError: rank 1: ") and "is missing on this rank but not on every" in out[1][0]
    assert out[0][1] and out[1][1]


def test_missing_or_mismatched_checkpoints_are_clear_errors(saved, tmp_path):
    engine = _engine()
    with pytest.raises(CheckpointError, match="no complete checkpoint with tag 'nope'.*global_step2"):
        engine.load_checkpoint(tmp_path, tag="nope")
    engine.close()
    wider = offload.initialize(model=GPT(GPTConfig(vocab_size=VOCAB, context=SEQ, hidden_size=48, layers=3, heads=2)),
                               config=base_config(2, 1, 1))[0]
    with pytest.raises(CheckpointError, match=r"does not fit this model: wte.weight: \[\d+, 32\] in the checkpoint, "
                                              r"\[\d+, 48\] here"):
        wider.load_checkpoint(tmp_path)
    wider.close()
    other = _engine(unit_bytes=1 << 20)  # the whole model in one unit
    other.backward(loss_of(other, "gpt", batches(1, 2)[0]))
    with pytest.raises(offload.EngineError, match="between micro-batches"):
        other.save_checkpoint(tmp_path / "mid")
    other.close()


@pytest.mark.parametrize("unit_bytes,world", [(1 << 20, 1), (32768, 1), (32768, 2)])
def test_a_checkpoint_loads_into_units_cut_another_way(saved, unit_bytes, world):
    """Another offload.unit_bytes (the whole model in one unit, or blocks packed where the save cut them apart), also
    at another world size: every parameter's master, moments and compute weights arrive bit for bit, and training
    goes on."""
    got = run_ranks(_load_relaid, world, saved=str(saved), unit_bytes=unit_bytes)
    reference = _load_relaid(0, 1, str(saved), 8192)  # the save's own layout
    assert got[0]["units"] != reference["units"]
    for rank in got:
        for part in ("state", "master", "exp_avg", "exp_avg_sq"):
            for key, value in reference[part].items():
                assert torch.equal(rank[part][key], value), (part, key)
        assert rank["steps"] == reference["steps"] and math.isfinite(rank["loss"])


def _load_relaid(rank, world, saved, unit_bytes):
    torch.manual_seed(0)
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, world, unit_bytes=unit_bytes))[0]
    engine.load_checkpoint(Path(saved).parent)
    out = {"units": len(engine.units), "state": engine.full_state_dict(), "steps": engine.global_steps,
           **_per_param_state(engine)}
    tokens = batches(1, 2 * world, seed=3)[0][2 * rank:2 * rank + 2]
    out["loss"] = engine.backward(loss_of(engine, "gpt", tokens)).item()
    engine.step()
    engine.close()
    return out


def _per_param_state(engine):
    """Each parameter's whole master and moments, gathered from every rank's shards."""
    import torch.distributed as dist
    out = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for g in engine.optimizer.store.one_at_a_time(read=True, write=False):
        for m in g.members:
            unit = engine.units[m.unit]
            for kind, values in zip(out, g.views(m)):
                full = torch.zeros(unit.padded)
                full[unit.shard_start:unit.shard_start + unit.shard_numel] = values[:unit.shard_numel].cpu()
                if engine.group.world > 1:
                    dist.all_reduce(full)
                for slot in unit.slots:
                    out[kind][slot.name] = full[slot.offset:slot.offset + slot.numel].clone()
    return out


def train_global(rank, world, save_dir, start=0, stop=STEPS, save_at=None, resume=False, stage=3):
    """The same global batch per step (4 micro-batches of 2 rows) on any world size and ZeRO stage: rank r takes
    its share."""
    share = 4 // world
    torch.manual_seed(0)
    config = base_config(2, share, world, stage=stage)
    if stage == 0:
        config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    draws = []
    if resume:
        for _ in range(2):  # twice: a load sets the generators the same way every time
            engine.load_checkpoint(save_dir)
            draws.append((torch.rand(2).tolist(), random.random(), float(np.random.rand())))
    data = batches(stop, 8, seed=4)
    losses = []
    for step in range(start, stop):
        micro = data[step].split(2)[rank * share:(rank + 1) * share]
        for rows in micro:
            loss = loss_of(engine, "gpt", rows)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        if step == save_at:
            engine.save_checkpoint(save_dir)
    out = {"state": engine.full_state_dict(), "steps": engine.global_steps, "draws": draws}
    engine.close()
    return out


@pytest.mark.parametrize("before,after", [((2, 3), (1, 3)), ((1, 3), (2, 3)), ((2, 0), (1, 2)), ((1, 3), (2, 1))],
                         ids=["W2-W1", "W1-W2", "stage0-W2-stage2-W1", "stage3-W1-stage1-W2"])
def test_a_checkpoint_loads_into_another_world_size_and_trains_on_alike(tmp_path, before, after):
    """Also across ZeRO stages: stage 0 writes one replicated partition, the others one per rank."""
    (before, stage_before), (after, stage_after) = before, after
    straight = run_ranks(train_global, before, save_dir=tmp_path / "unused", stage=stage_before)[0]
    run_ranks(train_global, before, save_dir=tmp_path, stop=3, save_at=2, stage=stage_before)
    resumed = run_ranks(train_global, after, save_dir=tmp_path, start=3, resume=True, stage=stage_after)
    first, *others = [rank["draws"] for rank in resumed]
    assert all(d[0] == d[1] for d in [first, *others])  # deterministic from the saved states
    assert all(d[0] != first[0] for d in others)  # ranks the checkpoint did not have draw their own numbers
    for rank in resumed:
        assert rank["steps"] == straight["steps"]
        for key, value in straight["state"].items():  # not bitwise: the gradient sums run in another order
            torch.testing.assert_close(rank["state"][key], value, rtol=1e-5, atol=1e-6)


def test_a_load_removes_what_a_killed_save_left_and_says_so(tmp_path, caplog):
    config = ckpt_config(1)
    run_ranks(train, 1, config=config, save_dir=tmp_path, stop=3, save_at=1)
    with pytest.raises(RankError, match="died without a result"):
        run_ranks(train, 1, config=config, save_dir=tmp_path, stop=5, save_at=3, kill_at="writing")
    assert (tmp_path / ".tmp-global_step4").is_dir()
    engine = _engine()
    with checkpoint.writer_lock(tmp_path):  # a save running elsewhere: its files are not stale
        engine.load_checkpoint(tmp_path)
    assert (tmp_path / ".tmp-global_step4").is_dir()
    with caplog.at_level(logging.WARNING, logger="offload.checkpoint"):
        engine.load_checkpoint(tmp_path)
    engine.close()
    assert not (tmp_path / ".tmp-global_step4").exists()
    assert any("removed .tmp-global_step4 (an unfinished save)" in r.getMessage() for r in caplog.records)


def test_a_save_killed_while_replacing_a_tag_gets_the_old_copy_back(saved, caplog):
    """Saving a tag again moves the old copy aside first; a crash before the new one is renamed in leaves only
    the aside copy, which the next load puts back."""
    root = saved.parent
    expected = (saved / "rank0.bin").read_bytes()
    os.replace(saved, root / ".old-global_step2")
    (root / ".tmp-global_step2").mkdir()
    engine = _engine()
    with caplog.at_level(logging.WARNING, logger="offload.checkpoint"):
        engine.load_checkpoint(root)
    engine.close()
    assert (saved / "rank0.bin").read_bytes() == expected
    assert sorted(p.name for p in root.iterdir()) == [".lock", "global_step2", "latest", "zero_to_fp32.py"]
    assert any("restored global_step2 from .old-global_step2" in r.getMessage() for r in caplog.records)


def _moments(engine):
    engine.optimizer.drain()  # where the step returns early (on a GPU), Adam may still be writing the moments
    out = []
    for g in engine.optimizer.store.one_at_a_time(read=True, write=False):
        for m in g.members:
            _, exp_avg, exp_avg_sq = g.views(m)
            out.append(torch.cat([exp_avg, exp_avg_sq]).clone())
    return torch.cat(out)


def _scheduled_engine():
    torch.manual_seed(0)
    config = base_config(2, 1, 1)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 10,
                                                         "warmup_type": "linear"}}
    return offload.initialize(model=make_model("gpt"), config=config)[0]


@pytest.mark.parametrize("flags", ["all", "no-optimizer", "no-scheduler", "module-only"])
def test_load_flags_behave_as_deepspeed_documents(tmp_path, flags):
    source = _scheduled_engine()
    _steps(source, 4)
    source.save_checkpoint(tmp_path)
    saved = {"weights": source.full_state_dict(), "moments": _moments(source), "lr": source.get_lr(),
             "adam": source.optimizer.adam_steps, "schedule": source.lr_scheduler.last_batch_iteration}
    source.close()
    engine = _scheduled_engine()  # trained differently: its own moments, counters and schedule
    _steps(engine, 1, seed=11)
    own = {"moments": _moments(engine), "lr": engine.get_lr(), "adam": engine.optimizer.adam_steps,
           "schedule": engine.lr_scheduler.last_batch_iteration}
    assert own["schedule"] != saved["schedule"] and own["lr"] != saved["lr"]
    kwargs = {"all": {}, "no-optimizer": {"load_optimizer_states": False},
              "no-scheduler": {"load_lr_scheduler_states": False}, "module-only": {"load_module_only": True}}[flags]
    engine.load_checkpoint(tmp_path, **kwargs)
    weights = engine.full_state_dict()
    assert all(torch.equal(weights[k], v) for k, v in saved["weights"].items())  # weights load in every case
    keeps_optimizer = flags in ("no-optimizer", "module-only")
    assert torch.equal(_moments(engine), own["moments"] if keeps_optimizer else saved["moments"])
    assert engine.optimizer.adam_steps == (own["adam"] if keeps_optimizer else saved["adam"])
    assert engine.global_steps == (1 if flags == "module-only" else 4)
    keeps_schedule = flags in ("no-scheduler", "module-only")
    assert engine.lr_scheduler.last_batch_iteration == (own if keeps_schedule else saved)["schedule"]
    # The groups' lr comes from the saved optimizer state or from the saved schedule, whichever is loaded.
    assert engine.get_lr() == (own if flags == "module-only" else saved)["lr"]
    _steps(engine, 1)  # trains on from there
    engine.close()


def _save_under_own_tags(rank, world, save_dir):
    """Each rank names its own tag: under tag_validation Fail, then Warn."""
    torch.manual_seed(0)
    results = []
    for mode in ("Fail", "Warn"):
        config = base_config(2, 1, world)
        config["checkpoint"] = {"tag_validation": mode}
        engine = offload.initialize(model=make_model("gpt"), config=config)[0]
        try:
            engine.save_checkpoint(save_dir, tag=f"rank{rank}-tag")
            results.append("saved")
        except CheckpointError as e:
            results.append(str(e))
        finally:
            engine.close()
    return results


def test_ranks_saving_under_different_tags(tmp_path):
    results = run_ranks(_save_under_own_tags, 2, save_dir=str(tmp_path))
    for fail, warn in results:
        # Fail: every rank raises before anything is written; Warn: one checkpoint, under rank 0's tag.
        assert "ranks save under different tags (rank 0: 'rank0-tag', rank 1: 'rank1-tag')" in fail
        assert warn == "saved"
    assert (tmp_path / "latest").read_text() == "rank0-tag"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "rank0-tag", "zero_to_fp32.py"]
    assert sorted(p.name for p in (tmp_path / "rank0-tag").iterdir()) == [
        "meta.json", "rank0.bin", "rank0.json", "rank0.pt", "rank1.bin", "rank1.json", "rank1.pt", "zero_to_fp32.py"]




def train_batchnorm(rank, world, save_dir, start=0, stop=6, save_at=None, resume=False):
    """A model whose buffers move every forward (BatchNorm's running statistics and its count); every rank
    sees the same batches, so the ranks' buffers stay alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                torch.nn.Linear(32, 1))
    engine, *_ = offload.initialize(model=model, config=base_config(4, 1, world))
    if resume:
        engine.load_checkpoint(save_dir)
    data = torch.randn(stop, 4, 8, generator=torch.Generator().manual_seed(5))
    losses = []
    for step in range(start, stop):
        loss = engine(data[step]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == save_at:
            engine.save_checkpoint(save_dir)
    out = {"losses": losses, "state": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_resumed_run_has_the_modules_buffers_as_saved(tmp_path, world):
    """The checkpoint keeps the module's buffers (rank 0's) and the load puts them back on every rank."""
    straight = run_ranks(train_batchnorm, world, save_dir=tmp_path / "unused")
    run_ranks(train_batchnorm, world, save_dir=tmp_path / "ckpt", stop=3, save_at=2)
    resumed = run_ranks(train_batchnorm, world, save_dir=tmp_path / "ckpt", start=3, resume=True)
    for full, half in zip(straight, resumed):
        assert int(full["state"]["1.num_batches_tracked"]) == 6
        assert half["losses"] == full["losses"][3:]
        for key, value in full["state"].items():
            assert torch.equal(half["state"][key], value), key


def test_a_checkpoint_whose_buffers_do_not_fit_is_refused_and_changes_nothing(tmp_path):
    run_ranks(train_batchnorm, 1, save_dir=tmp_path / "ckpt", stop=1, save_at=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32, track_running_stats=False),
                                torch.nn.GELU(), torch.nn.Linear(32, 1))
    engine, *_ = offload.initialize(model=model, config=base_config(4, 1, 1))
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=r"its buffers do not fit the module's: 1\.running_mean is in the "
                                              r"checkpoint, not in the module"):
        engine.load_checkpoint(tmp_path / "ckpt")
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.close()


def test_a_checkpoint_with_other_param_groups_is_refused_and_changes_nothing(tmp_path):
    """Each param group's hyperparameters are restored into the group at its place: a checkpoint saved with one group
    loaded into an engine built with two would set the first and leave the second as it was, silently."""
    model = make_model("gpt")
    engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    model = make_model("gpt")
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1),
                                    model_parameters=[{"params": decay, "weight_decay": 0.1},
                                                      {"params": rest, "weight_decay": 0.0}])
    before, steps = engine.full_state_dict(), engine.global_steps
    with pytest.raises(CheckpointError, match=r"it holds 1 optimizer param group\(s\), this engine's optimizer has 2"):
        engine.load_checkpoint(tmp_path / "ckpt")
    after = engine.full_state_dict()
    assert engine.global_steps == steps and all(torch.equal(after[k], v) for k, v in before.items())
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    path, _ = engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)  # the weights alone: allowed
    assert path is not None
    engine.close()
