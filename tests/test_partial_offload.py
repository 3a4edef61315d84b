"""offload_optimizer.ratio: part of the optimizer state stays on the compute device and is stepped there (see
[Note: a partial offload] in offload/optim/sharded.py). On this CPU the device tier is host memory with its own
budget, so the split, its accounting and its results are all checked here."""

import logging

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    check_parity,
    describe_engine,
    make_model,
    train_engine,
    train_reference,
)

import offload
from offload.commands.estimate import estimate, model_units
from offload.config import AUTO, Config
from offload.machine.launch import run_ranks
from offload.optim import update


def ratio_config(world, accum, ratio, device_budget=None, **offload_section):
    config = base_config(2, accum, world)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    config["offload"].update(offload_section)
    if device_budget is not None:
        config["offload"]["budgets"] = {"device": device_budget}
    return config


def device_state(raw, world=1):
    """Elements of optimizer state the engine's own plan keeps on the device, and all of them."""
    config = Config.load(raw).resolve(world_size=world)
    est = estimate(model_units(make_model("gpt"), config), config, world, discrete=False)
    everything = estimate(model_units(make_model("gpt"), config), Config.load(
        ratio_config(world, 1, 0.0)).resolve(world_size=world), world, discrete=False)
    return est.tiers["device"].get("optimizer state", 0), everything.tiers["device"]["optimizer state"]


def fitting_budget(world=1):
    """The smallest device budget (to 1 KiB) under which auto keeps all the optimizer state on the device, none
    on the host (by bisection over the engine's own plan; the device's bytes alone would not tell, as a last
    small unit can share the page another unit rounds up to)."""
    lo, hi = 0, 1 << 26
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        config = Config.load(ratio_config(world, 1, "auto", mid)).resolve(world_size=world)
        est = estimate(model_units(make_model("gpt"), config), config, world, discrete=False)
        lo, hi = (mid, hi) if est.tiers["host"].get("optimizer state", 0) else (lo, mid)
    return hi


def splitting_budget(world=1):
    """A device budget under which auto keeps about half the optimizer state on the device (found by bisection
    over the engine's own plan)."""
    lo, hi = 0, 1 << 26
    _, full = device_state(ratio_config(world, 1, "auto", hi), world)
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        kept, _ = device_state(ratio_config(world, 1, "auto", mid), world)
        lo, hi = (mid, hi) if kept < full // 2 else (lo, mid)
    return hi


@pytest.mark.parametrize("world,accum", [(1, 1), (2, 4)])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0, "auto"])
def test_every_split_trains_as_plain_pytorch(world, accum, ratio):
    budget = splitting_budget(world) if ratio == "auto" else None
    config = ratio_config(world, accum, ratio, budget)
    results = run_ranks(train_engine, world, name="gpt", config=config, steps=3, micro=2, accum=accum)
    memory = results[0]["memory"]
    on_device = memory["device"].get("optimizer state", 0)
    on_host = memory["host"].get("optimizer state", 0)
    if ratio == 0.0:
        assert on_device > 0 and on_host == 0
    elif ratio == 1.0:
        assert on_device == 0 and on_host > 0
    else:  # a split, the device's share where the plan put it (the budget held it)
        assert on_device > 0 and on_host > 0
        assert on_device == device_state(config, world)[0]
        if budget is not None:
            resident = {k: v for k, v in memory["device"].items() if k != "budget" and not k.startswith("gathered")}
            assert sum(resident.values()) <= budget
    check_parity(results, train_reference("gpt", 3, 2 * accum * world, 2, world=world))


def test_ratio_keeps_the_units_the_forward_needs_first_nearest_the_fraction():
    kept, full = device_state(ratio_config(1, 1, 0.5))
    assert 0.3 * full < kept < 0.7 * full
    assert device_state(ratio_config(1, 1, 0.75))[0] < kept < device_state(ratio_config(1, 1, 0.25))[0]


def _train_with_every_speculation_run(rank, world, **kwargs):
    """train_engine, with each claim of a shard waiting until the speculation lane is idle: every speculation
    handed over runs before the step claims it. Left to the threads' timing, a loaded 2-core box can cancel all of
    them (the step claims before the lane is scheduled), and the test would then compare no speculated shard."""
    from offload.optim.speculation_lane import SpeculationLane
    claim = SpeculationLane.claim

    def claim_after_the_lane(self, unit):
        self.drain()
        return claim(self, unit)

    SpeculationLane.claim = claim_after_the_lane  # this rank's process only
    return train_engine(rank, world, **kwargs)


@pytest.mark.parametrize("mode", ["early", "speculative"])
def test_a_split_keeps_the_early_and_speculative_steps_bitwise(mode):
    """The device's units step on the training thread (early step) or after backward (speculation runs for the
    host's units only); the results are bitwise those of the plain step after backward."""
    on = {"early": {"early_step": "on"}, "speculative": {"speculative_step": "on"}}[mode]
    off = {"early_step": "off", "speculative_step": "off"}
    runs = {name: run_ranks(_train_with_every_speculation_run, 1, name="gpt", steps=3, micro=2, accum=1,
                            config=ratio_config(1, 1, 0.5, **section)) for name, section in (("on", on), ("off", off))}
    counts = runs["on"][0]["counts"]
    assert counts.get("optimizer_early" if mode == "early" else "optimizer_speculative", 0) > 0
    assert "speculation_cancelled" not in counts
    for key, value in runs["off"][0]["state"].items():
        assert torch.equal(runs["on"][0]["state"][key], value), key


def test_auto_stays_auto_through_resolve_and_keeps_nothing_on_a_cpu_without_a_device_budget():
    config = Config.load(ratio_config(1, 1, "auto")).resolve(world_size=1)
    assert config.zero_optimization.offload_optimizer.ratio is AUTO
    plan = run_ranks(describe_engine, 1, config=ratio_config(1, 1, "auto"))[0]
    assert "optimizer state" not in plan["memory"]["device"] and plan["memory"]["host"]["optimizer state"] > 0


def test_the_estimate_says_what_stays_on_the_device_and_when_all_of_it_would_fit():
    config = Config.load(ratio_config(1, 1, 0.5)).resolve(world_size=1)
    est = estimate(model_units(make_model("gpt"), config), config, 1, discrete=False)
    assert any("offload_optimizer.ratio 0.5: the optimizer state of" in n and "stays on the device" in n
               for n in est.notes)
    traffic = next(n for n in est.notes if n.startswith("optimizer step traffic"))
    assert "device: " in traffic and "host: " in traffic and "GB through host memory" in traffic
    roomy = Config.load(ratio_config(1, 1, 1.0, 1 << 30)).resolve(world_size=1)
    est = estimate(model_units(make_model("gpt"), roomy), roomy, 1, discrete=False)
    assert any("the whole optimizer state would fit on the device" in n for n in est.notes)


@pytest.mark.parametrize("ratio,budget,said", [(1.0, "fits", True), (1.0, "1 KiB short", False),
                                               (1.0, None, False), ("auto", "fits", False)],
                         ids=["fits", "short", "no-device-budget", "auto"])
def test_start_up_says_when_the_whole_optimizer_state_would_fit_on_the_device(caplog, ratio, budget, said):
    """With the state offloaded whole (ratio 1) and room for all of it on the device, start-up says ratio auto
    would keep it there. The room is the plan's own (at its boundary); not said when the state is 1 KiB short of
    it, when nothing bounds the device (a CPU without a device budget), or when auto keeps it there already."""
    fits = fitting_budget()
    bytes_ = {"fits": fits, "1 KiB short": fits - 1024, None: None}[budget]
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        engine = offload.initialize(model=make_model("gpt"), config=ratio_config(1, 1, ratio, bytes_), device="cpu")[0]
        engine.close()
    lines = [r.getMessage() for r in caplog.records if "would fit on the device" in r.getMessage()]
    assert len(lines) == said, lines
    assert all('offload_optimizer.ratio "auto" keeps it there' in line for line in lines)


def test_a_split_on_an_emulated_gpu_trains_as_plain_pytorch():
    """The GPU's paths on this CPU: the offloaded units' gradients land in buffers of their own after an emulated
    copy delay (and add up on the device with accumulation), the device units' never leave it."""
    env = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}
    for accum in (1, 2):
        config = ratio_config(1, accum, 0.5, early_step="on")
        results = run_ranks(train_engine, 1, env=env, name="gpt", config=config, steps=3, micro=2, accum=accum)
        memory = results[0]["memory"]
        assert memory["device"]["optimizer state"] > 0 and memory["host"]["optimizer state"] > 0
        assert "gradient landing" in memory["host"]  # the offloaded units' gradients crossed to the host
        check_parity(results, train_reference("gpt", 3, 2 * accum, 2, world=1))


def test_a_split_between_the_device_and_nvme_trains_as_plain_pytorch(tmp_path):
    config = ratio_config(1, 2, 0.5)
    config["zero_optimization"]["offload_optimizer"].update(device="nvme", nvme_path=str(tmp_path))
    config["zero_optimization"]["sub_group_size"] = 3000
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=3, micro=2, accum=2)
    assert set(results[0]["tiers"]) == {"device", "nvme"}
    check_parity(results, train_reference("gpt", 3, 4, 2, world=1))


@pytest.mark.parametrize("discrete", [False, True])
def test_the_device_tier_steps_with_torchs_fused_kernel_on_a_discrete_device_only(monkeypatch, discrete):
    """[Note: Adam on a discrete device]: a GPU's state (here the emulated one) takes torch's fused kernel and one
    multi-tensor norm; on a CPU device the device tier is host memory and keeps the native kernels, bitwise the host
    tier's."""
    if discrete:
        monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    from offload.optim.sharded import ShardedAdam
    calls, norms = [], []
    fused, device_norm = update.device_adam_step, ShardedAdam.device_grad_sq_norm
    monkeypatch.setattr(update, "device_adam_step", lambda *args, **kw: (calls.append(args[4]), fused(*args, **kw)))
    monkeypatch.setattr(ShardedAdam, "device_grad_sq_norm",
                        lambda self: (lambda n: (norms.append(n is not None), n)[1])(device_norm(self)))
    results = train_engine(0, 1, name="gpt", config=ratio_config(1, 1, 0.0), steps=2, micro=2, accum=1)
    assert sorted(set(calls)) == ([1, 2] if discrete else [])
    assert norms == [discrete, discrete]  # a step's norm of the device's gradients taken there, once
    check_parity([results], train_reference("gpt", 2, 2, 2, world=1))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_split_at_stages_1_and_2_trains_as_plain_pytorch(stage):
    """The parameters stay whole on the device there; the state of the first units stays with them."""
    config = ratio_config(2, 2, 0.5)
    config["zero_optimization"]["stage"] = stage
    results = run_ranks(train_engine, 2, name="gpt", config=config, steps=3, micro=2, accum=2)
    memory = results[0]["memory"]
    assert memory["device"]["optimizer state"] > 0 and memory["host"]["optimizer state"] > 0
    check_parity(results, train_reference("gpt", 3, 8, 2, world=2))
