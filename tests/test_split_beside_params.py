"""offload_optimizer.ratio beside offloaded parameters (see [Note: a split beside offloaded parameters] in
offload/store/placement.py): the units whose optimizer state stays on the device are homed there too and
stepped there, the rest keep the home offload_param gives them (host or NVMe), and the training equals plain
PyTorch's. On this CPU the device tier is host memory with a budget of its own; the emulated discrete device
takes the GPU's paths (landing buffers, copies, units read where they live)."""

import logging

import pytest
from engine_cases import STREAM_CHECK, check_bitwise, check_parity, make_any, make_model, train_engine, train_reference
from test_partial_offload import device_state, ratio_config

import offload
from offload.commands.estimate import model_units
from offload.config import Config, ConfigError
from offload.machine.buffers import round_up
from offload.machine.launch import run_ranks
from offload.store.placement import MachineOffer, Shards, plan
from offload.store.tier import Tier

EMULATED_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}


def half_budget(world, params):
    """A device budget under which auto keeps about half the optimizer state on the device beside offloaded
    parameters (by bisection over the engine's own plan, as splitting_budget does beside device parameters)."""
    def kept(budget):
        raw = ratio_config(world, 1, "auto", budget)
        raw["zero_optimization"]["offload_param"] = {"device": "cpu"}
        return device_state(raw, world)[0]
    lo, hi = 0, 1 << 26
    full = kept(hi)
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kept(mid) < full // 2 else (lo, mid)
    return hi


def split_config(tmp_path, world, accum, ratio, params, clip=1.0, **offload_section):
    budget = half_budget(world, params) if ratio == "auto" else None
    config = ratio_config(world, accum, ratio, budget, **offload_section)
    config["gradient_clipping"] = clip
    config["zero_optimization"]["offload_param"] = (
        {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0} if params == "nvme" else {"device": "cpu"})
    return config, budget


def check_split(memory, budget, params):
    """Both tiers step part of the state, the device holds the shards of its units, the rest live where
    offload_param says, and a device budget held what stays there."""
    device, host = memory["device"], memory["host"]
    assert device["optimizer state"] > 0 and host["optimizer state"] > 0
    assert device["shards"] > 0 and device["gradient accumulators"] > 0
    if params == "nvme":
        assert memory["nvme"]["total"] > 0
    if budget is not None:
        assert sum(v for k, v in device.items() if k != "budget" and not k.startswith("gathered")) <= budget


@pytest.mark.parametrize("params", ["cpu", "nvme"])
@pytest.mark.parametrize("ratio", [0.5, "auto"])
@pytest.mark.parametrize("world,accum", [(1, 1), (2, 2)])
def test_a_split_beside_offloaded_parameters_trains_as_plain_pytorch(tmp_path, world, accum, ratio, params):
    config, budget = split_config(tmp_path, world, accum, ratio, params)
    results = run_ranks(train_engine, world, name="gpt", config=config, steps=3, micro=2, accum=accum)
    check_split(results[0]["memory"], budget, params)
    # what offload estimate plans is what initialize did
    assert results[0]["memory"]["device"]["optimizer state"] == device_state(config, world)[0]
    check_parity(results, train_reference("gpt", 3, 2 * accum * world, 2, world=world))


@pytest.mark.parametrize("accum", [1, 2])
def test_a_split_beside_host_parameters_on_an_emulated_gpu_trains_as_plain_pytorch(tmp_path, accum):
    """The GPU's paths: the device units are read where they live (never gathered) and their gradients never
    leave the device; the host units' are gathered from the host and their gradients land there."""
    config, budget = split_config(tmp_path, 1, accum, 0.5, "cpu", early_step="on")
    results = run_ranks(train_engine, 1, env=EMULATED_GPU, name="gpt", config=config, steps=3, micro=2, accum=accum)
    memory = results[0]["memory"]
    check_split(memory, budget, "cpu")
    assert "gradient landing" in memory["host"]
    whole = run_ranks(train_engine, 1, env=EMULATED_GPU, name="gpt", config=split_config(
        tmp_path, 1, accum, 1.0, "cpu", early_step="on")[0], steps=3, micro=2, accum=accum)
    assert 0 < results[0]["gathers"] < whole[0]["gathers"]  # the device's units are no longer gathered
    check_parity(results, train_reference("gpt", 3, 2 * accum, 2, world=1))


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_a_split_without_clipping_overlaps_the_host_step_with_backward_and_trains_as_plain_pytorch(tmp_path, params):
    config, _ = split_config(tmp_path, 1, 1, 0.5, params, clip=0.0)
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=3, micro=2, accum=1)
    assert results[0]["overlapped"] > 0
    check_parity(results, train_reference("gpt", 3, 2, 2, clip=0.0, world=1))


def test_a_bf16_split_beside_host_parameters_is_bitwise_the_whole_offload(tmp_path):
    """In bf16 the device tier of a CPU device runs the host's native kernels on the same values, so moving units'
    state (and homes) to the device changes no bit."""
    runs = []
    for ratio in (0.5, 1.0):
        config, _ = split_config(tmp_path, 1, 2, ratio, "cpu")
        config["bf16"] = {"enabled": True}
        runs.append(run_ranks(train_engine, 1, name="gpt", config=config, steps=3, micro=2, accum=2))
    assert runs[0][0]["memory"]["device"]["optimizer state"] > 0
    check_bitwise(runs[0], runs[1])


@pytest.mark.parametrize("params", ["cpu", "nvme"])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, "auto"])
def test_the_plan_homes_the_device_units_there_in_the_order_of_need_and_holds_the_budget(tmp_path, ratio, params):
    """The units kept on the device are a prefix of the forward order (the next forward needs them first), their
    shards are homed on the device and on no other tier, and with auto what stays on the device fits its budget to
    the byte: one unit more would not."""
    raw, _ = split_config(tmp_path, 1, 1, ratio, params)
    budget = 600_000 if ratio == "auto" else 2_000_000
    raw["offload"]["budgets"] = {"device": budget}
    config = Config.load(raw).resolve(world_size=1)
    sizes = list(enumerate(model_units(make_model("gpt"), config)))
    out = plan(Shards(sizes, {i for i, _ in sizes}, 4), config, machine=MachineOffer(discrete=True))
    kept = sorted(out.state_on_device)
    assert kept == [i for i, _ in sizes][:len(kept)] and 0 < len(kept) < len(sizes)
    homed = sorted(i for i, h in out.homes.items() if h is Tier.DEVICE)
    # auto homes the next units' shards in the room its state left (parameters likewise); a fixed ratio does not
    assert homed == [i for i, _ in sizes][:len(homed)] and (len(homed) > len(kept) if ratio == "auto"
                                                           else homed == kept)
    assert not set(homed) & {i for i, _ in out.nvme_params}
    if params == "nvme":
        assert {i for i, _ in out.nvme_params} == {i for i, _ in sizes} - set(homed)
    assert out.aliased == set(homed)
    assert out.device["shards"] == 4 * sum(n for i, n in sizes if i in homed)
    out.check()
    if ratio == "auto":
        # the gathers' reserve as the plan met it (every unit gathered then): two units and a prefetch bucket
        bucket = min(int(config.zero_optimization.stage3_prefetch_bucket_size), sum(n for _, n in sizes))
        room = budget - 4 * (2 * max(n for _, n in sizes) + bucket)
        cost = [round_up(12 * n) + 4 * n + 4 * n for _, n in sizes]  # state (a page-rounded sub-group at worst),
        assert sum(cost[:len(kept)]) <= room < sum(cost[:len(kept) + 1])  # accumulator, shard: one more won't fit
        assert sum(v for k, v in out.device.items()) <= room
        shards = sum(cost[:len(kept)]) + 4 * sum(n for i, n in sizes[len(kept):len(homed)])
        assert shards <= room < shards + 4 * sizes[len(homed)][1]  # nor would one more unit's shard


def test_a_fixed_ratio_that_overfills_the_device_budget_says_to_raise_it_or_use_auto(tmp_path):
    raw, _ = split_config(tmp_path, 1, 1, 0.25, "cpu")
    raw["offload"]["budgets"] = {"device": 600_000}
    config = Config.load(raw).resolve(world_size=1)
    sizes = list(enumerate(model_units(make_model("gpt"), config)))
    with pytest.raises(ConfigError, match=r"offload.budgets.device: 600,000 bytes cannot hold .*shards and the "
                                          r"optimizer state offload_optimizer.ratio keeps there.*raise "
                                          r"offload_optimizer.ratio \(or set it to auto, which fills the budget\)"):
        plan(Shards(sizes, {i for i, _ in sizes}, 4), config, machine=MachineOffer(discrete=True)).check()


def test_start_up_logs_the_split_in_one_line(tmp_path, caplog):
    config, _ = split_config(tmp_path, 1, 1, 0.5, "cpu")
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    kept = {i for i, s in engine.optimizer.shards.items() if not engine.optimizer.steps_on_host(i)}
    sizes = {i: s.numel for i, s in engine.optimizer.shards.items()}
    engine.close()
    device, host = sum(sizes[i] for i in kept), sum(n for i, n in sizes.items() if i not in kept)
    line = next(r.getMessage() for r in caplog.records if "parameter elements" in r.getMessage())
    assert (f"keeps the optimizer state of {len(kept)} of {len(sizes)} units on the device; parameter elements: "
            f"device {device:,}, host {host:,}; optimizer state elements: device {device:,}, host {host:,}") in line


def _frozen_plan(tmp_path, budget, params="cpu"):
    raw, _ = split_config(tmp_path, 1, 1, "auto", params)
    raw["offload"]["budgets"] = {"device": budget}
    config = Config.load(raw).resolve(world_size=1)
    model = make_any("frozen-base")
    from offload.zero.plan import plan_units
    units = plan_units(model, config.offload.unit_bytes, 4, fold_below=0)
    sizes = [(u.index, u.numel) for u in units]
    trained = {u.index for u in units if any(s.param.requires_grad for s in u.slots)}
    return sizes, trained, plan(Shards(sizes, trained, 4), config, machine=MachineOffer(discrete=True))


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_auto_homes_more_units_on_the_device_with_room_to_spare_frozen_ones_included(tmp_path, params):
    """Parameters likewise: once auto has kept every unit's state it can on the device, what room is left homes
    the next units' shards there too, in the forward's order (a LoRA-style frozen base among them), as far as it
    goes: a prefix of the units; the budget holds."""
    sizes, trained, roomy = _frozen_plan(tmp_path, 10_000_000, params)
    assert trained < {i for i, _ in sizes}  # some units train nothing
    assert all(h is Tier.DEVICE for h in roomy.homes.values()) and not roomy.nvme_params
    assert roomy.state_on_device == trained
    bounded = None
    for budget in range(200_000, 1_000_000, 20_000):  # a budget that holds the state and part of the base
        _, _, out = _frozen_plan(tmp_path, budget, params)
        homed = [i for i, _ in sizes if out.homes[i] is Tier.DEVICE]
        if out.state_on_device == trained and len(homed) < len(sizes):
            bounded = (budget, out, homed)
            break
    assert bounded is not None
    budget, out, homed = bounded
    frozen_homed = set(homed) - trained
    assert frozen_homed and homed == [i for i, _ in sizes][:len(homed)] or set(homed) == trained | frozen_homed
    assert out.device["shards"] == 4 * sum(n for i, n in sizes if i in homed)
    assert sum(out.device.values()) <= budget
    out.check()


@pytest.mark.parametrize("world", [1, 2])
def test_a_frozen_base_homed_on_the_device_trains_as_plain_pytorch(tmp_path, world):
    config, _ = split_config(tmp_path, world, 1, "auto", "cpu")
    config["offload"]["budgets"] = {"device": 10_000_000}
    results = run_ranks(train_engine, world, env=EMULATED_GPU if world == 1 else None, name="frozen-base",
                        config=config, steps=3, micro=2, accum=1)
    memory = results[0]["memory"]
    assert memory["device"]["shards"] > 0 and "optimizer state" not in memory["host"]
    if world == 1:  # every unit, frozen ones too, homed on the (emulated) GPU and read there: nothing gathered
        assert memory["device"]["gathered_peak"] == 0
    check_parity(results, train_reference("frozen-base", 3, 2 * world, 2, world=world))
