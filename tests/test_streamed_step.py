"""The streamed lane (offload.stream_state; see [Note: the streamed lane] in offload/optim/streamed_step.py): state
homed on the host, stepped on the device over the bus, trains as plain PyTorch at every stage, W = 1 and 2, clipping
on and off, parameters on the device and offloaded, in each state format; checkpoints resume bitwise; what it cannot
do is refused by name. The device is the emulated discrete one with lagging copy streams, so a missing wait shows
as a wrong result."""

import logging
from typing import Any

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    check_bitwise,
    check_parity,
    loss_of,
    make_model,
    train_engine,
    train_reference,
)
from test_checkpoint import ckpt_config, train
from test_state_formats import fmt_config, reference_split, train_masters

import offload
from offload.config import ConfigError
from offload.machine.launch import run_ranks
from offload.store.sub_groups import STREAMED_SLOTS

LAGGING_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002",
               "CUDA_VISIBLE_DEVICES": ""}
STEPS = 3
# variants another case of the same test already covers in the inner loop (`-m "not slow"`); the whole suite runs them
SLOW = pytest.mark.slow


def streamed_config(world: int, stage: int = 3, params: str = "none", clip: float = 1.0, share: float = 0.5,
                    accum: int = 1) -> dict[str, Any]:
    config = base_config(2, accum, world, clip=clip, stage=stage)
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    config["offload"]["stream_state"] = share
    return config


def _lanes(engine: Any) -> dict[str, Any]:
    groups = engine.optimizer.store.groups
    return {"streamed_units": sorted(m.unit for g in groups if g.streamed for m in g.members),
            "host_units": sorted(m.unit for g in groups if not g.streamed for m in g.members),
            "bytes": dict(engine.telemetry.snapshot().bytes)}


@pytest.mark.parametrize("stage,world,params,clip", [
    (3, 1, "none", 1.0), pytest.param(3, 1, "cpu", 0.0, marks=SLOW), (3, 2, "cpu", 1.0), (3, 2, "none", 0.0),
    (2, 2, "none", 1.0), (1, 1, "none", 0.0)])
def test_the_streamed_lane_trains_as_plain_pytorch(stage, world, params, clip):
    config = streamed_config(world, stage, params, clip)
    results = run_ranks(train_engine, world, env=LAGGING_GPU, name="gpt", config=config, steps=STEPS, micro=2,
                        accum=1, finished=_lanes)
    for rank in results:
        assert rank["streamed_units"] and rank["host_units"], "a split: some units streamed, the rest on the host"
        assert rank["streamed_units"] == sorted(rank["streamed_units"])[:len(rank["streamed_units"])]
        assert max(rank["streamed_units"]) < min(rank["host_units"]), "the forward's first units are streamed"
        assert rank["bytes"]["state_h2d"] == rank["bytes"]["state_d2h"] > 0  # read up and written back each step
        assert rank["memory"]["device"][STREAMED_SLOTS] > 0
    check_parity(results, train_reference("gpt", STEPS, 2 * world, 2, clip, world=world))


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_the_early_step_steps_the_streamed_units_before_it_returns(params):
    """engine.step() returning early (Adam of the host lane on the landing worker) enqueues the streamed lane on
    the compute stream first, as it does the device-resident units: the same training."""
    config = streamed_config(1, params=params)
    config["offload"]["early_step"] = "on"
    results = run_ranks(train_engine, 1, env=LAGGING_GPU, name="gpt", config=config, steps=STEPS, micro=2, accum=1,
                        finished=_lanes)
    assert "step() returns before Adam" in results[0]["mode"] and results[0]["bytes"]["state_h2d"] > 0
    check_parity(results, train_reference("gpt", STEPS, 2, 2, world=1))


def test_with_accumulation_the_streamed_units_sum_on_the_device():
    config = streamed_config(1, accum=3)
    results = run_ranks(train_engine, 1, env=LAGGING_GPU, name="gpt", config=config, steps=STEPS, micro=2, accum=3)
    check_parity(results, train_reference("gpt", STEPS, 6, 2, world=1))


def test_all_of_the_state_streamed_trains_as_all_of_it_on_the_host():
    """stream_state 1: the host steps nothing, the same training (the device's Adam is torch's, to its rounding)."""
    streamed = run_ranks(train_engine, 1, env=LAGGING_GPU, name="gpt", config=streamed_config(1, share=1.0),
                         steps=STEPS, micro=2, accum=1, finished=_lanes)[0]
    assert not streamed["host_units"]
    hosted = run_ranks(train_engine, 1, env=LAGGING_GPU, name="gpt", config=streamed_config(1, share=0.0),
                       steps=STEPS, micro=2, accum=1, finished=_lanes)[0]
    assert "state_h2d" not in hosted["bytes"] and STREAMED_SLOTS not in hosted["memory"]["device"]
    check_parity([streamed], hosted)


@pytest.mark.parametrize("params,state", [("none", "cpu"), pytest.param("cpu", "cpu", marks=SLOW), ("none", "nvme")])
def test_the_16_16_master_with_bf16_moments_streams_as_the_host_steps_it(params, state, monkeypatch, tmp_path):
    """The format as held on the host (or NVMe, through the pass's buffer) goes up and back as bytes; the device
    steps it in torch's ops, widened to fp32 and split back: the same training as the host's kernel, to fp32
    rounding. In this process, as the reference: its bf16 backward on the same threads."""
    for key, value in LAGGING_GPU.items():
        monkeypatch.setenv(key, value)
    config = fmt_config(1, master="16+16", moments="bf16", bf16=True)
    config["offload"]["stream_state"] = 0.5
    if state == "nvme":
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    result = train_masters(0, 1, config)
    for key, value in reference_split(1).items():
        torch.testing.assert_close(result[key], value, atol=2e-5 if "weights" not in key else 8e-3, rtol=1e-4,
                                   msg=lambda m, k=key: f"{k}: {m}")


def test_a_resumed_run_equals_the_run_that_never_stopped(tmp_path):
    """Saved after the streamed step (its copies back waited for) and loaded into the host homes it streams from."""
    config = ckpt_config(2)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config["offload"]["stream_state"] = 0.5
    check_resumed_bitwise(tmp_path, config)


def check_resumed_bitwise(tmp_path, config: dict[str, Any]) -> None:
    """W = 2, saved after step 3 and resumed to step 5, against 5 steps straight: the same losses and weights."""
    straight = run_ranks(train, 2, env=LAGGING_GPU, config=config, save_dir=tmp_path / "a", stop=5)
    run_ranks(train, 2, env=LAGGING_GPU, config=config, save_dir=tmp_path / "ckpt", stop=3, save_at=2)
    resumed = run_ranks(train, 2, env=LAGGING_GPU, config=config, save_dir=tmp_path / "ckpt", start=3, stop=5,
                        resume=True)
    for full, half in zip(straight, resumed, strict=True):
        assert half["losses"] == full["losses"][3:]
        for key, value in full["state"].items():
            assert torch.equal(half["state"][key], value), key


def nvme_streamed_config(tmp_path, world: int, params: str = "none", clip: float = 1.0, share: float = 0.5,
                         host: str | None = None, stage: int = 3) -> dict[str, Any]:
    """The state on NVMe (``host``: a host budget that keeps the first sub-groups there), ``share`` streamed."""
    config = streamed_config(world, stage, params, clip, share)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path),
                                                        "buffer_count": 2}
    config["zero_optimization"]["sub_group_size"] = 3000
    if host is not None:
        config["offload"]["budgets"] = {"host": host}
    return config


def _nvme_lanes(engine: Any) -> dict[str, Any]:
    groups = engine.optimizer.store.groups
    return {**_lanes(engine), "mode": engine.step_mode,
            "streamed_tiers": sorted({g.tier.value for g in groups if g.streamed})}


@pytest.mark.parametrize("world,params,clip,stage", [(1, "none", 1.0, 3), pytest.param(2, "cpu", 0.0, 3, marks=SLOW),
                                                      (2, "none", 1.0, 3), (1, "cpu", 0.0, 3),
                                                      pytest.param(2, "none", 1.0, 2, marks=SLOW), (2, "none", 0.0, 1)])
def test_nvme_state_streamed_through_the_host_trains_as_plain_pytorch(tmp_path, world, params, clip, stage):
    """[Note: NVMe state streamed]: read into the pass's buffer, stepped on the device, written back to NVMe; the
    copies lag, so a copy back the pass did not wait for before its write shows as a wrong result."""
    config = nvme_streamed_config(tmp_path, world, params, clip, stage=stage)
    results = run_ranks(train_engine, world, env=LAGGING_GPU, name="gpt", config=config, steps=STEPS, micro=2,
                        accum=1, finished=_nvme_lanes)
    for rank in results:
        assert rank["streamed_units"] and rank["host_units"] and rank["streamed_tiers"] == ["nvme"]
        assert rank["bytes"]["state_h2d"] == rank["bytes"]["state_d2h"] > 0
        assert "step() returns after Adam (" in rank["mode"]  # whole: at stages 1-2 for the stage's own reason
        assert stage < 3 or rank["mode"].endswith("the streamed lane steps NVMe state inside the step's pass "
                                                  "(offload.stream_state), which does not run beside the next "
                                                  "forward)")
    check_parity(results, train_reference("gpt", STEPS, 2 * world, 2, clip, world=world))


def test_on_a_cpu_device_nothing_is_streamed_and_it_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="offload"):
        engine, *_ = offload.initialize(model=make_model("gpt"), config=streamed_config(1))
    assert not any(g.streamed for g in engine.optimizer.store.groups)
    engine.close()
    assert "offload.stream_state 0.5 has no effect on a CPU compute device" in caplog.text


def test_the_delayed_update_refuses_a_streamed_lane(monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    config = streamed_config(1)
    config["offload"]["delayed_update"] = {"warmup_steps": 0}
    with pytest.raises(ConfigError, match="stream_state 0.5"):
        offload.initialize(model=make_model("gpt"), config=config)


def test_the_streamed_steps_are_bitwise_the_same_with_the_copies_lagging_or_not():
    """The copy streams' lag changes nothing: every read waits for the copy back before it."""
    config = streamed_config(1, params="cpu")
    runs = [run_ranks(train_engine, 1, env=env, name="gpt", config=config, steps=STEPS, micro=2, accum=1)
            for env in (LAGGING_GPU, {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""})]
    check_bitwise(*runs)


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_the_refit_moves_streamed_units_into_the_device_lane_and_training_goes_on(params):
    """#68: a unit moved between lanes. With room after the first step, the refit takes the streamed units first
    (their gradients are on the device already, the first in the order of need), then the host's; the ring is
    given back once none is left, and the run trains as plain PyTorch."""
    from test_refit import split_config, train_refitted

    from offload.store.tier import Tier
    config = split_config(1, 1, ratio="auto", stream_state=0.5)
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    r = run_ranks(train_refitted, 1, env=LAGGING_GPU, config=config, steps=STEPS, micro=2, accum=1,
                  spare=1 << 40)[0]
    assert r["moved"] > 0 and set(r["after"]["tiers"]) == {Tier.DEVICE}
    assert r["before"]["device"].get(STREAMED_SLOTS, 0) > 0 and r["after"]["device"].get(STREAMED_SLOTS, 0) == 0
    assert r["after"]["host"].get("optimizer state", 0) == 0
    check_parity([r], train_reference("gpt", STEPS, 2, 2, world=1))


def _fp16_with_an_overflow(rank: int, world: int, share: float) -> list[Any]:
    """Five fp16 steps whose third overflows (skipped, the scale halved): whether each changed the weights, and the
    weights at the end."""
    import math

    from engine_cases import batches, loss_of
    config = streamed_config(1, share=share)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    changed = []
    for step, tokens in enumerate(batches(5, 2)):
        before = engine.full_state_dict()
        loss = loss_of(engine, "gpt", tokens)
        engine.backward(loss * math.inf if step == 2 else loss)
        engine.step()
        after = engine.full_state_dict()
        changed.append(not all(torch.equal(before[k], after[k]) for k in before))
    engine.close()
    return [changed, engine.skipped_steps, after]


def test_an_fp16_overflow_skips_the_streamed_step_and_its_reads_ahead_serve_the_next():
    """The state read ahead under the overflowed backward is not stepped; the next step uses it (the host state
    has not changed) and trains as the run whose host steps everything."""
    (streamed_changed, skipped, streamed), = run_ranks(_fp16_with_an_overflow, 1, env=LAGGING_GPU, share=1.0)
    (host_changed, _, hosted), = run_ranks(_fp16_with_an_overflow, 1, env=LAGGING_GPU, share=0.0)
    assert streamed_changed == host_changed == [True, True, False, True, True] and skipped == 1
    for key, value in hosted.items():  # torch's Adam on the device beside the host's native one: their rounding
        torch.testing.assert_close(streamed[key], value, rtol=0, atol=1e-4)  # a step is about lr = 3e-3


def _read_under_backward(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """The bytes of streamed state read once each backward is done, before step() is called, and after it."""
    from engine_cases import batches, loss_of
    model = make_model("gpt")
    engine, *_ = offload.initialize(model=model, config=config)
    before_step, after_step = [], []
    for tokens in batches(STEPS, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        before_step.append(engine.telemetry.snapshot().bytes.get("state_h2d", 0))
        engine.step()
        after_step.append(engine.telemetry.snapshot().bytes.get("state_h2d", 0))
    ring = engine.optimizer.streamed.device_bytes
    largest = max(g.nbytes for g in engine.optimizer.store.groups if g.streamed)
    engine.close()
    return {"before": before_step, "after": after_step, "ring": ring, "largest": largest}


def test_the_first_streamed_states_go_up_under_backward_and_the_ring_holds_three_of_the_largest():
    """[Note: the streamed lane]: when the last backward begins the first sub-groups' state is read into the ring
    (a read needs no gradient), so by the time backward returns part of the step's reads are done; the step reads
    the rest."""
    out = run_ranks(_read_under_backward, 1, env=LAGGING_GPU, config=streamed_config(1, share=1.0))[0]
    per_step = out["after"][0]
    assert 0 < out["before"][0] < per_step  # some read ahead, the rest by the step
    for i in range(1, STEPS):
        assert out["before"][i] - out["after"][i - 1] > 0  # each step's first reads under its backward
        assert out["after"][i] - out["after"][i - 1] == per_step  # every sub-group read once a step
    assert out["ring"] == 3 * out["largest"]


def _train_with_copies_back_lagging(rank: int, world: int, config: dict[str, Any], lag: float,
                                    pieces: bool = False) -> dict[str, Any]:
    """train_engine with the streamed lane's copies back each ``lag`` seconds behind: the next step's reads of the
    state, the next forward's of the weights and a checkpoint's of both must wait for them."""
    from offload.machine.accelerator import WorkerStream

    def slow_copies_back(engine: Any) -> None:
        streamed = engine.optimizer.streamed
        streamed.down = WorkerStream("state-d2h (lagging)", lag, engine.accel.ledger, check=engine.accel.check)
        if pieces:  # two pieces a buffer down (each lags), reads in pieces of 1000 bytes
            streamed.read_per_landing, streamed.copy_piece = 1000, 4096

    return train_engine(rank, world, name="gpt", config=config, steps=STEPS, micro=2, accum=1,
                        started=slow_copies_back)


@pytest.mark.parametrize("params,share,pieces", [("none", 1.0, False), ("cpu", 1.0, False), ("none", 0.08, False),
                                                ("cpu", 1.0, True)])
def test_whatever_reads_the_state_or_the_weights_waits_for_their_copies_back(params, share, pieces):
    """Share 0.08: one streamed unit, which takes the other slot each step than it did the last, so its read of
    the state must wait for the last step's copy back though its slot's own last copy back was long done. In
    pieces: each read waits for the copies back of the pieces its place takes."""
    config = streamed_config(1, params=params, share=share)
    env = {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a reader that did not wait reads within microseconds of the copy's start: 20 ms of lag (10 ms a piece, of which
    # a buffer has many) leaves it the stale bytes every time, and the run's sleeps stay short
    lag = 0.01 if pieces else 0.02
    lagging, prompt = (run_ranks(_train_with_copies_back_lagging, 1, env=env, config=config, lag=lag, pieces=pieces)
                       for lag in (lag, 0.0))
    check_bitwise(lagging, prompt)


def _handed_per_step(rank: int, world: int, config: dict[str, Any], tmp: str) -> dict[str, Any]:
    """Per step: the parameter bytes brought up, the new weights handed over once step() returns and once the next
    forward has gathered; then a checkpoint of step 1 loaded while step 3's weights wait to be handed over, and the
    loss of step 2's batch on it (the forward right after the load)."""
    from engine_cases import batches, loss_of
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    params = engine.optimizer.params
    h2d, handed, gathered, losses = [], [], [], []
    tokens = batches(3, 2)
    for i, rows in enumerate(tokens):
        before = engine.telemetry.snapshot().bytes.get("h2d", 0)
        loss = loss_of(engine, "gpt", rows)
        gathered.append(params.handed_bytes())  # the forward took what the last step handed over
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        h2d.append(engine.telemetry.snapshot().bytes.get("h2d", 0) - before)
        handed.append(params.handed_bytes())
        if i == 0:
            engine.save_checkpoint(tmp, tag="one")
    memory = engine.memory_summary()["device"]
    engine.load_checkpoint(tmp, tag="one")  # step 3's new weights were handed over: the load drops them
    with torch.no_grad():
        after_load = loss_of(engine, "gpt", tokens[1]).item()
    engine.close()
    return {"h2d": h2d, "handed": handed, "gathered": gathered, "losses": losses, "after_load": after_load,
            "memory": memory, "streamed": sum(m.numel for g in engine.optimizer.store.groups if g.streamed
                                              for m in g.members)}


@pytest.mark.parametrize("world", [1, 2])
def test_the_next_forward_takes_the_streamed_weights_on_the_device_not_over_the_bus(world, tmp_path):
    """[Note: the hand-off]: the streamed units' new weights, homed on the host, are handed to the next forward's
    gather on the device: each step after the first brings exactly their bytes less up; the forward takes them
    all; a checkpoint loaded before that forward drops them (the forward computes on the loaded weights)."""
    from offload.store.sub_groups import STREAMED_HANDED
    config = streamed_config(world, params="cpu")
    results = run_ranks(_handed_per_step, world, env=LAGGING_GPU, config=config, tmp=str(tmp_path))
    for r in results:
        item = 4  # the fp32 compute dtype's
        assert r["handed"] == [item * r["streamed"]] * 3 and r["streamed"] > 0
        assert r["gathered"] == [0, 0, 0]
        assert r["h2d"][1] == r["h2d"][2] == r["h2d"][0] - item * r["streamed"]
        assert r["after_load"] == r["losses"][1], "the loaded weights, not the handed ones"
        assert r["memory"][STREAMED_HANDED] == item * r["streamed"]


def _deferred_per_step(rank: int, world: int, config: dict[str, Any], read: str) -> dict[str, Any]:
    """Per step: the streamed sub-groups still deferred once step() returned, and once ``read`` (the next
    forward, a checkpoint's state, zero_grad) came; the weights at the end."""
    from engine_cases import batches, loss_of
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    streamed = engine.optimizer.streamed
    after_step, after_read, losses = [], [], []
    for rows in batches(STEPS, 2):
        loss = loss_of(engine, "gpt", rows)
        if after_step:
            after_read.append(streamed.deferred)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        after_step.append(streamed.deferred)
        if read == "state":
            engine.full_state_dict()
            after_read.append(streamed.deferred)
        elif read == "zero_grad":
            engine.zero_grad()
            after_read.append(streamed.deferred)
    state = engine.full_state_dict()
    engine.close()
    return {"after_step": after_step, "after_read": after_read, "losses": losses, "state": state}


@pytest.mark.parametrize("world,params,read", [(1, "cpu", "forward"), (2, "cpu", "forward"),
                                               pytest.param(1, "none", "forward", marks=SLOW),
                                               (1, "cpu", "state"), (1, "cpu", "zero_grad")])
def test_streamed_steps_not_read_ahead_are_deferred_to_their_first_reader(world, params, read):
    """[Note: streamed steps deferred]: with step() returning early, the sub-groups whose state was not read ahead
    are stepped by whatever reads their shards first (the next forward's gathers, a state dict, zero_grad's
    drain): the same training as every sub-group stepped at once (the lane's whole step)."""
    config = streamed_config(world, params=params, share=1.0)
    config["offload"]["early_step"] = "on"
    deferred = run_ranks(_deferred_per_step, world, env=LAGGING_GPU, config=config, read=read)
    config["offload"]["early_step"] = "off"
    whole = run_ranks(_deferred_per_step, world, env=LAGGING_GPU, config=config, read=read)
    for d, w in zip(deferred, whole, strict=True):
        assert all(n > 0 for n in d["after_step"]), "the ring holds two of the largest: some were not read ahead"
        assert d["after_read"] == [0] * len(d["after_read"]) and w["after_step"] == [0] * STEPS
        assert d["losses"] == w["losses"]
        for key, value in w["state"].items():
            assert torch.equal(d["state"][key], value), key


def _pieces(engine: Any) -> None:
    streamed = engine.optimizer.streamed
    streamed.read_per_landing = 1000  # bytes: every sub-group read in pieces over several landings
    streamed.copy_piece = 1000  # and copied back in pieces, a read waiting for those of its place alone


@pytest.mark.parametrize("params,early", [("cpu", "on"), ("none", "off")])
def test_reads_ahead_in_pieces_train_bitwise_as_whole_reads(params, early):
    """[Note: the streamed lane]: the landings read the state ahead a few bytes at a time (a sub-group over several
    landings; the step reads the rest of one begun), and the copies back go in pieces (a read waits for the pieces
    of its place): the same bytes up and down, the same training bitwise."""
    config = streamed_config(1, params=params, share=1.0)
    config["offload"]["early_step"] = early
    pieces, whole = (run_ranks(train_engine, 1, env=LAGGING_GPU, name="gpt", config=config, steps=STEPS, micro=2,
                               accum=1, started=started, finished=_lanes)
                     for started in (_pieces, None))
    assert pieces[0]["bytes"]["state_h2d"] == pieces[0]["bytes"]["state_d2h"] == whole[0]["bytes"]["state_h2d"]
    check_bitwise(pieces, whole)


def test_nvme_state_streamed_with_part_of_it_on_the_host_resumes_bitwise(tmp_path):
    """All of the state streamed, the first sub-groups homed on the host (the budget's room) and the rest on NVMe:
    both of the lane's paths in one step, saved after it and loaded into the homes it streams from."""
    config = ckpt_config(2, "split", tmp_path)
    config["offload"].update(stream_state=1.0, budgets={"host": 600_000})  # the first 9 sub-groups of 21 there
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    check_resumed_bitwise(tmp_path, config)


def test_nvme_state_streamed_takes_both_tiers_in_one_step(tmp_path, monkeypatch):
    for key, value in LAGGING_GPU.items():
        monkeypatch.setenv(key, value)
    config = ckpt_config(1, "split", tmp_path)
    config["offload"].update(stream_state=1.0, budgets={"host": 600_000})
    engine, optimizer, *_ = offload.initialize(model=make_model("gpt"), config=config)
    tiers = [g.tier.value for g in optimizer.store.groups]
    engine.close()
    assert all(g.streamed for g in optimizer.store.groups) and tiers[0] == "host" and tiers[-1] == "nvme", tiers


def test_a_failed_write_of_nvme_state_streamed_loses_nothing_and_the_step_can_be_retried(tmp_path, monkeypatch):
    """The write that fails is the step's last: the streamed sub-groups (the forward's first, the pass's last) are
    stepped and their new weights in the host copies already; the step's state stays the last one's, and a retry
    trains as the run whose disk never failed."""
    import errno
    import os

    from test_engine_nvme import _run_steps

    import offload.aio.base as base
    from offload.aio.base import SwapIOError

    for key, value in LAGGING_GPU.items():
        monkeypatch.setenv(key, value)

    def engine_at(path):
        config = nvme_streamed_config(path, 1)
        config["offload"].update(aio_engine="threads", speculative_step="off")  # every write in step()
        return offload.initialize(model=make_model("gpt"), config=config)[0]

    real, calls = os.pwritev, {"n": 0, "fail": None}

    def counting(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] == calls["fail"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, off)

    monkeypatch.setattr(base.os, "pwritev", counting)
    engine = engine_at(tmp_path / "a")
    _run_steps(engine, 1)
    calls["n"] = 0
    _run_steps(engine, 1, start=1)
    per_step = calls["n"]
    before = engine.full_state_dict()
    calls["n"], calls["fail"] = 0, per_step  # the step's last write
    engine.backward(loss_of(engine, "gpt", batches(3, 2)[2]))
    with pytest.raises(SwapIOError, match="errno 5"):
        engine.step()
    for key, value in engine.full_state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed by a step that failed"
    calls["fail"] = None
    engine.step()  # the same step again, the disk working
    retried = engine.full_state_dict()
    engine.close()
    clean = engine_at(tmp_path / "clean")
    _run_steps(clean, 3)
    for key, value in clean.full_state_dict().items():
        assert torch.equal(retried[key], value), key
    clean.close()


def test_state_kept_on_the_device_has_nothing_to_stream_and_says_so(monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    config = streamed_config(1)
    config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    with pytest.raises(ConfigError, match=r"offload.stream_state.*'none' keeps it all on the device already"):
        offload.initialize(model=make_model("gpt"), config=config)
