"""offload_optimizer.ratio beside offloaded parameters (see [Note: a split beside offloaded parameters] in
offload/store/placement.py): the units whose optimizer state stays on the device are homed there too and
stepped there, the rest keep the home offload_param gives them (host or NVMe), and the training equals plain
PyTorch's. On this CPU the device tier is host memory with a budget of its own; the emulated discrete device
takes the GPU's paths (landing buffers, copies, units read where they live)."""

import logging

import pytest

import offload

from engine_cases import check_bitwise, check_parity, make_model, train_engine, train_reference
from offload.config import Config, ConfigError
from offload.commands.estimate import model_units
from offload.machine.buffers import round_up
from offload.machine.launch import run_ranks
from offload.store.placement import plan
from offload.store.tier import Tier
from test_partial_offload import device_state, ratio_config, splitting_budget

EMULATED_GPU = {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}


def split_config(tmp_path, world, accum, ratio, params, clip=1.0, **offload_section):
    budget = splitting_budget(world) if ratio == "auto" else None
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
    out = plan(sizes, {i for i, _ in sizes}, config, 4, discrete=True)
    kept = sorted(out.state_on_device)
    assert kept == [i for i, _ in sizes][:len(kept)] and 0 < len(kept) < len(sizes)
    assert {i for i, h in out.homes.items() if h is Tier.DEVICE} == set(kept)
    assert not set(kept) & {i for i, _ in out.nvme_params}
    if params == "nvme":
        assert {i for i, _ in out.nvme_params} == {i for i, _ in sizes} - set(kept)
    assert out.aliased == set(kept)
    assert out.device["shards"] == 4 * sum(n for i, n in sizes if i in kept)
    out.check()
    if ratio == "auto":
        # the gathers' reserve as the plan met it (every unit gathered then): two units and a prefetch bucket
        bucket = min(int(config.zero_optimization.stage3_prefetch_bucket_size), sum(n for _, n in sizes))
        room = budget - 4 * (2 * max(n for _, n in sizes) + bucket)
        cost = [round_up(12 * n) + 4 * n + 4 * n for _, n in sizes]  # state (a page-rounded sub-group at worst),
        assert sum(cost[:len(kept)]) <= room < sum(cost[:len(kept) + 1])  # accumulator, shard: one more won't fit
        assert sum(v for k, v in out.device.items()) <= room


def test_a_fixed_ratio_that_overfills_the_device_budget_says_to_raise_it_or_use_auto(tmp_path):
    raw, _ = split_config(tmp_path, 1, 1, 0.25, "cpu")
    raw["offload"]["budgets"] = {"device": 600_000}
    config = Config.load(raw).resolve(world_size=1)
    sizes = list(enumerate(model_units(make_model("gpt"), config)))
    with pytest.raises(ConfigError, match=r"offload.budgets.device: 600,000 bytes cannot hold .*shards and the "
                                          r"optimizer state offload_optimizer.ratio keeps there.*raise "
                                          r"offload_optimizer.ratio \(or set it to auto, which fills the budget\)"):
        plan(sizes, {i for i, _ in sizes}, config, 4, discrete=True).check()


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
