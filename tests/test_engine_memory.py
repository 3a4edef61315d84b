"""Gathered parameters stay within stage3_max_live_parameters; persistent units stay gathered."""

import pytest
import torch
from engine_cases import STREAM_CHECK, base_config, check_parity, make_model, train_engine, train_reference

from offload.machine.launch import RankError, run_ranks

STEPS = 3


# W = 1 gathers too (else a CPU reads units in place)
DISCRETE = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}


def _run(world, **zero):
    zero.setdefault("stage3_prefetch_bucket_size", 0)  # on-demand gathers only, unless a test asks
    return run_ranks(train_engine, world, env=DISCRETE, name="gpt", config=base_config(2, 1, world, **zero),
                     steps=STEPS, micro=2, accum=1)


def test_units_are_released_after_use():
    unlimited = _run(2)[0]
    total = sum(v.numel() for k, v in train_reference("gpt", 1, 4, 2, world=2)["state"].items() if k != "head.weight")
    assert unlimited["peak_live"] < total / 2, "ZeRO-3 should never hold most of the model gathered"
    assert unlimited["gathers"] > 2 * unlimited["units"] * STEPS, "each unit is gathered for forward and backward"


def test_prefetch_gathers_ahead_within_its_bucket():
    on_demand = _run(2)[0]
    ahead = _run(2, stage3_prefetch_bucket_size=5000)[0]
    assert on_demand["prefetched"] == 0 and ahead["prefetched"] > ahead["units"]
    # The same gathers, many issued earlier; the final evaluation's forward (no backward follows) may waste
    # the prefetches of the first backward units.
    assert on_demand["gathers"] <= ahead["gathers"] <= on_demand["gathers"] + 4
    largest_unit = 4224 + 4224 % 2
    assert on_demand["peak_live"] < ahead["peak_live"] <= on_demand["peak_live"] + 5000 + largest_unit


def test_high_water_mark_stays_under_max_live_and_training_is_unchanged():
    peak = _run(2)[0]["peak_live"]
    # Every unit persistent, so the engine must evict idle ones to stay under the limit. A threshold that high
    # also folds each LayerNorm into a neighbour (offload/zero/plan.py), so the limit makes room for the largest
    # folded unit beside the tied embedding the head keeps gathered.
    from offload.zero.plan import plan_units
    folded = max(p.numel for p in plan_units(make_model("gpt"), 8192, 4, fold_below=10**9))
    peak = max(peak, 3072 + folded + folded % 2)
    total = sum(p.numel() for p in make_model("gpt").parameters())
    assert peak < total / 2, "a limit that forces evictions"
    limited = _run(2, stage3_max_live_parameters=peak, stage3_param_persistence_threshold=10**9)
    ref = train_reference("gpt", STEPS, 4, 2, world=2)
    for rank in limited:
        assert rank["peak_live"] <= peak
        for key, value in ref["state"].items():
            torch.testing.assert_close(rank["state"][key], value)


def test_persistent_units_are_gathered_once_per_step():
    # Host-homed shards: at W = 1 a device home is read where it lives and never gathered (the test below).
    persistent = _run(1, stage3_param_persistence_threshold=10**9, offload_param={"device": "cpu"})[0]
    # Gathered once per step (each update makes the gathered copy stale) and once for the final evaluation.
    assert persistent["gathers"] == persistent["units"] * (STEPS + 1)


@pytest.mark.parametrize("early", ["off", "on"])
def test_one_rank_reads_device_homes_where_they_live_and_trains_the_same(early):
    """[Note: reading the home]: at W = 1 on a discrete device, a unit homed on the device is never gathered,
    copied or released, and training is bitwise the reference's (the early step's copies back are waited for on
    the compute stream; the emulated copy delay makes a missing wait read stale values)."""
    config = base_config(2, 1, 1)
    config["offload"]["early_step"] = early
    env = {**DISCRETE, "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}
    got = run_ranks(train_engine, 1, env=env, name="gpt", config=config, steps=STEPS, micro=2, accum=1)[0]
    assert got["gathers"] == 0 and got["peak_live"] == 0
    check_parity([got], train_reference("gpt", STEPS, 2, 2, world=1))
    # The same arithmetic as on a CPU device, which reads every shard in place: bitwise its result.
    cpu = run_ranks(train_engine, 1, name="gpt", config=config, steps=STEPS, micro=2, accum=1)[0]
    assert got["losses"] == cpu["losses"]
    for key, value in cpu["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=0)


def test_a_limit_below_one_unit_is_a_clear_error():
    with pytest.raises(RankError, match="stage3_max_live_parameters=1000.*Raise stage3_max_live_parameters"):
        _run(1, stage3_max_live_parameters=1000, offload_param={"device": "cpu"})  # host homes are gathered


def _budget_run(rank, world, budget):
    from engine_cases import make_model

    import offload
    config = {**base_config(2, 1, world), "offload": {"unit_bytes": 8192, "budgets": {"device": budget}}}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    from engine_cases import batches, loss_of
    for tokens in batches(2, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        engine.step()
    summary = engine.memory_summary()
    engine.close()
    return summary, engine.runtime.limit


def test_device_budget_bounds_gathered_bytes_and_the_summary_adds_up():
    shards_only = run_ranks(_budget_run, 2, budget=None)[0][0]["device"]["shards"]
    budget = shards_only + 40_000  # room for 10,000 gathered fp32 elements beside the shards
    summary, limit = run_ranks(_budget_run, 2, budget=budget)[0]
    assert limit.elements == 10_000 and limit.source.startswith("offload.budgets.device")
    device = summary["device"]
    assert device["shards"] + device["gathered_peak"] <= budget
    assert device["gathered_now"] == 0 and device["budget"] == budget
    # fp32 master, exp_avg and exp_avg_sq (12 bytes per shard element, whole 4 KiB pages per sub-group) on the
    # host; no fp32 gradient accumulators with one micro-batch a step (gradients are read where they land).
    host = summary["host"]
    assert 3 * device["shards"] <= host["optimizer state"] < 3 * device["shards"] + 4096
    assert "gradient accumulators" not in host
    assert host["total"] == sum(v for k, v in host.items() if k not in ("total", "peak"))


def test_a_device_budget_below_shards_plus_one_unit_fails_at_initialize():
    with pytest.raises(RankError, match="offload.budgets.device: 50,000 bytes cannot hold this rank's resident "
                                        "state .* raise it to at least"):
        run_ranks(_budget_run, 1, budget=50_000)


def test_a_ranks_config_error_reaches_the_parent_whole():
    from offload.config import ConfigError
    with pytest.raises(RankError) as failed:
        run_ranks(_budget_run, 1, budget=50_000)
    # The exception itself crosses the process boundary, so a command can tell the user's config from a crash.
    assert isinstance(failed.value.cause, ConfigError) and failed.value.cause.path == "offload.budgets.device"
    with pytest.raises(RankError, match="rank 0 failed") as failed:
        run_ranks(_unpicklable_failure, 1)
    assert failed.value.cause is None and "_Unpicklable: no" in str(failed.value)  # text only, still whole


class _Unpicklable(RuntimeError):
    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


def _unpicklable_failure(rank, world):
    raise _Unpicklable("no", "way")


def _plan_and_measure(rank, world, stage, optimizer, params):
    from engine_cases import make_model

    import offload

    config = base_config(2, 1, world, stage=stage)
    config["zero_optimization"]["offload_optimizer"] = {"device": optimizer}
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config, device="cpu")
    measured = engine.memory.device_parts()
    engine.close()
    return measured


@pytest.mark.parametrize("stage,optimizer,params", [(0, "none", "none"), (1, "cpu", "none"), (2, "none", "none"),
                                                    (3, "none", "none"), (3, "cpu", "cpu")])
def test_the_plan_predicts_what_the_engine_keeps_on_the_device(stage, optimizer, params):
    """The placement plan (which checks the device budget before anything is allocated) and the engine's own
    account of what it keeps on the device between uses agree, part for part."""
    from engine_cases import make_model

    from offload.commands.estimate import estimate, model_units
    from offload.config import Config

    world = 2
    measured = run_ranks(_plan_and_measure, world, stage=stage, optimizer=optimizer, params=params)[0]
    config = base_config(2, 1, world, stage=stage)
    config["zero_optimization"]["offload_optimizer"] = {"device": optimizer}
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    resolved = Config.load(config).resolve(world_size=world)
    planned = estimate(model_units(make_model("gpt"), resolved), resolved, world).tiers["device"]
    planned.pop("gathered (at most)", None)
    assert planned == measured


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_on_a_cpu_at_w1_units_are_read_in_place_and_nothing_is_copied(params):
    """The compute device is host memory: every unit's parameters are views of the store's shard itself, and a
    training step gathers, copies and releases nothing, yet trains as torch does."""
    from engine_cases import batches, loss_of, make_model

    import offload

    config = base_config(2, 1, 1)
    config["zero_optimization"]["offload_param"] = {"device": params}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    for unit in engine.units:
        home = engine.params._shards[unit.index]
        memory = home.device if params == "none" else home.host
        assert unit.in_place and unit.full.data_ptr() == memory.data_ptr()
    losses = []
    for tokens in batches(STEPS, 2):
        losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
        engine.step()
    snap = engine.telemetry.snapshot()
    assert engine.runtime.gathers == 0 and engine.runtime.peak_live == 0
    assert not snap.bytes.get("h2d") and not snap.bytes.get("all_gather")
    state = engine.full_state_dict()
    engine.close()
    ref = train_reference("gpt", STEPS, 2, 2, world=1)
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value)
    assert losses == pytest.approx(ref["losses"], rel=1e-5)


def _chain_gathers(rank, world, anchors_per_unit):
    """Gathers per training step of a chain of 12 equal Linear layers cut into units of ``anchors_per_unit``
    siblings each, and its parameters after three steps beside plain PyTorch's."""
    import copy

    import offload
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)])
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"},
                                    "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0},
              "offload": {"unit_bytes": 1056 * 4 * anchors_per_unit}}
    engine, *_ = offload.initialize(model=model, config=config)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    counts = []
    for step in range(3):
        x = torch.randn(2 * world, 32, generator=torch.Generator().manual_seed(step))
        before = engine.runtime.gathers
        engine.backward(engine(x[rank * 2:rank * 2 + 2]).square().mean())
        engine.step()
        counts.append(engine.runtime.gathers - before)
        reference(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    anchors = [len(u.plan.anchors) for u in engine.units]
    state = engine.full_state_dict()
    engine.close()
    return counts, anchors, state, reference.state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_a_unit_of_several_siblings_is_gathered_once_per_forward(world):
    """[Note: when a unit is gathered]: a run of small siblings shares a unit; released between its anchors it was
    gathered once per anchor (three times per forward here), its whole size over PCIe or the network each time."""
    counts, anchors, state, reference = run_ranks(_chain_gathers, world, env=DISCRETE, anchors_per_unit=3)[0]
    assert anchors == [3, 3, 3, 3]
    assert counts == [2 * len(anchors)] * 3, "once for the forward and once for the backward"
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value)
