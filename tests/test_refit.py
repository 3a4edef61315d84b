"""`offload_optimizer.ratio: auto` corrected after the first step (see [Note: the split refitted] in
offload/engine/refit.py): host sub-groups move to the device between steps, and training goes on as plain
PyTorch's, bitwise as if they had never moved where both tiers run the same kernels (a CPU device)."""

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    check_parity,
    loss_of,
    make_model,
    train_engine,
    train_reference,
)

import offload
from offload.commands.estimate import estimate, model_units
from offload.config import Config
from offload.engine.refit import MARGIN_MIN, refit_choice, refits, spare_after
from offload.machine.launch import run_ranks
from offload.store.sub_groups import plan_sub_groups
from offload.store.tier import Tier

EMULATED_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}


def split_config(world, accum, ratio=0.75, **offload_section):
    config = base_config(2, accum, world)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    config["zero_optimization"]["sub_group_size"] = 3000  # several host sub-groups to choose among
    config["offload"].update(offload_section)
    return config


def train_refitted(rank, world, config, steps, micro, accum, spare, started=None):
    """Train ``steps`` steps; after the first, the refit moves what ``spare`` bytes hold (None: only what the
    engine's step does itself). Returns train_engine's result with the tiers at start and end, and the split and
    host budget before and after the move; ``started(engine)`` runs after initialize."""
    seen = {"moved": 0}

    def split(engine):
        opt = engine.optimizer
        return {"tiers": [g.tier for g in opt.store.groups], "host": dict(opt.host.parts),
                "device": dict(engine.memory_summary()["device"])}

    def begin(engine):
        if started is not None:
            started(engine)
        seen["start"] = [g.tier for g in engine.optimizer.store.groups]
        seen["lent_at_start"] = [g.fmt.high_elsewhere for g in engine.optimizer.store.groups]

    def after(i, engine):
        if i == 0 and spare is not None:
            seen["before"] = split(engine)
            seen["moved"] = engine.refit.apply(spare)
            seen["after"] = split(engine)

    def finished(engine):
        store = engine.optimizer.store
        return {"end": [g.tier for g in store.groups], "lent_at_end": [g.fmt.high_elsewhere for g in store.groups],
                "device_state_bytes": sum(g.nbytes for g in store.groups if g.tier is Tier.DEVICE),
                "device_elements": sum(g.numel for g in store.groups if g.tier is Tier.DEVICE),
                "end_by_unit": [store.place(u)[0].tier for u in sorted(store.units(lambda g: True))], **seen}

    return train_engine(rank, world, "gpt", config, steps, micro, accum, started=begin, after_step=after,
                        finished=finished)


@pytest.mark.parametrize("world,accum,env", [pytest.param(1, 2, EMULATED_GPU, marks=pytest.mark.slow),
                                             (1, 1, EMULATED_GPU)], ids=["gpu-accum", "gpu"])
def test_the_refit_moves_host_state_to_the_device_and_training_goes_on(world, accum, env):
    """Everything the host held for the moved units is given back (state, landing buffers, accumulators, host
    copies of the shards), the device holds their state, and the run trains as plain PyTorch."""
    config = split_config(world, accum)
    results = run_ranks(train_refitted, world, env=env, config=config, steps=3, micro=2, accum=accum,
                        spare=1 << 40)
    for r in results:
        before, after = r["before"], r["after"]
        assert Tier.HOST in before["tiers"] and Tier.DEVICE in before["tiers"]
        assert set(after["tiers"]) == {Tier.DEVICE}
        assert r["moved"] > 0
        for part in ("optimizer state", "gradient landing", "gradient accumulators", "parameter copies"):
            assert after["host"].get(part, 0) == 0, (part, after["host"])
        assert any(before["host"].get(p, 0) for p in ("gradient landing", "parameter copies")) == bool(env)
        assert after["device"]["optimizer state"] > before["device"]["optimizer state"]
    check_parity(results, train_reference("gpt", 3, 2 * accum * world, 2, world=world))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's device tier steps with torch's fused kernel")
def test_a_refit_on_a_cpu_device_is_bitwise_the_run_that_never_moved():
    """On a CPU device both tiers step with the same native kernel, so moving mid-run changes no bit."""
    config = split_config(1, 1)
    moved = run_ranks(train_refitted, 1, config=config, steps=3, micro=2, accum=1, spare=1 << 40)[0]
    stayed = run_ranks(train_refitted, 1, config=config, steps=3, micro=2, accum=1, spare=None)[0]
    assert moved["moved"] > 0
    assert moved["losses"] == stayed["losses"]
    for key, value in stayed["state"].items():
        assert torch.equal(moved["state"][key], value), key


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's device tier steps with torch's fused kernel")
@pytest.mark.parametrize("sub_group_size,spare", [(3000, 1 << 40), (100_000, 16 * 8000)], ids=["all", "split"])
def test_a_refit_takes_a_16_16_masters_lent_high_halves_into_the_device_state(sub_group_size, spare):
    """On the host a 16+16 master's sub-groups hold the low halves and moments, the weights being the high halves
    (see [Note: the weights are the high half] in offload/store/optimizer_state.py); moved by the refit, whole or
    split, the device's state holds all of it, 8 bytes an element with bf16 moments, the high halves copied from
    the weights. On a CPU device both tiers step with the same kernel: bitwise the run that never moved."""
    config = split_config(1, 1)
    config["zero_optimization"]["sub_group_size"] = sub_group_size
    config["bf16"] = {"enabled": True}
    config["offload"]["optimizer_state"] = {"master": "16+16", "moments": "bf16"}
    moved = run_ranks(train_refitted, 1, config=config, steps=3, micro=2, accum=1, spare=spare)[0]
    stayed = run_ranks(train_refitted, 1, config=config, steps=3, micro=2, accum=1, spare=None)[0]
    assert moved["moved"] > 0
    on_host = [lent for lent, tier in zip(moved["lent_at_start"], moved["start"]) if tier is Tier.HOST]
    assert on_host and all(on_host)  # lent at start-up beside a ratio
    assert not any(lent for lent, tier in zip(moved["lent_at_end"], moved["end"]) if tier is Tier.DEVICE)
    assert moved["device_state_bytes"] >= 8 * moved["device_elements"] > stayed["device_state_bytes"]
    if spare < 1 << 40:
        assert Tier.HOST in moved["end"] and any(moved["lent_at_end"])  # the rest of the split group still lent
    assert moved["losses"] == stayed["losses"]
    for key, value in stayed["state"].items():
        assert torch.equal(moved["state"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("section,whole", [({"early_step": "on"}, True), ({"speculative_step": "on"}, False)],
                         ids=["early-all", "speculative-split"])
def test_a_refit_after_an_early_or_speculative_step_trains_as_plain_pytorch(section, whole):
    """An early step still running when the refit comes is waited for; a speculative slot is given back with its
    sub-group, or (``whole`` False: the host's one sub-group split) stays, each unit's state read from the slot
    that holds it."""
    config = split_config(1, 1, **section)
    config["zero_optimization"]["sub_group_size"] = 100_000
    spare = 1 << 40 if whole else 16 * 8000  # a few units
    r = run_ranks(train_refitted, 1, env=EMULATED_GPU, config=config, steps=3, micro=2, accum=1, spare=spare)[0]
    if whole:
        assert set(r["after"]["tiers"]) == {Tier.DEVICE}
        assert r["after"]["host"].get("optimizer state (speculative slot)", 0) == 0
    else:
        assert 0 < r["moved"] and r["end_by_unit"].count(Tier.HOST) > 0
        assert len(r["end"]) == len(r["start"]) + 1
    check_parity([r], train_reference("gpt", 3, 2, 2, world=1))


@pytest.mark.slow
def test_a_refit_moves_units_in_the_order_of_need_within_the_spare_bytes():
    """The units right after the device's, as far as the bytes go: a host sub-group whose first units fit is split
    there, and the run trains on as plain PyTorch."""
    config = split_config(1, 1)
    config["zero_optimization"]["sub_group_size"] = 100_000  # the host's units in one sub-group
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    groups = engine.optimizer.store.groups
    host = next(g for g in groups if g.tier is Tier.HOST)
    assert len(host.members) > 1
    before = [(g.tier, [m.unit for m in g.members]) for g in groups]
    first = host.members[0]
    engine.close()
    cost = 16 * first.numel  # its state and its fp32 accumulator (read where it landed before: none)
    one = run_ranks(train_refitted, 1, config=config, steps=3, micro=2, accum=1, spare=cost)[0]
    short = run_ranks(train_refitted, 1, config=config, steps=2, micro=2, accum=1, spare=cost - 1)[0]
    tiers = [t for t, units in before for _ in units]
    units = [u for _, us in before for u in us]
    expect = [Tier.DEVICE if u == first.unit else t for u, t in zip(units, tiers)]
    assert all(t is Tier.DEVICE for t in tiers[:units.index(first.unit)])  # the next in the order of need
    assert one["moved"] == 1 and one["end_by_unit"] == expect
    assert short["moved"] == 0 and short["end_by_unit"] == tiers
    check_parity([one], train_reference("gpt", 3, 2, 2, world=1))


def test_the_choice_follows_the_order_of_need_and_stops_where_a_unit_does_not_fit():
    groups = plan_sub_groups([(0, 100), (1, 100), (2, 100), (3, 100), (4, 100)], 250, frozenset({0}))
    assert [(g.tier, [m.unit for m in g.members]) for g in groups] == [
        (Tier.DEVICE, [0]), (Tier.HOST, [1, 2]), (Tier.HOST, [3, 4])]

    def chosen(spare, shard=lambda i: 0, accumulated=frozenset()):
        return [(g.members[0].unit, count) for g, count in refit_choice(groups, spare, shard, accumulated)]

    assert chosen(1 << 30) == [(1, 2), (3, 2)]
    assert chosen(16 * 300) == [(1, 2), (3, 1)]  # to the byte: the third unit fits, the fourth does not
    assert chosen(16 * 300 - 1) == [(1, 2)]
    assert chosen(16 * 100 - 1) == []
    assert chosen(12 * 100, accumulated=frozenset({1})) == [(1, 1)]  # its accumulator is on the device already
    assert chosen(1 << 30, shard=lambda i: 0 if i < 3 else None) == [(1, 2)]  # a shard that cannot move ends it
    assert chosen(16 * 300 + 2 * 300, shard=lambda i: 0 if i < 3 else 2 * 100) == [(1, 2), (3, 1)]  # its shard
    assert chosen(16 * 300 + 2 * 100 - 1, shard=lambda i: 0 if i < 3 else 2 * 100) == [(1, 2)]
    groups[2].tier = Tier.NVME
    assert chosen(1 << 30) == [(1, 2)]


def test_when_the_first_step_refits():
    def config(**changes):
        raw = split_config(1, 1, ratio="auto")
        for path, value in changes.items():
            section, key = path.split(".")
            raw.setdefault(section, {})[key] = value
        return Config.load(raw).resolve(world_size=1)

    assert refits(config(), sized=True, delayed=False)
    assert not refits(config(), sized=False, delayed=False)  # a CPU device: nothing to measure against
    assert not refits(config(), sized=True, delayed=True)
    assert not refits(config(**{"offload.auto_refit": False}), sized=True, delayed=False)
    assert not refits(config(**{"offload.budgets": {"device": 1 << 30}}), sized=True, delayed=False)
    fixed = split_config(1, 1, ratio=0.5)
    assert not refits(Config.load(fixed).resolve(world_size=1), sized=True, delayed=False)


def test_the_room_kept_beside_the_peak():
    gib = 1 << 30
    assert spare_after(80 * gib, 80 * gib, 50 * gib) == 26 * gib  # 5% of 80 GiB kept free
    assert spare_after(80 * gib, 70 * gib, 50 * gib) == 16 * gib  # 10 GiB held outside torch's allocator
    assert spare_after(8 * gib, 8 * gib, 5 * gib) == 2 * gib  # at least 1 GiB
    assert spare_after(8 * gib, 8 * gib, 8 * gib - MARGIN_MIN // 2) == 0


def splitting_free(world=1, raw=None):
    """Device memory free at start under which auto keeps about half the optimizer state on a GPU (found by
    bisection over the engine's own plan for ``raw``, by default ``split_config``'s with auto)."""
    def kept(free):
        config = Config.load(raw or split_config(world, 1, ratio="auto")).resolve(world_size=world)
        est = estimate(model_units(make_model("gpt"), config), config, world, device_free=free)
        return est.tiers["device"].get("optimizer state", 0), est.tiers["host"].get("optimizer state", 0)

    lo, hi = 0, 1 << 26
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        on_device, on_host = kept(mid)
        lo, hi = (mid, hi) if on_device < on_host else (lo, mid)
    return hi


class SizedDevice:
    """What a GPU's allocator would report, given to the emulated one (this CPU's device memory has no size):
    ``free`` bytes (at start; then what the test sets), the device's ``total`` and the first step's ``peak``."""

    def __init__(self, free, total, peak):
        self.free, self.total, self.peak = free, total, peak

    def install(self, patch):
        from offload.machine.accelerator import Accelerator, MemoryStats
        patch.setattr(Accelerator, "free_bytes", lambda accel: self.free)
        patch.setattr(Accelerator, "total_bytes", lambda accel: self.total)
        patch.setattr(Accelerator, "memory_stats", lambda accel: MemoryStats(0, self.peak, 0))


def train_on_sized_device(rank, world, config, free, total, tight, tight_by):
    """Train where the device had ``free`` bytes at start and all of its memory after (another process let go of
    the rest), with a first step whose peak leaves room for all the state, except on rank ``tight``, where room
    is left for the first host sub-group exactly: by its peak, or (``tight_by`` "free") by the memory another
    process still holds."""
    device = SizedDevice(free, total, 0)

    def size_the_room(engine):
        device.free = total
        if rank == tight:
            g = next(g for g in engine.optimizer.store.groups if g.tier is Tier.HOST)
            cost = sum((12 if m.unit in engine.optimizer.landing.device_accumulated else 16) * m.numel
                       for m in g.members)
            if tight_by == "peak":
                device.peak = total - MARGIN_MIN - cost
            else:
                device.free = MARGIN_MIN + cost

    with pytest.MonkeyPatch.context() as patch:
        device.install(patch)
        return train_refitted(rank, world, config, 3, 2, 1, spare=None, started=size_the_room)


@pytest.mark.parametrize("world,tight,tight_by", [pytest.param(1, 0, "free", marks=pytest.mark.slow),
                                                  (2, 1, "peak")], ids=["tight-free", "two-ranks-one-tight"])
def test_the_first_step_refits_by_the_peak_of_the_rank_with_least_room(world, tight, tight_by):
    """Start-up saw room for about half the state; the first step's peak leaves room for all of it, or (``tight``)
    on one rank for the first host sub-group only: every rank moves what the rank with least room holds."""
    config = split_config(world, 1, ratio="auto")
    runs = run_ranks(train_on_sized_device, world, env=EMULATED_GPU, config=config, free=splitting_free(world),
                     total=8 << 30, tight=tight, tight_by=tight_by)
    for r in runs:
        start, end = r["start"], r["end"]
        assert Tier.HOST in start and Tier.DEVICE in start
        first = start.index(Tier.HOST)
        expect = ([Tier.DEVICE] * len(start) if tight is None else
                  [Tier.DEVICE if i == first else t for i, t in enumerate(start)])
        assert end == expect
    check_parity(runs, train_reference("gpt", 3, 2 * world, 2, world=world))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_beside_host_parameters_a_units_shard_moves_to_the_device_with_its_state(world):
    """Host-homed shards move with their state (the device keeps them as it keeps the units auto homed there at
    start-up); their pinned host buffers are given back, and training goes on as plain PyTorch."""
    config = split_config(world, 1)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    results = run_ranks(train_refitted, world, env=EMULATED_GPU, config=config, steps=3, micro=2, accum=1,
                        spare=1 << 40)
    for r in results:
        assert r["moved"] > 0 and set(r["end"]) == {Tier.DEVICE}
        assert r["before"]["host"].get("parameter copies", 0) > 0
        assert r["after"]["host"].get("parameter copies", 0) == 0
        assert r["after"]["device"]["shards"] > r["before"]["device"]["shards"]
    check_parity(results, train_reference("gpt", 3, 2 * world, 2, world=world))


@pytest.mark.slow
def test_a_shard_homed_on_nvme_ends_the_move(tmp_path):
    config = split_config(1, 1)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    r = run_ranks(train_refitted, 1, env=EMULATED_GPU, config=config, steps=3, micro=2, accum=1, spare=1 << 40)[0]
    assert r["moved"] == 0 and r["end"] == r["start"] and Tier.HOST in r["end"]
    check_parity([r], train_reference("gpt", 3, 2, 2, world=1))


def resume_across_a_refit(rank, world, config, save_dir):
    """Three steps with a refit after the first and a checkpoint after the second; then a fresh engine (the
    start-up split, not refitted) loads that checkpoint and takes the third step: both third steps' states."""
    tokens = batches(3, 2)
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]

    def step(e, rows):
        e.backward(loss_of(e, "gpt", rows))
        e.step()

    step(engine, tokens[0])
    moved = engine.refit.apply(1 << 40)
    step(engine, tokens[1])
    engine.save_checkpoint(save_dir)
    step(engine, tokens[2])
    refitted = engine.full_state_dict()
    tiers = {g.tier for g in engine.optimizer.store.groups}
    engine.close()
    fresh = offload.initialize(model=make_model("gpt"), config=config)[0]
    fresh.load_checkpoint(save_dir)
    step(fresh, tokens[2])
    out = {"moved": moved, "tiers": tiers, "fresh_tiers": {g.tier for g in fresh.optimizer.store.groups},
           "refitted": refitted, "resumed": fresh.full_state_dict()}
    fresh.close()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU's device tier steps with torch's fused kernel")
def test_a_checkpoint_of_a_refitted_engine_resumes_bitwise_in_the_start_up_split(tmp_path):
    """The checkpoint holds each unit's state wherever it was stepped: a fresh engine with the start-up split
    loads it and takes the next step bitwise as the refitted engine did (both tiers run one kernel on a CPU)."""
    r = run_ranks(resume_across_a_refit, 1, config=split_config(1, 1), save_dir=str(tmp_path / "ckpt"))[0]
    assert r["moved"] > 0 and r["tiers"] == {Tier.DEVICE} and Tier.HOST in r["fresh_tiers"]
    for key, value in r["refitted"].items():
        assert torch.equal(r["resumed"][key], value), key


def estimated(raw, shape, free, params=300_000_000):
    from offload.commands.estimate import synthetic_units
    config = Config.load(raw).resolve(world_size=1)
    return estimate(synthetic_units(params, config), config, 1, shape, device_free=free)


def test_the_estimate_predicts_the_split_the_refit_ends_with():
    """`offload estimate` with the activations' shape: the state auto keeps on the device after the first step
    fills the device's memory less the activations and the margin, said beside the start-up split."""
    from offload.commands.estimate import ActivationShape
    from offload.engine.refit import margin
    shape = ActivationShape(layers=12, hidden=1024, heads=16, seq=128, micro=1, vocab=32000)
    raw = split_config(1, 1, ratio="auto")
    raw["offload"]["unit_bytes"] = 64 << 20
    raw["zero_optimization"]["sub_group_size"] = 10**9
    free = 6 << 30  # 300M parameters' state and accumulators (4.8 GB) do not fit in its start-up half
    est = estimated(raw, shape, free)
    start_up = estimated(raw | {"offload": {**raw["offload"], "auto_refit": False}}, shape, free)
    assert 0 < start_up.tiers["device"]["optimizer state"] < est.tiers["device"]["optimizer state"]
    assert 0 < est.tiers["host"]["optimizer state"] < start_up.tiers["host"]["optimizer state"]
    assert any("offload.auto_refit keeps it there" in n for n in est.notes)
    assert not any("auto_refit" in n for n in start_up.notes)
    assert est.total("device") <= free - margin(free)  # the refit's room held, activations included
    crowded = estimated(raw, ActivationShape(layers=12, hidden=1024, heads=16, seq=2048, micro=16, vocab=32000),
                        free)
    assert any(n.startswith("over the device's memory") for n in crowded.notes)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_a_refit_at_stages_1_and_2_trains_as_plain_pytorch(stage, env=EMULATED_GPU):
    """The parameters stay whole on the device there (every shard homed on it): only the state moves."""
    config = split_config(2, 2)
    config["zero_optimization"]["stage"] = stage
    results = run_ranks(train_refitted, 2, env=env, config=config, steps=3, micro=2, accum=2, spare=1 << 40)
    for r in results:
        assert r["moved"] > 0 and set(r["end"]) == {Tier.DEVICE}
    check_parity(results, train_reference("gpt", 3, 8, 2, world=2))


class FailingEmpty:
    """torch as offload/optim/sharded.py sees it, with its ``fail_at``-th ``empty`` out of device memory (the
    fault this test injects)."""

    def __init__(self, fail_at):
        self.calls, self.fail_at = 0, fail_at

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return torch.empty(*args, **kwargs)


def train_out_of_memory_part_way(rank, world, config, fail_at):
    from offload.optim import sharded
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sharded, "torch", FailingEmpty(fail_at))
        out = train_refitted(rank, world, config, 3, 2, 1, spare=1 << 40)
    return out


@pytest.mark.parametrize("fail_at,some_moved", [(3, False), (4, True)])
def test_the_device_running_out_of_memory_part_way_leaves_each_part_whole(fail_at, some_moved):
    """Each part's device memory is taken before anything of it changes: a part whose allocation fails stays on
    the host whole (its state, landing buffer and host shard), what moved before it steps on the device, and
    training goes on as plain PyTorch. The first host sub-groups hold one unit each: three allocations (state,
    accumulator, shard), so the fourth is the second part's first."""
    config = split_config(1, 1)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    r = run_ranks(train_out_of_memory_part_way, 1, env=EMULATED_GPU, config=config, fail_at=fail_at)[0]
    start, end = r["start"], r["end"]
    moved_parts = start.count(Tier.HOST) - end.count(Tier.HOST)
    assert Tier.HOST in end and (moved_parts > 0) == some_moved
    assert r["after"]["host"]["optimizer state"] > 0 and r["after"]["host"]["parameter copies"] > 0
    check_parity([r], train_reference("gpt", 3, 2, 2, world=1))
