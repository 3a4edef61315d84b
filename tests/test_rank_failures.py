"""One rank's failed step at W = 2 (see [Note: one rank's failed step] in offload/engine/agreement.py): every rank
raises, none waits in a collective the failed one never joins, none commits a step another could not, and a
retryable step is retried on every rank to the values of a run that never failed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.engine.life import Life
from offload.machine.launch import run_ranks

WORLD = 2


def nvme_config(path: str, early: str = "off") -> dict:
    config = base_config(2, 1, WORLD, sub_group_size=3000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": 2}
    config["offload"].update(early_step=early, speculative_step="off", aio_engine="threads")
    return config


def _error(call) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return None


def _fail_writes(at: int):
    """os.pwritev (the threads engine's write) failing at its ``at``-th call from now; returns the undo."""
    import offload.aio.base as base
    real, calls = base.os.pwritev, {"n": 0}

    def failing(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] == at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)

    base.os.pwritev = failing
    return lambda: setattr(base.os, "pwritev", real)


def _step_with_a_full_disk_on(rank: int, world: int, path: str, failing: int | None) -> dict:
    """Two steps, a third whose second write fails on rank ``failing``, that step again, then a fourth."""
    engine = offload.initialize(model=make_model("gpt"), config=nvme_config(f"{path}/{rank}"))[0]
    data = batches(4, 2 * world)

    def backward(i: int) -> None:
        engine.backward(loss_of(engine, "gpt", data[i][2 * rank:2 * rank + 2]))

    for i in range(2):
        backward(i)
        engine.step()
    before = engine.full_state_dict()
    backward(2)
    undo = _fail_writes(2) if rank == failing else (lambda: None)
    error = _error(engine.step)
    undo()
    kept = engine.full_state_dict()
    if failing is not None:
        engine.step()  # the same step again, on every rank
    backward(3)
    engine.step()
    out = {"error": error, "kept": all(torch.equal(kept[k], v) for k, v in before.items()),
           "state": engine.full_state_dict(), "steps": engine.global_steps}
    engine.close()
    return out


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_write_on_one_rank_stops_the_step_on_every_rank_and_a_retry_everywhere_is_exact(tmp_path,
                                                                                                  failing):
    runs = run_ranks(_step_with_a_full_disk_on, WORLD, timeout=240, path=str(tmp_path / "f"), failing=failing)
    clean = run_ranks(_step_with_a_full_disk_on, WORLD, timeout=240, path=str(tmp_path / "c"), failing=None)
    other = 1 - failing
    assert runs[failing]["error"].startswith("SwapIOError") and "No space left on device" in runs[failing]["error"]
    assert runs[other]["error"].startswith(f"EngineError: rank {other}: step 3 was not applied because another "
                                           "rank's step failed"), runs[other]["error"]
    assert "call step() again on every rank" in runs[other]["error"]
    for run, reference in zip(runs, clean):
        assert run["kept"], "a rank changed its state in a step another rank could not take"
        assert run["steps"] == reference["steps"] == 4
        for key, value in reference["state"].items():
            assert torch.equal(run["state"][key], value), key


def _early_step_lost_on_rank_1(rank: int, world: int, path: str) -> dict:
    """The early NVMe pass of step 2 fails on rank 1 after step() returned; then a step and a checkpoint."""
    engine = offload.initialize(model=make_model("gpt"), config=nvme_config(f"{path}/{rank}", early="on"))[0]
    data = batches(3, 2 * world)

    def backward(i: int) -> None:
        engine.backward(loss_of(engine, "gpt", data[i][2 * rank:2 * rank + 2]))

    backward(0)
    engine.step()
    engine.full_state_dict()  # the first pass done on both ranks
    undo = _fail_writes(1) if rank == 1 else (lambda: None)
    backward(1)
    engine.step()  # returns before its pass ran
    backward(2)  # the pass fails beside this backward on rank 1
    out = {"step": _error(engine.step)}
    undo()
    out["save"] = _error(lambda: engine.save_checkpoint(f"{path}/ckpt"))
    out["gathered"] = _error(engine.full_state_dict)
    engine.close()
    return out


def test_a_lost_early_step_on_one_rank_is_said_on_every_rank_by_the_next_step_and_by_a_save(tmp_path):
    """Before the agreement rank 0 waited in the next step's norm all-reduce until the process group timed out."""
    lost, peer = run_ranks(_early_step_lost_on_rank_1, WORLD, timeout=240, path=str(tmp_path))[::-1]
    for what in ("step", "save", "gathered"):
        assert lost[what].startswith("EarlyStepLost"), (what, lost[what])
    assert peer["step"].startswith("EngineError: rank 0: step 3 was not applied because another rank's gradients "
                                   "or its last step did not complete"), peer["step"]
    assert "rebuild every rank from the last checkpoint" in peer["step"]
    assert peer["save"].startswith("EngineError: rank 0: saving the checkpoint did not start because another "
                                   "rank's"), peer["save"]
    assert peer["gathered"].startswith("EngineError: rank 0: gathering the state dict did not start"), peer["gathered"]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("global_step*"))


class SometimesUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.used(x)
        return (self.extra(y) if use_extra else y).pow(2).mean()


def _unused_on_rank_1(rank: int, world: int) -> dict:
    config = base_config(2, 1, world, clip=0.0, unit_bytes=4096)
    config["zero_optimization"]["ignore_unused_parameters"] = False
    torch.manual_seed(0)
    engine = offload.initialize(model=SometimesUsed(), config=config)[0]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x, use_extra=rank == 0))
    out = {"error": _error(engine.step), "steps": engine.global_steps}
    engine.backward(engine(x, use_extra=True))  # every rank uses everything: the next step runs on both
    engine.step()
    out["after"] = engine.global_steps
    engine.close()
    return out


def test_a_parameter_unused_on_one_rank_fails_the_step_on_every_rank_and_the_next_one_runs():
    used, unused = run_ranks(_unused_on_rank_1, WORLD, timeout=120)
    assert unused["error"].startswith("EngineError: rank 1: 2 trainable parameter(s) received no gradient"), unused
    assert used["error"].startswith("EngineError: rank 0: step 1 was not applied because another rank's "), used
    assert used["steps"] == unused["steps"] == 0 and used["after"] == unused["after"] == 1


def _forward_fails_on_rank_1(rank: int, world: int) -> dict:
    """ZeRO-3 with params on the host: rank 1's fourth shard read inside forward fails; every rank then tries to go
    on."""
    from offload.store.param_store import ParamStore
    config = base_config(2, 1, world)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    real, calls = ParamStore.to_device, {"n": 0}

    def failing(self, index, h2d):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.EIO, "read failed")
        return real(self, index, h2d)

    if rank == 1:
        ParamStore.to_device = failing
    tokens = batches(1, 2 * world)[0][2 * rank:2 * rank + 2]
    out: dict = {}
    try:
        engine.backward(loss_of(engine, "gpt", tokens))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        out["forward"] = f"{type(e).__name__}: {e}"
        out["notes"] = list(getattr(e, "__notes__", []))
    ParamStore.to_device = real
    for what, call in (("step", engine.step), ("again", lambda: engine(tokens)),
                       ("state", engine.full_state_dict)):
        out[what] = _error(call)
    engine.close()  # still releases everything
    out["closed"] = engine.life.state is Life.CLOSED
    return out


def test_a_forward_that_fails_part_way_on_one_rank_takes_no_more_work_there_and_says_why():
    """Rank 1's next collective would pair with one rank 0 is already in (a crash on a size mismatch, or, where
    the sizes agree, one unit's shards handed to another); so rank 1 refuses everything, and rank 0's waiting
    gather fails once rank 1 is gone rather than pairing with anything."""
    waiting, failed = run_ranks(_forward_fails_on_rank_1, WORLD, timeout=120)
    assert failed["forward"] == "OSError: [Errno 5] read failed"
    assert any("rank 1: forward raised part way" in n and "out of step" in n for n in failed["notes"]), failed
    for what in ("step", "again", "state"):
        assert failed[what].startswith("EngineError: rank 1: forward raised part way (OSError"), (what, failed)
        assert "resume from the last checkpoint" in failed[what]
    assert failed["closed"] and waiting["closed"]
    assert waiting["forward"] is not None  # its gather lost its peer: an error, not a pairing with another


def test_a_failed_step_is_retried_with_ignore_unused_parameters_false(tmp_path):
    """The retry's check of unused parameters sees the gradients the failed step had (it saw none before, and
    dropped them as unused)."""
    config = nvme_config(str(tmp_path), early="off")
    config["train_micro_batch_size_per_gpu"], config["train_batch_size"] = 2, 2
    config["zero_optimization"]["ignore_unused_parameters"] = False
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    tokens = batches(1, 2)[0]
    engine.backward(loss_of(engine, "gpt", tokens))
    undo = _fail_writes(2)
    error = _error(engine.step)
    undo()
    assert error is not None and error.startswith("SwapIOError"), error
    engine.step()  # the retry
    assert engine.global_steps == 1
    engine.close()


def _stage0_unused_on_rank_1(rank: int, world: int) -> dict:
    config = base_config(2, 1, world, clip=0.0, unit_bytes=4096, stage=0)
    config["zero_optimization"].update(ignore_unused_parameters=False, offload_optimizer={"device": "none"})
    torch.manual_seed(0)
    engine = offload.initialize(model=SometimesUsed(), config=config)[0]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x, use_extra=rank == 0))
    out = {"error": _error(engine.step), "steps": engine.global_steps}
    out["state"] = engine.full_state_dict()
    engine.close()
    return out


def test_at_stage_0_a_parameter_unused_on_one_rank_fails_the_step_on_every_rank():
    """Stage 0's norm needs no all-reduce (every rank holds the whole gradient), so the flag goes over the group:
    otherwise rank 0 stepped alone and the replicas differed."""
    used, unused = run_ranks(_stage0_unused_on_rank_1, WORLD, timeout=120)
    assert unused["error"].startswith("EngineError: rank 1: 2 trainable parameter(s) received no gradient"), unused
    assert used["error"].startswith("EngineError: rank 0: step 1 was not applied because another rank's "), used
    assert used["steps"] == unused["steps"] == 0
    for key, value in used["state"].items():
        assert torch.equal(unused["state"][key], value), key


def _drain_fails_on_rank_1_with_overlap(rank: int, world: int) -> dict:
    config = base_config(2, 1, world, clip=0.0)
    config["offload"]["overlap_step"] = "on"  # no clipping: shards step during backward
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    first, tokens = (t[2 * rank:2 * rank + 2] for t in batches(2, 2 * world))
    engine.backward(loss_of(engine, "gpt", first))  # a step of one call: the next one's update begins during it
    engine.step()
    engine.backward(loss_of(engine, "gpt", tokens))
    if rank == 1:
        real = engine.optimizer.drain

        def failing(*args, **kwargs):
            engine.optimizer.drain = real
            raise RuntimeError("a gradient did not land")

        engine.optimizer.drain = failing
    out = {"error": _error(engine.step), "mode": engine.step_mode}
    engine.close()
    return out


def test_a_peers_failure_after_this_ranks_overlapped_backward_says_the_step_is_half_applied():
    """Shards stepped during backward moved on and cannot be undone: saying 'not applied' would be false."""
    waiting, failed = run_ranks(_drain_fails_on_rank_1_with_overlap, WORLD, timeout=120)
    assert "overlapped with the last micro-batch's backward" in waiting["mode"], waiting["mode"]
    assert failed["error"] == "RuntimeError: a gradient did not land"
    assert waiting["error"].startswith("EngineError: rank 0: another rank's gradients or its last step did not "
                                       "complete"), waiting["error"]
    assert "its step is half applied: rebuild every rank from the last checkpoint" in waiting["error"]


def _delayed_update_fails_on_rank_1(rank: int, world: int, path: str) -> dict:
    config = base_config(2, 1, world)
    config["offload"]["delayed_update"] = {"warmup_steps": 0}
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    data = batches(2, 2 * world)
    engine.backward(loss_of(engine, "gpt", data[0][2 * rank:2 * rank + 2]))
    engine.step()
    engine.full_state_dict()
    if rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("delayed Adam failed")

        engine.optimizer.update.step_shard = failing
    engine.backward(loss_of(engine, "gpt", data[1][2 * rank:2 * rank + 2]))
    engine.step()  # the delayed update's Adam runs on its thread, and fails there on rank 1
    out = {"save": _error(lambda: engine.save_checkpoint(path))}
    out["close"] = _error(engine.close)  # releases everything, and says the failure once more
    return out


def test_a_delayed_update_that_failed_on_one_rank_fails_a_save_on_every_rank():
    """A save publishes the delayed update first; publishing is part of the agreed drain, so the failing rank does
    not leave the others in the agreement (they waited there until it exited)."""
    import tempfile
    with tempfile.TemporaryDirectory() as path:
        waiting, failed = run_ranks(_delayed_update_fails_on_rank_1, WORLD, timeout=60, path=path)
        assert not any(p.name.startswith("global_step") for p in Path(path).iterdir())
    assert "delayed Adam failed" in failed["save"], failed
    assert waiting["save"].startswith("EngineError: rank 0: saving the checkpoint did not start because another "
                                      "rank's"), waiting


class _Halves(torch.nn.Module):
    """A Linear(32, 32) in two halves of weight: ``skip`` leaves the second out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 32) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(16, 32) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(32))
        self.skip = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        second = torch.zeros(h.shape[0], 16) if self.skip else h @ self.w2.T
        return torch.cat([h @ self.w1.T, second], 1) + self.bias


class _TwoUnits(torch.nn.Module):
    """Two units of equal size: a Linear, then the halves."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = _Halves()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(self.a(x)) + x).square().mean()


def _train_two_units(rank: int, world: int, stage: int, skipping: int | None) -> dict:
    """With ``skipping``, a first step where that rank leaves w2 unused, so its second unit lands at backward's
    end, after the first, where the other rank's lands before it; then (or alone) a step using every weight."""
    torch.manual_seed(0)
    model = _TwoUnits()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              # Persistent units (stage 3) are not gathered again in backward: only the reductions are collectives.
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10**6},
              "offload": {"unit_bytes": 1056 * 4}}
    engine = offload.initialize(model=model, config=config)[0]
    assert [u.numel for u in engine.units] == [1056, 1056]
    errors = []
    for step in (0, 1) if skipping is not None else (1,):
        model.b.skip = step == 0 and rank == skipping
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        errors.append(_error(lambda x=x: (engine.backward(engine(x)), engine.step())))
    out = {"errors": errors, "state": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_that_reduce_in_different_orders_say_so_and_apply_nothing(stage):
    """[Note: gradient reduction order]: the reductions paired unit a's gradients on one rank with unit b's on the
    other (equal sizes, so gloo cannot tell). Every rank raises and drops the step; the next step, with every
    weight used on every rank, trains as if the bad one had never been run."""
    got = run_ranks(_train_two_units, WORLD, stage=stage, skipping=1)
    for rank, out in enumerate(got):
        assert out["errors"][0] is not None and "reduced step 1's gradients in different orders" in out["errors"][0]
        assert out["errors"][0].startswith(f"EngineError: rank {rank}:") and "not applied" in out["errors"][0]
        assert out["errors"][1] is None
    clean = run_ranks(_train_two_units, WORLD, stage=stage, skipping=None)  # the good step alone
    for out, ref in zip(got, clean):
        for key, value in ref["state"].items():
            assert torch.equal(out["state"][key], value), key


def test_the_order_check_tells_equal_hashes_from_unequal_ones_by_their_sums():
    """W x sum(h^2) == sum(h)^2 holds only when every h is equal; exact in float64 for the hashes' range."""
    from offload.zero.collectives import ReductionOrder

    def summed(*orders: list[int]) -> list[float]:
        values = []
        for order in orders:
            r = ReductionOrder()
            for index in order:
                r.add(index)
            values.append(r.take())
        return [sum(v[i] for v in values) for i in range(ReductionOrder.WIDTH)]

    assert ReductionOrder.agreed(summed([3, 2, 1, 0], [3, 2, 1, 0], [3, 2, 1, 0]), 3)
    assert not ReductionOrder.agreed(summed([3, 2, 1, 0], [3, 2, 0, 1], [3, 2, 1, 0]), 3)
    assert not ReductionOrder.agreed(summed([1, 0], [0, 1]), 2)
    assert ReductionOrder.agreed(summed([], []), 2) and ReductionOrder.agreed(summed([5]), 1)
    r = ReductionOrder()
    r.add(7)
    assert r.take() != [0.0] * 4 and r.take() == [0.0] * 4, "take starts the next step afresh"
