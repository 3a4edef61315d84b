"""engine.step() returning before Adam has run (see [Note: early step] in offload/optim/early_step.py): bitwise the
whole step, every reader waits for it, and the forward waits per unit only.

The landing worker, which runs the early step, lags far behind here (``OFFLOAD_EMULATED_HOST_DELAY_S``), so a
forward that read a unit before its Adam finished, or a reader that did not drain, would see old values.
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    check_bitwise,
    describe_engine,
    loss_of,
    make_model,
    train_engine,
)
from test_sync_ledger import ledger_of_a_step

from offload.machine.launch import run_ranks

HOST_LAG = {"OFFLOAD_EMULATED_HOST_DELAY_S": "0.01"}  # the device stays the host's memory: units read in place
LAG = {**STREAM_CHECK, "OFFLOAD_EMULATED_COPY_DELAY_S": "0.003"}  # a discrete device: gathers and copies back too
DISCRETE = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}  # the copies a GPU needs, without a copy delay


def early_config(world: int, early: str, params: str = "cpu", accum: int = 2) -> dict:
    config = base_config(2, accum, world, clip=1.0, offload_param={"device": params})
    config["offload"]["early_step"] = early
    return config


@pytest.mark.parametrize("world,params,env", [(1, "cpu", HOST_LAG), (1, "none", HOST_LAG), (2, "none", LAG)],
                         ids=["W1-in-place", "W1-device-homes", "W2-discrete"])
def test_the_early_step_trains_bitwise_as_the_whole_step(world, params, env):
    runs = {early: run_ranks(train_engine, world, env=env, name="gpt", config=early_config(world, early, params),
                             steps=4, micro=2, accum=2) for early in ("on", "off")}
    assert "step() returns before Adam" in runs["on"][0]["mode"]
    assert "step() returns after Adam" in runs["off"][0]["mode"]
    assert runs["on"][0]["counts"].get("optimizer_early", 0) > 0 and "optimizer_early" not in runs["off"][0]["counts"]
    check_bitwise(runs["on"], runs["off"])


@pytest.mark.parametrize("params,discrete", [("cpu", False), ("none", True)], ids=["host-in-place", "gpu-alias"])
def test_readers_right_after_an_early_step_see_the_stepped_weights(monkeypatch, tmp_path, params, discrete):
    """Also a discrete device's device homes at W = 1, which units read where they live: the reader waits for
    the copy back too (lagging here), not only for Adam."""
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_HOST_DELAY_S", "0.02")
    if discrete:
        monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
        monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.02")
    engine = offload.initialize(model=make_model("gpt"), config=early_config(1, "on", params, accum=1))[0]
    assert all(u.in_place for u in engine.units)
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()  # returns with Adam queued behind the lagging worker
    with engine.gathered_parameters() as module:
        seen = {name: p.detach().clone() for name, p in module.named_parameters()}
    masters = engine.full_state_dict()
    for name, value in seen.items():
        assert torch.equal(value.cpu(), masters[name]), name  # fp32: the compute copy is the master
    engine.close()


@pytest.mark.parametrize("world,accum,params,env", [
    (1, 1, "cpu", HOST_LAG), (1, 4, "cpu", HOST_LAG), (1, 1, "none", {**HOST_LAG, **DISCRETE}),
    (2, 1, "none", LAG), (2, 4, "cpu", LAG),
], ids=["W1-in-place", "W1-accum4", "W1-discrete-device-homes", "W2-discrete", "W2-accum4-discrete"])
def test_the_forward_waits_only_for_units_whose_step_is_running(world, accum, params, env):
    """The sync ledger's promise (see [Note: sync ledger]) with the early step: the forward's only host-blocking
    waits are the units Adam has not reached, autograd's thread never blocks (the next backward's gradients queue
    behind the step, also between micro-batches), the step waits once and reads one scalar, and no event is made
    afresh. On a discrete device a copy back or a gather is a stream wait, never the host's. Three warm-up steps:
    a discrete device's copy-back stream makes its synchronize event the first time a step waits for it, one step
    later than without the early step."""
    config = early_config(world, "on", params, accum=accum)
    results = run_ranks(ledger_of_a_step, world, env=env, config=config, accum=accum, warmup=3)
    for rank, got in enumerate(results):
        assert got["backward"] == {}, f"rank {rank}: autograd's thread blocked:\n{got['summary']}"
        assert set(got["forward"]) <= {"a unit's early step"}, f"rank {rank}:\n{got['summary']}"
        assert got["scalar_reads"] == {"training/global gradient norm": 1}, got["summary"]
        # One wait on the training thread, at the step's start: the gradients, queued behind the last step's Adam.
        # step() waits for nothing after handing its own Adam over.
        assert got["training"] == {"gradients drained": 1}, got["summary"]
        assert got["events_made"] == {}, got["summary"]


@pytest.mark.parametrize("change,reason", [
    ({"offload": {"unit_bytes": 8192, "early_step": "off"}}, "offload.early_step is off"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "ZeRO stage 2 spreads"),
    ({"offload": {"unit_bytes": 8192}}, "'auto' keeps the step whole on a CPU"),
])
def test_the_engine_says_why_step_returns_after_adam(change, reason):
    config = {**early_config(1, "on"), **change}
    mode = run_ranks(describe_engine, 1, config=config, device="cpu")[0]["mode"]
    assert "step() returns after Adam" in mode and reason in mode
