"""The speculative step: Adam runs during backward with clip factor 1 into a second slot, kept when clipping does
not fire and recomputed when it does; bitwise the ordinary step either way (see [Note: speculative step] in
offload/optim/speculation.py)."""

import math
import threading

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    describe_engine,
    loss_of,
    make_model,
    train_engine,
    train_reference,
)

import offload
from offload.commands.estimate import estimate
from offload.config import Config, ConfigError
from offload.machine.launch import run_ranks
from offload.store.sub_groups import SPECULATIVE_SLOT


def spec_config(world, accum, clip, speculative, **offload_section):
    config = base_config(2, accum, world, clip=clip)
    config["offload"].update(speculative_step=speculative, **offload_section)
    return config


def run_both(world, accum, clip, steps=4, env=None, **offload_section):
    return {mode: run_ranks(train_engine, world, env=env, name="gpt", steps=steps, micro=2, accum=accum,
                            config=spec_config(world, accum, clip, mode, **offload_section))
            for mode in ("on", "off")}


def assert_bitwise(on, off):
    for spec, plain in zip(on, off):
        assert spec["losses"] == plain["losses"]
        for key, value in plain["state"].items():
            assert torch.equal(spec["state"][key], value), key


DISCRETE = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}


# clip 1e6 never fires, 1e-3 always does; the emulated GPU lands gradients in buffers of their own and copies each
# new shard back
@pytest.mark.parametrize("world,accum,clip,outcome,env", [
    (1, 1, 1e6, "kept", None), (1, 2, 1e-3, "recomputed", None), (2, 1, 1e-3, "recomputed", None),
    (2, 2, 1e6, "kept", None), (1, 1, 1e-3, "recomputed", DISCRETE), (2, 2, 1e6, "kept", DISCRETE)],
    ids=["W1", "W1-accum2-clipped", "W2-clipped", "W2-accum2", "W1-gpu-clipped", "W2-accum2-gpu"])
def test_the_speculative_step_is_bitwise_the_ordinary_step(world, accum, clip, outcome, env):
    steps = 4
    sure = steps - 1  # the steps after the first, which shows how many backward calls make a step
    runs = run_both(world, accum, clip, steps=steps, env=env)
    assert_bitwise(runs["on"], runs["off"])
    for spec, plain in zip(runs["on"], runs["off"]):
        assert spec["mode"].startswith("speculative") and plain["mode"].startswith("after backward")
        counts = spec["counts"]
        # Each shard's speculation either ran (then kept or recomputed) or the step claimed it first and stepped it
        # itself (see [Note: speculation on a lane of its own]); which, the threads' timing decides.
        trained = counts.get("optimizer_speculative", 0)
        assert trained + counts.get("speculation_cancelled", 0) == sure * spec["units"]
        assert counts.get(f"speculation_{outcome}", 0) == trained
        other = "recomputed" if outcome == "kept" else "kept"
        assert f"speculation_{other}" not in counts and "optimizer_speculative" not in plain["counts"]
    ref = train_reference("gpt", steps, 2 * accum * world, 2, clip=clip, world=world)
    for key, value in ref["state"].items():
        torch.testing.assert_close(runs["on"][0]["state"][key], value)


def test_steps_where_clipping_fires_and_steps_where_it_does_not_mix_bitwise():
    norms = run_ranks(_norms, 1, config=spec_config(1, 1, 1e6, "off"), steps=6)[0][1:]
    # fires on about half the steps that speculate: all but the first, which shows how many backward calls make a
    # step (and, the largest norm, always clipped: counted in, it left too few clipped speculations to see one)
    clip = sorted(norms)[len(norms) // 2]
    runs = run_both(1, 1, clip, steps=6)
    assert_bitwise(runs["on"], runs["off"])
    counts = runs["on"][0]["counts"]
    assert counts.get("speculation_kept", 0) > 0 and counts.get("speculation_recomputed", 0) > 0


def _norms(rank, world, config, steps):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    out = []
    for tokens in batches(steps, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
        out.append(engine.last_grad_norm)
    engine.close()
    return out


def test_the_early_step_keeps_and_recomputes_speculations_bitwise():
    """The early step settles each speculated shard on the worker, in the next forward's order."""
    early = {"early_step": "on", "overlap_step": "on"}
    for clip in (1e6, 1e-3):
        runs = {mode: run_ranks(train_engine, 1, name="gpt", steps=3, micro=2, accum=1,
                                config=spec_config(1, 1, clip, mode, **early)) for mode in ("on", "off")}
        assert "step() returns before Adam" in runs["on"][0]["mode"]
        assert runs["on"][0]["counts"]["optimizer_speculative"] > 0
        assert_bitwise(runs["on"], runs["off"])


def _held_speculation(rank, world, config, steps):
    """Each step's first speculation is held running until the step claims that shard, and the step's claims wait
    until it has begun, so every other one is still queued when claimed (the step steps it itself) and that one is
    waited for."""
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    spec = engine.optimizer.speculation
    lane = spec.lane
    speculate, claim = spec._speculate, lane.claim
    begun = {s: threading.Event() for s in range(1, steps + 1)}  # by step: its first speculation has begun
    held = {s: threading.Event() for s in range(1, steps + 1)}  # ... and is released (its shard was claimed)
    first: list[int] = []  # the held shard's unit, per step

    def held_speculate(group, member, overlap):
        if not begun[overlap.step].is_set():
            first.append(member.unit)
            begun[overlap.step].set()
            held[overlap.step].wait(30)
        speculate(group, member, overlap)

    def claim_releasing(unit):
        if unit in lane._tickets:  # the step's claim (no second gradient lands in this model)
            step = engine.global_steps
            begun[step].wait(30)
            if unit == first[-1]:
                held[step].set()
        return claim(unit)

    spec._speculate, lane.claim = held_speculate, claim_releasing
    for tokens in batches(steps, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
    out = {"state": engine.full_state_dict(), "counts": engine.telemetry.snapshot().counts,
           "units": len(engine.units), "first": first, "mode": engine.step_mode}
    engine.close()
    return out


@pytest.mark.parametrize("clip,outcome,early", [(1e6, "kept", "on"), (1e-3, "recomputed", "off")],
                         ids=["kept-early", "recomputed-after"])
def test_the_step_claims_queued_speculations_and_waits_for_a_running_one_bitwise(clip, outcome, early):
    """See [Note: speculation on a lane of its own]: claimed before the lane began it, a shard is stepped by the
    step itself; begun, it is waited for, then kept or recomputed. Bitwise the ordinary step either way."""
    steps, section = 3, {"early_step": early, "overlap_step": "on"}
    sure = steps - 1  # the first step shows how many backward calls make a step: it does not speculate
    on = run_ranks(_held_speculation, 1, config=spec_config(1, 1, clip, "on", **section), steps=steps)[0]
    off = run_ranks(train_engine, 1, name="gpt", steps=steps, micro=2, accum=1,
                    config=spec_config(1, 1, clip, "off", **section))[0]
    assert on["mode"].startswith("speculative")
    assert ("step() returns before Adam" in on["mode"]) is (early == "on")
    counts = on["counts"]
    # the held shard lands first and the step claims in unit order, so it is the last claimed: only it ran
    assert on["first"] == [on["units"] - 1] * sure
    assert counts["optimizer_speculative"] == counts[f"speculation_{outcome}"] == sure
    assert counts["speculation_cancelled"] == sure * (on["units"] - 1)
    for key, value in off["state"].items():
        assert torch.equal(on["state"][key], value), key


def _failing_speculation(rank, world, config, steps, drop_at):
    """Every second speculation raises half way (after writing garbage into the shard's new 16-bit copy); step
    ``drop_at``'s gradients are dropped (zero_grad) instead of stepped."""
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    opt = engine.optimizer
    step_shard, calls = opt.update.step_shard, []

    def failing(index, views, step, hypers, grad_scale, into=None, target=None):
        if threading.current_thread().name == "offload-speculate":  # a speculation: garbage, then it fails
            calls.append(index)
            if len(calls) % 2:
                opt.params.step_target(index).fill_(7.0)
                raise RuntimeError("speculation failed")
        step_shard(index, views, step, hypers, grad_scale, into=into, target=target)

    opt.update.step_shard = failing
    losses = []
    for step, tokens in enumerate(batches(steps, 2)):
        losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
        if step == drop_at:
            engine.zero_grad()  # the failed speculations' 16-bit copies must be the last step's again
        else:
            engine.step()
    out = {"losses": losses, "state": engine.full_state_dict(), "counts": engine.telemetry.snapshot().counts}
    engine.close()
    return out


def test_a_speculation_that_fails_is_stepped_by_the_step_bitwise():
    """A speculative Adam that raises on its lane leaves the shard to the step (its 16-bit copy restored, which
    the forward after a dropped step reads), and the lane goes on with the next ones."""
    steps = 4
    on, off = (run_ranks(_failing_speculation, 1, config=spec_config(1, 1, 1e6, mode), steps=steps, drop_at=1)[0]
               for mode in ("on", "off"))
    failed = on["counts"].get("speculation_failed", 0)
    assert failed > 0 and on["counts"].get("optimizer_speculative", 0) > failed  # the lane went on after one
    assert on["losses"] == off["losses"]
    for key, value in off["state"].items():
        assert torch.equal(on["state"][key], value), key


def _fp16_with_overflow(rank, world, speculative, drop_at):
    config = {**spec_config(world, 1, 1.0, speculative), "fp16": {"enabled": True, "initial_scale_power": 8,
                                                                   "hysteresis": 1, "loss_scale_window": 2}}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    log = []
    for step, tokens in enumerate(batches(5, 2 * world)):
        loss = loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2])
        if step == 1 and rank == world - 1:
            loss = loss * math.inf  # an overflow: the speculation is dropped, the step skipped
        engine.backward(loss)
        if step == drop_at:
            engine.zero_grad()  # the caller drops this step's gradients: so is the speculation
        else:
            engine.step()
        log.append((engine.skipped_steps, loss.item()))
    out = {"log": log, "state": engine.full_state_dict(), "mode": engine.step_mode,
           "counts": engine.telemetry.snapshot().counts}
    engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_dropped_speculation_leaves_the_weights_of_the_last_step(world):
    """fp16 overflow (one rank's) skips a step and zero_grad drops another: each speculation is thrown away,
    and the 16-bit weights the next forward reads are the last step's, bitwise."""
    runs = {mode: run_ranks(_fp16_with_overflow, world, speculative=mode, drop_at=3) for mode in ("on", "off")}
    for spec, plain in zip(runs["on"], runs["off"]):
        assert spec["mode"].startswith("speculative")
        assert spec["counts"]["optimizer_speculative"] > 0
        assert spec["log"] == plain["log"] and spec["log"][1][0] == 1  # the overflowed step was skipped
        for key, value in plain["state"].items():
            assert torch.equal(spec["state"][key], value), key


def test_a_host_budget_without_room_for_the_second_slot_steps_after_backward_and_says_why():
    config = spec_config(1, 1, 1.0, "on")
    on = run_ranks(describe_engine, 1, config=config)[0]
    slot = on["memory"]["host"][SPECULATIVE_SLOT]
    assert slot == on["memory"]["host"]["optimizer state"]  # 12 bytes per host-resident parameter
    total = on["memory"]["host"]["total"]
    tight = {**config, "offload": {**config["offload"], "budgets": {"host": total - slot // 2}}}
    off = run_ranks(describe_engine, 1, config=tight)[0]
    assert off["mode"].startswith("after backward") and "offload.budgets.host" in off["mode"]
    assert "second slot" in off["mode"] and SPECULATIVE_SLOT not in off["memory"]["host"]


@pytest.mark.parametrize("change,reason", [
    ({"gradient_clipping": 0.0}, None),  # nothing to speculate on: the exact overlapped step runs
    ({"offload": {"unit_bytes": 8192, "speculative_step": "auto"}}, "'auto' speculates only on NVMe sub-groups"),
    ({"offload": {"unit_bytes": 8192, "speculative_step": False}}, "offload.speculative_step is off"),
    ({"offload": {"unit_bytes": 8192, "overlap_step": "off"}}, "offload.overlap_step is off"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "ignore_unused_parameters": False}}, "ignore_unused_parameters false"),
])
def test_the_engine_says_why_it_does_not_speculate(change, reason):
    mode = run_ranks(describe_engine, 1, config={**spec_config(1, 1, 1.0, True), **change})[0]["mode"]
    if reason is None:
        assert mode.startswith("overlapped")
    else:
        assert mode.startswith("after backward") and f"not speculative: {reason}" in mode


def test_the_estimate_counts_the_second_slot_where_the_engine_would_take_it():
    config = Config.load(spec_config(1, 1, 1.0, "on")).resolve(world_size=1)
    units = [50_000] * 4
    on_cpu = estimate(units, config, 1, discrete=False).tiers["host"]
    assert on_cpu[SPECULATIVE_SLOT] == on_cpu["optimizer state"]
    assert SPECULATIVE_SLOT in estimate(units, config, 1, discrete=True).tiers["host"]  # "on" is on on a GPU too
    auto = Config.load(spec_config(1, 1, 1.0, "auto")).resolve(world_size=1)
    assert SPECULATIVE_SLOT not in estimate(units, auto, 1, discrete=False).tiers["host"]  # auto: off for now
    tight = Config.load({**spec_config(1, 1, 1.0, "on"),
                         "offload": {"speculative_step": "on", "unit_bytes": 8192,
                                     "budgets": {"host": sum(on_cpu.values()) - on_cpu[SPECULATIVE_SLOT] // 2}}}
                        ).resolve(world_size=1)
    est = estimate(units, tight, 1, discrete=False)
    assert SPECULATIVE_SLOT not in est.tiers["host"]
    assert any("does not speculate" in note and "second slot" in note for note in est.notes)


def test_a_switch_takes_json_true_and_false_as_on_and_off():
    raw = spec_config(1, 1, 1.0, True)
    assert Config.load(raw).offload.speculative_step == "on"
    assert Config.load({**raw, "offload": {"speculative_step": False}}).offload.speculative_step == "off"
    with pytest.raises(ConfigError, match=r"offload.speculative_step.*3 is not one of 'auto', 'on', 'off'"):
        Config.load({**raw, "offload": {"speculative_step": 3}})
    with pytest.raises(ConfigError, match=r"offload.aio_engine.*True is not one of 'auto', 'io_uring', 'threads'"):
        Config.load({**raw, "offload": {"aio_engine": True}})


def nvme_spec_config(path, speculative, clip, host=None):
    config = spec_config(1, 1, clip, speculative)
    config["zero_optimization"]["sub_group_size"] = 3000
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2}
    if host is not None:  # the first sub-groups (and, speculating, their second slots) on the host, the rest NVMe
        config["offload"]["budgets"] = {"host": host}
    return config


@pytest.mark.parametrize("clip,outcome", [(1e6, "kept"), (1e-3, "recomputed")])
@pytest.mark.parametrize("host", [None, 700_000], ids=["nvme", "host-and-nvme"])
def test_nvme_sub_groups_speculate_in_their_read_buffers_bitwise(tmp_path, clip, outcome, host):
    """The swap file's second slot is the speculation's: kept, the pass goes on; wrong, it is run again."""
    steps = 3
    sure = steps - 1  # the first step shows how many backward calls make a step: it does not speculate
    runs = {mode: run_ranks(train_engine, 1, name="gpt", steps=steps, micro=2, accum=1,
                            config=nvme_spec_config(tmp_path / mode, mode, clip, host)) for mode in ("on", "off")}
    spec, plain = runs["on"][0], runs["off"][0]
    assert spec["mode"].startswith("speculative") and "nvme" in spec["tiers"]
    # the host's sub-groups are placed with their second slots, so fewer of them fit than without
    assert spec["tiers"].get("host", 0) <= plain["tiers"].get("host", 0)
    assert ("host" in spec["tiers"]) is (host is not None)
    counts = spec["counts"]
    # NVMe sub-groups speculate in their read buffers, all of them; host ones may be claimed by the step first
    speculated = counts["optimizer_speculative"]
    assert speculated + counts.get("speculation_cancelled", 0) == sure * spec["units"]
    assert speculated == counts[f"speculation_{outcome}"]
    if host is None:
        assert speculated == sure * spec["units"]
    assert_bitwise(runs["on"], runs["off"])


def _nvme_dropped(rank, world, path, speculative):
    config = {**nvme_spec_config(path, speculative, 1e6), "fp16": {"enabled": True, "initial_scale_power": 8}}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    for step, tokens in enumerate(batches(4, 2)):
        loss = loss_of(engine, "gpt", tokens)
        engine.backward(loss * math.inf if step == 1 else loss)  # step 1 overflows: the speculation is dropped
        if step == 2:
            engine.full_state_dict()  # a reader between backward and step drops it too (the step then runs whole)
        engine.step()
    out = {"state": engine.full_state_dict(), "skipped": engine.skipped_steps,
           "counts": engine.telemetry.snapshot().counts}
    engine.close()
    return out


def test_a_dropped_nvme_speculation_leaves_the_last_step_on_disk_and_in_the_weights(tmp_path):
    runs = {mode: run_ranks(_nvme_dropped, 1, path=str(tmp_path / mode), speculative=mode)[0] for mode in ("on", "off")}
    spec = runs["on"]
    assert spec["skipped"] == runs["off"]["skipped"] == 1 and spec["counts"]["optimizer_speculative"] > 0
    assert spec["counts"].get("speculation_kept", 0) > 0  # the steps nothing dropped kept their guesses
    for key, value in runs["off"]["state"].items():
        assert torch.equal(spec["state"][key], value), key


@pytest.mark.parametrize("clip", [1e6, 1e-3])
def test_auto_speculates_on_nvme_sub_groups_while_the_last_step_did_not_clip(tmp_path, clip):
    """Clipping never firing: every step but the first (which shows how many backward calls make a step) speculates
    and keeps. Always firing: the second step speculates and recomputes, and then none does (the last step clipped).
    Bitwise the step after backward either way."""
    steps = 3
    runs = {mode: run_ranks(train_engine, 1, name="gpt", steps=steps, micro=2, accum=1,
                            config=nvme_spec_config(tmp_path / mode, mode, clip)) for mode in ("auto", "off")}
    auto = runs["auto"][0]
    assert "on the NVMe sub-groups, while the last step's clipping did not fire" in auto["mode"]
    counts, units = auto["counts"], auto["units"]
    if clip > 1:
        assert counts["optimizer_speculative"] == (steps - 1) * units == counts["speculation_kept"]
    else:
        assert counts["optimizer_speculative"] == units == counts["speculation_recomputed"]
    assert_bitwise(runs["auto"], runs["off"])
