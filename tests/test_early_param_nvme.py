"""The early step with parameter shards on NVMe (see [Note: an early step's parameter writes] in
offload/store/param_swap.py): each unit's new shard is written and made current on its own after engine.step()
returned, while the next forward reads the units the step has finished. Bitwise the whole step with the worker
lagging (a read of a unit before its step, or a read-ahead of the slot being replaced, would see other values), and
a parameter write that fails after step() returned leaves the unit stale, and the forward that needs it rewrites it
from its master first."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from engine_cases import batches, check_bitwise, loss_of, make_model, train_engine
from test_engine_param_nvme import _steps, param_config

import offload
from offload.machine.launch import run_ranks

HOST_LAG = {"OFFLOAD_EMULATED_HOST_DELAY_S": "0.003"}


def early_config(path, early: str = "on", **kw) -> dict:
    config = param_config(path, **kw)
    config["offload"].update(early_step=early, speculative_step="off")
    return config


@pytest.mark.parametrize("world,optimizer", [(1, "cpu"), (1, "nvme"), (2, "cpu")])
def test_the_early_step_with_parameters_on_nvme_trains_bitwise_as_the_whole_step(tmp_path, world, optimizer):
    runs = {early: run_ranks(train_engine, world, env=HOST_LAG, name="gpt", steps=4, micro=2, accum=1,
                             config=early_config(tmp_path / early, early, world=world, optimizer=optimizer))
            for early in ("on", "off")}
    assert "NVMe reads, Adam and writes run beside the next forward" in runs["on"][0]["mode"]
    assert "step() returns after Adam" in runs["off"][0]["mode"]
    assert runs["on"][0]["counts"].get("optimizer_early", 0) > 0
    check_bitwise(runs["on"], runs["off"])


def test_reads_still_run_ahead_once_each_units_step_has_run(tmp_path):
    """Each step's worker is let finish before the next forward (its units' step events done, not yet waited for
    by any read): read-ahead then skips none of them, and the later iterations read mostly ahead, as without an
    early step (test_engine_param_nvme's bound). How far reads go ahead while steps still run is timing: the
    bitwise test covers that they never read a unit too early."""
    engine, *_ = offload.initialize(model=make_model("gpt"), config=early_config(tmp_path, buffers=4))
    swap = engine.params.swap
    first = 0
    for i in range(4):
        _steps(engine, i, i + 1)
        if i == 0:
            first = swap.stats.reads_on_demand
        engine.optimizer.drain()  # the worker ran the step; no read has waited for a unit's event yet
        assert engine.params.stepping() == set(), "a unit whose step has run is read ahead"
    assert swap.stats.reads_ahead > 2 * len(engine.units)
    assert swap.stats.reads_on_demand - first <= first // 2
    engine.close()


def test_read_ahead_keeps_a_buffer_for_each_unit_whose_step_is_still_running(tmp_path, monkeypatch):
    """Read-ahead after an early step used to skip the units still being stepped and read later ones into the
    buffers those units then needed: each such read was dropped (a wait on the forward's path the ledger did not
    see, and the read wasted; 55 in 3 steps with one buffer). A unit still stepping now keeps a buffer free."""
    monkeypatch.setenv("OFFLOAD_EMULATED_HOST_DELAY_S", "0.003")  # the worker lags: units are still stepping
    engine, *_ = offload.initialize(model=make_model("gpt"), config=early_config(tmp_path, buffers=1))
    swap, ledger = engine.params.swap, engine.accel.ledger
    _steps(engine, 0, 3)
    wasted = swap.stats.wasted_reads
    ledger.reset()
    _steps(engine, 3, 6)
    assert swap.stats.wasted_reads == wasted
    assert "parameter read dropped" not in ledger.summary()
    engine.close()


def _write_fails_after_an_early_step(rank: int, world: int, path: str, optimizer: str, failing: int | None,
                                     lag: bool = False) -> dict:
    """Four steps; step 3's first three parameter writes fail on rank ``failing`` after step() returned (``lag``:
    the worker lags, and the next forward starts at once, so it meets the stale units while the step still runs)."""
    import offload.aio.base as base
    engine = offload.initialize(model=make_model("gpt"),
                                config=early_config(Path(path) / str(rank), world=world, optimizer=optimizer))[0]
    rewritten = []
    real_overwrite = engine.params.swap.overwrite

    def overwrite(unit, values):
        rewritten.append(unit)
        real_overwrite(unit, values)

    engine.params.swap.overwrite = overwrite
    data = batches(4, 2 * world)
    losses, stale = [], []
    for i in range(4):
        real = base.os.pwritev
        if i == 2 and rank == failing:
            engine.full_state_dict()  # step 2's writes are done (a collective: every rank calls it)
            base.os.pwritev = _failing_param_writes(real)
        elif i == 2:
            engine.full_state_dict()
        losses.append(engine.backward(loss_of(engine, "gpt", data[i][2 * rank:2 * rank + 2])).item())
        engine.step()
        if i == 2 and not lag:
            engine.optimizer.drain()  # step 3's writes have failed by now
            stale = sorted(engine.params.stale())
    base.os.pwritev = real
    out = {"losses": losses, "stale": stale, "left": sorted(engine.params.stale()), "state": engine.full_state_dict(),
           "rewritten": rewritten}
    engine.close()
    return out


def _failing_param_writes(real, count: int = 3):
    """The next ``count`` writes to the parameter swap file fail (the repair's writes after them succeed)."""
    left = {"n": count}

    def failing(fd, bufs, offset):
        if left["n"] and "params-rank" in os.readlink(f"/proc/self/fd/{fd}"):
            left["n"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, offset)
    return failing


@pytest.mark.parametrize("world,optimizer,lag", [(1, "cpu", False), (1, "nvme", False), (2, "cpu", False),
                                                 (1, "cpu", True), (2, "nvme", True)])
def test_a_parameter_write_failing_after_step_returned_is_rewritten_by_the_forward_that_needs_it(
        tmp_path, world, optimizer, lag):
    """The step stands (its masters moved on); the units left stale are rewritten from their masters by the next
    forward before it reads them, on that rank alone (no collective), so every rank trains on as if nothing
    failed."""
    env = HOST_LAG if lag else None
    runs = run_ranks(_write_fails_after_an_early_step, world, env=env, path=str(tmp_path / "f"), optimizer=optimizer,
                     failing=world - 1, lag=lag)
    clean = run_ranks(_write_fails_after_an_early_step, world, env=env, path=str(tmp_path / "c"), optimizer=optimizer,
                      failing=None, lag=lag)
    assert lag or len(runs[-1]["stale"]) == 3, "the failing rank's units whose write failed were left stale"
    assert len(runs[-1]["rewritten"]) == 3 and not any(run["rewritten"] for run in runs[:-1] + clean)
    for run, reference in zip(runs, clean):
        assert not run["left"]
        assert run["losses"] == reference["losses"]
        for key, value in reference["state"].items():
            assert torch.equal(run["state"][key], value), key
