"""#44: `offload_optimizer.ratio: auto` by rates (see [Note: auto by rates] in offload/store/placement.py and
[Note: the step as lanes] in offload/store/step_cost.py): the split chosen for the fastest step at the machine's
rates, within the device's room to the byte and in the order of need, and the step it predicts; the rates
measured at start-up (offload/engine/rates.py), agreed by the ranks, given on this CPU to an emulated GPU."""

import logging

import pytest
from engine_cases import STREAM_CHECK, check_parity, make_model, train_engine, train_reference
from test_partial_offload import ratio_config

from offload.commands.estimate import model_units
from offload.config import Config
from offload.machine.accelerator import Accelerator
from offload.machine.launch import run_ranks
from offload.store.placement import MachineOffer, Shards, StageLayout, plan, traffic
from offload.store.step_cost import Rates, StepPrediction, Traffic, best, predict, sort_key
from offload.store.tier import Tier
from offload.zero.collectives import Group

# A host whose Adam is slow beside its bus (as every GPU machine the issue measured), and one whose bus is slow.
HOST_BOUND = Rates(device_gbps=2000.0, host_gbps=10.0, h2d_gbps=50.0, d2h_gbps=50.0)
BUS_BOUND = Rates(device_gbps=2000.0, host_gbps=1000.0, h2d_gbps=0.5, d2h_gbps=50.0)
# The GPU's paths on this CPU, with rates given (a GPU machine's own would be measured: hidden from these runs).
EMULATED_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}


def env_rates(rates):
    return ",".join(f"{k}={getattr(rates, k)}" for k in ("device_gbps", "host_gbps", "h2d_gbps", "d2h_gbps"))


# ----------------------------------------------------------------------------- the model of a step


def test_a_step_is_its_longest_lane_overlapped_and_the_sum_of_its_terms_one_after_another():
    rates = Rates(compute_ms=100.0, device_gbps=3000.0, host_gbps=150.0, nvme_gbps=5.0, h2d_gbps=50.0,
                  d2h_gbps=40.0)
    t = Traffic({Tier.DEVICE: 10**9, Tier.HOST: 2 * 10**9, Tier.NVME: 10**8}, gathered_up=10**9, copied_up=10**8,
                item=2)
    p = predict(t, rates)
    assert p.terms["device Adam"] == pytest.approx(1e9 * 30 / 3000e9 * 1e3)
    # host memory for the host's sub-groups; for NVMe's the disk's time, the longer of its two
    assert p.terms["host Adam"] == pytest.approx(2e9 * 30 / 150e9 * 1e3 + max(1e8 * 30 / 150e9, 1e8 * 24 / 5e9) * 1e3)
    assert p.terms["parameters up"] == pytest.approx(2 * (2 * 1e9 + 1e8) / 50e9 * 1e3)
    assert p.terms["gradients down"] == pytest.approx(2 * 2.1e9 / 40e9 * 1e3)
    # the GPU runs compute and the device Adam one after the other: one lane
    assert p.lanes["GPU (compute + device Adam)"] == pytest.approx(100.0 + p.terms["device Adam"])
    assert p.overlapped_ms == pytest.approx(max(p.lanes.values()))
    assert p.serial_ms == pytest.approx(sum(p.terms.values()))
    assert "the host Adam" in p.note("")


def test_each_micro_batch_gathers_and_sends_its_gradients_down_unless_they_add_up_on_the_device():
    rates = Rates(compute_ms=1.0, device_gbps=1000.0, host_gbps=100.0, h2d_gbps=10.0, d2h_gbps=10.0)
    def terms(micro, on_device):
        t = Traffic({Tier.HOST: 10**9}, gathered_up=10**9, copied_up=0, item=2, micro_batches=micro,
                    grads_accumulated_on_device=on_device)
        return predict(t, rates).terms
    assert terms(4, False)["parameters up"] == pytest.approx(4 * terms(1, False)["parameters up"])
    assert terms(4, False)["gradients down"] == pytest.approx(4 * terms(1, False)["gradients down"])
    assert terms(4, True)["gradients down"] == pytest.approx(2 * terms(1, True)["gradients down"])  # fp32, once
    assert terms(4, True)["parameters up"] == terms(4, False)["parameters up"]


def test_a_term_without_its_rate_is_unknown_and_so_is_the_step():
    p = predict(Traffic({Tier.NVME: 10}, gathered_up=0, copied_up=0, item=2), Rates(compute_ms=1.0, host_gbps=1.0))
    assert p.terms["host Adam"] is None and p.overlapped_ms is None and p.serial_ms is None
    assert "?" in p.note("")


def test_splits_within_a_percent_of_the_shortest_longest_lane_are_told_apart_by_their_sum():
    def prediction(**terms):
        return StepPrediction({"compute": 0.0, "device Adam": 0.0} | terms)
    fast_but_busy = prediction(a=100.0, b=100.0, c=100.0)  # longest 100, sum 300
    nearly_as_fast = prediction(a=100.5, b=1.0)  # longest 100.5 (within 1%), sum 101.5
    slower = prediction(a=102.0)  # beyond 1%: its sum does not count
    assert best([(fast_but_busy, 0), (nearly_as_fast, 1), (slower, 2)]) == 1
    assert best([(fast_but_busy, 0), (slower, 2)]) == 0
    assert sort_key(nearly_as_fast) == (100.5, 101.5)


# ----------------------------------------------------------------------------- the plan's choice


def auto_config(params, budget, world=1, optimizer="cpu", tmp=None, stream=0):
    """ratio auto's config; ``stream``: offload.stream_state (0: the two lanes these tests weigh; the third's are
    in test_three_lanes.py)."""
    raw = ratio_config(world, 1, "auto", budget, stream_state=stream)
    raw["bf16"] = {"enabled": True}
    raw["zero_optimization"]["offload_param"] = {"device": params}
    if optimizer == "nvme":
        raw["zero_optimization"]["offload_optimizer"].update(device="nvme", nvme_path=str(tmp))
    return Config.load(raw).resolve(world_size=world)


def planned(params, budget, rates, world=1, **kwargs):
    config = auto_config(params, budget, world, **kwargs)
    units = model_units(make_model("gpt"), config)
    sizes = [(i, -(-n // world)) for i, n in enumerate(units)]
    out = plan(Shards(sizes, {i for i, _ in sizes}, 2), config, StageLayout(parts=world),
               MachineOffer(rates=rates))
    out.check()
    return out, sizes


def device_bytes(out):
    return sum(out.device.values())


def step_at(out, sizes, rates):
    return predict(traffic(out, sizes, 2, auto_config("cpu", None)), rates)


def check_order_of_need(out, sizes):
    """State kept for a prefix of the units, shards homed on the device for a prefix too (the next forward's
    first units first)."""
    order = [i for i, _ in sizes]
    kept = sorted(out.state_on_device)
    assert kept == order[:len(kept)]
    homed = [i for i in order if out.homes[i] is Tier.DEVICE]
    assert homed == order[:len(homed)] and set(kept) <= set(homed)


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_where_the_host_adam_is_the_slow_lane_auto_keeps_as_much_state_as_the_room_holds(params):
    budget = 600_000
    by_rates, sizes = planned(params, budget, HOST_BOUND)
    state_first, _ = planned(params, budget, None)
    assert 0 < len(by_rates.state_on_device) < len(sizes)  # the room binds
    assert by_rates.state_on_device == state_first.state_on_device
    assert device_bytes(by_rates) <= budget
    check_order_of_need(by_rates, sizes)


def test_where_the_bus_is_the_slow_lane_auto_spends_the_room_on_shards_rather_than_state():
    """Beside host parameters a shard's crossing costs more than its Adam on the host: auto keeps less state on
    the device than fits, and homes more shards there, for a step the rates say is shorter; the state-first split
    is one it weighed."""
    budget = 600_000
    by_rates, sizes = planned("cpu", budget, BUS_BOUND)
    state_first, _ = planned("cpu", budget, None)
    assert len(by_rates.state_on_device) < len(state_first.state_on_device)
    homed = sum(1 for i, _ in sizes if by_rates.homes[i] is Tier.DEVICE)
    assert homed > sum(1 for i, _ in sizes if state_first.homes[i] is Tier.DEVICE)
    chosen, weighed = step_at(by_rates, sizes, BUS_BOUND), step_at(state_first, sizes, BUS_BOUND)
    assert chosen.overlapped_ms is None  # the compute is unknown at start-up: offload's own lanes decide
    assert sort_key(chosen)[0] < sort_key(weighed)[0]
    assert device_bytes(by_rates) <= budget
    check_order_of_need(by_rates, sizes)


@pytest.mark.parametrize("rates", [HOST_BOUND, BUS_BOUND, Rates(compute_ms=0.05, device_gbps=2000.0,
                                                                   host_gbps=100.0, h2d_gbps=5.0, d2h_gbps=5.0)])
def test_no_prefix_of_the_order_of_need_makes_a_faster_step_than_the_one_auto_chose(rates):
    """Every split auto could choose (the state of the first k units, the leftover room homing shards), planned
    under a ratio that keeps exactly those k, priced at the same rates: none is faster than auto's. (auto's room
    keeps two gathers' worth free where a fixed ratio only needs one: the k it could choose are those state first
    reaches.)"""
    budget = 600_000
    chosen, sizes = planned("cpu", budget, rates)
    most = len(planned("cpu", budget, None)[0].state_on_device)
    best_key = sort_key(step_at(chosen, sizes, rates))
    fits = 0
    for k in range(most + 1):
        raw = ratio_config(1, 1, 1 - sum(n for _, n in sizes[:k]) / sum(n for _, n in sizes), budget,
                           stream_state=0)
        raw["bf16"] = {"enabled": True}
        raw["zero_optimization"]["offload_param"] = {"device": "cpu"}
        out = plan(Shards(sizes, {i for i, _ in sizes}, 2), Config.load(raw).resolve(world_size=1),
                   machine=MachineOffer(rates=rates))
        if out.problems or len(out.state_on_device) != k:
            continue
        fits += 1
        key = sort_key(step_at(out, sizes, rates))
        # a fixed ratio homes no more shards than its state's; auto's room may home more: never slower
        assert best_key[0] <= key[0] * 1.01
    assert fits > 2


def test_with_the_state_on_nvme_auto_keeps_the_state_first_whatever_the_rates(tmp_path):
    """Start-up measures no disk: an NVMe optimizer's split is state first, rates or not."""
    by_rates, _ = planned("cpu", 600_000, BUS_BOUND, optimizer="nvme", tmp=tmp_path)
    state_first, _ = planned("cpu", 600_000, None, optimizer="nvme", tmp=tmp_path)
    assert by_rates.state_on_device == state_first.state_on_device and by_rates.homes == state_first.homes
    assert 0 < len(by_rates.state_on_device)


def test_the_room_holds_to_the_byte_under_any_rates():
    for budget in (300_000, 700_000, 1_500_000):
        for rates in (HOST_BOUND, BUS_BOUND):
            out, _ = planned("cpu", budget, rates)
            assert device_bytes(out) <= budget


# ----------------------------------------------------------------------------- measured at start-up


def test_the_measurement_runs_here_and_gives_rates_a_machine_can_have():
    """The GPU's path of the measurement (offload/engine/rates.py), run on this CPU as its own device: each rate
    positive and under 10 TB/s."""
    import torch

    from offload.engine.rates import _measured
    rates = _measured(torch.device("cpu"), 1)
    for name in ("device_gbps", "host_gbps", "h2d_gbps", "d2h_gbps"):
        assert 0 < getattr(rates, name) < 10_000, name


def test_a_cpu_device_measures_nothing_and_an_emulated_gpu_takes_the_rates_it_is_given(monkeypatch, caplog):
    from offload.engine.rates import measure
    group = Group(0, 1, None)
    assert measure(Accelerator("cpu"), None, group) is None
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    assert measure(Accelerator("cpu"), None, group) is None
    monkeypatch.setenv("OFFLOAD_EMULATED_RATES", env_rates(BUS_BOUND))
    assert measure(Accelerator("cpu"), None, group) == BUS_BOUND
    monkeypatch.setenv("OFFLOAD_EMULATED_RATES", "host_gbps=10,h2d=5")
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        assert measure(Accelerator("cpu"), None, group) is None
    assert "failed (OFFLOAD_EMULATED_RATES names h2d; it gives each of device_gbps" in caplog.text
    monkeypatch.setenv("OFFLOAD_EMULATED_RATES", "host_gbps=fast")
    with pytest.raises(ValueError, match="'host_gbps=fast' is not name=GB/s"):
        Accelerator("cpu")


def _agreed(rank, world, rates):
    import os

    from offload.engine.rates import measure
    os.environ["OFFLOAD_EMULATED_RATES"] = rates[rank]
    return measure(Accelerator("cpu"), None, Group.current())


def _train_logged(rank, world, **kwargs):
    """train_engine, with what the engine logged at INFO (it runs in a process of its own)."""
    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())
    kept = Kept()
    engine_log = logging.getLogger("offload.engine")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(kept)
    return train_engine(rank, world, **kwargs) | {"log": kept.lines}


def test_the_ranks_plan_with_the_slowest_ranks_rates():
    fast = env_rates(HOST_BOUND)
    slow = "device_gbps=1000,host_gbps=20,h2d_gbps=10,d2h_gbps=60"
    results = run_ranks(_agreed, 2, env=EMULATED_GPU, rates=[fast, slow])
    expected = Rates(device_gbps=1000.0, host_gbps=10.0, h2d_gbps=10.0, d2h_gbps=50.0)
    assert results == [expected, expected]


def _failing(rank, world, rates):
    import os

    from offload.engine.rates import measure
    os.environ["OFFLOAD_EMULATED_RATES"] = rates[rank]
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("offload.engine").addHandler(handler)
    return measure(Accelerator("cpu"), None, Group.current()), warned


def test_a_rank_whose_measuring_fails_says_why_and_every_rank_plans_state_first():
    """Neither rank is left waiting in the agreement: the one that failed sends nothing, both get no rates."""
    results = run_ranks(_failing, 2, env=EMULATED_GPU, rates=[env_rates(HOST_BOUND), "host_gbps=10"])
    assert [r for r, _ in results] == [None, None]
    assert results[0][1] == []
    assert any("measuring this machine's rates failed (OFFLOAD_EMULATED_RATES names too few rates" in m
               for m in results[1][1])


def test_initialize_chooses_by_the_rates_logs_them_and_trains_as_plain_pytorch():
    """On the emulated GPU, given a slow bus: the engine's split is the plan's at those rates (less state than the
    room holds, more shards), logged in one line with offload's terms of a step, and training equals PyTorch's."""
    budget = 600_000
    raw = ratio_config(1, 1, "auto", budget)
    raw["zero_optimization"]["offload_param"] = {"device": "cpu"}
    raw["gradient_clipping"] = 1.0
    results = run_ranks(_train_logged, 1, env=EMULATED_GPU | {"OFFLOAD_EMULATED_RATES": env_rates(BUS_BOUND)},
                        name="gpt", config=raw, steps=3, micro=2, accum=1)
    memory = results[0]["memory"]
    config = Config.load(raw).resolve(world_size=1)
    units = model_units(make_model("gpt"), config)
    sizes = list(enumerate(units))
    by_rates = plan(Shards(sizes, {i for i, _ in sizes}, 4), config, machine=MachineOffer(rates=BUS_BOUND))
    state_first = plan(Shards(sizes, {i for i, _ in sizes}, 4), config)
    assert memory["device"]["optimizer state"] == by_rates.device["optimizer state"]
    assert memory["device"]["shards"] == by_rates.device["shards"] > state_first.device["shards"]
    assert by_rates.device["optimizer state"] < state_first.device["optimizer state"]
    line = next(m for m in results[0]["log"] if "at this machine's rates" in m)
    assert "host to device 0.5 GB/s" in line and "parameters up" in line and "host Adam" in line
    check_parity(results, train_reference("gpt", 3, 2, 2, world=1))
