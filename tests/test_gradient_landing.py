"""Gradients land without blocking backward, and change no result (see [Note: gradients land]).

A separate device (emulated: ``OFFLOAD_EMULATED_DISCRETE_DEVICE``) copies each reduced gradient into the unit's
landing buffer on the D2H stream; a CPU device lets the landing worker read it where it lies. Same arithmetic on
the same values: the two train bitwise alike, with the copies lagging and gradients accumulated or not.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_cases import base_config, batches, describe_engine, loss_of, make_model, train_engine

from offload.machine import native
from offload.machine.launch import run_ranks
from offload.optim.landing import ReducedShard
from offload.optim.shard_state import ShardPhase
from offload.optim.sharded import LastBackward
from offload.store.placement import HELD_GRADS
from offload.store.tier import Tier

LAG = {"OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}  # implies a discrete device: every copy a GPU makes


@pytest.mark.parametrize("world,accum,bf16,early", [(1, 1, False, "off"), (2, 4, False, "off"), (3, 1, False, "off"),
                                                    (3, 1, True, "off"), (2, 1, True, "on"), (3, 2, True, "off"),
                                                    (2, 3, True, "on")],
                         ids=["W1", "W2-accum4", "W3", "W3-bf16", "W2-bf16-early", "W3-bf16-accum2",
                              "W2-bf16-accum3-early"])
def test_landed_gradients_train_bitwise_as_gradients_read_in_place(world, accum, bf16, early):
    """With one micro-batch the landed gradient is read where it landed, times 1/W (W = 3: a factor that rounds),
    by the norm and Adam (see [Note: gradients read where they land]); with several, the (emulated) device adds
    them up and sends the fp32 sum once (see [Note: gradients accumulated on the device]), where the CPU device
    adds them up on the host."""
    config = base_config(2, accum, world, offload_param={"device": "cpu"})
    config["bf16"] = {"enabled": bf16}
    config["offload"]["early_step"] = early
    kw = dict(name="gpt", config=config, steps=3, micro=2, accum=accum)
    landed = run_ranks(train_engine, world, env=LAG, **kw)
    in_place = run_ranks(train_engine, world, **kw)
    for a, b in zip(landed, in_place):
        assert a["losses"] == b["losses"]
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), key


def test_the_norm_taken_as_gradients_land_is_bitwise_a_pass_after_backward(monkeypatch):
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.002")  # the CPU's emulated discrete device
    config = base_config(2, 2, 1, clip=0.5)
    config["offload"]["speculative_step"] = "off"  # the gradients stay HOLDING after backward, not SPECULATED
    engine = offload.initialize(model=make_model("gpt"), config=config, device="cpu")[0]
    first, last = batches(2, 2)
    engine.backward(loss_of(engine, "gpt", first))
    engine.step()  # between micro-batches: nothing
    engine.backward(loss_of(engine, "gpt", last))
    engine.optimizer.drain()
    shards = engine.optimizer.shards.values()
    assert all(s.phase is ShardPhase.HOLDING and s.norm is not None for s in shards)
    total = 0.0
    for state in shards:  # the pass the step made before: every segment's native norm, in unit order
        values, factor = state.gradient()  # the fp32 sum, accumulated on the (emulated) device and sent down once
        assert values.dtype == torch.float32 and factor == 1.0
        for seg in state.segments:
            total += native.grad_sq_norm(values[seg.start:seg.end]).sum_sq
    engine.step()
    assert engine.last_grad_norm == math.sqrt(total)
    assert all(s.norm is None for s in shards)  # taken afresh next step
    engine.close()


def test_a_gradient_whose_landing_buffer_is_busy_is_copied_by_the_worker_in_order(monkeypatch):
    """Two micro-batches' gradients of one unit back to back, the worker far behind: the second copy waits for the
    first add, and both count."""
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.05")
    config = base_config(2, 2, 1)
    config["offload"]["accumulate_on_device"] = False  # added up on the host, as units the device has no room for
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    optimizer = engine.optimizer
    index, state = next(iter(optimizer.shards.items()))
    n = state.numel
    first, second = torch.full((n,), 1.5), torch.full((n,), 0.25)
    optimizer.landing.land(ReducedShard(index, first, None, None, 1.0))
    optimizer.landing.land(ReducedShard(index, second, None, None, 0.5))
    assert optimizer.landing.deferred_copies == 1
    optimizer.drain()
    assert torch.equal(state.grad, torch.full((n,), 1.625))
    engine.close()


@pytest.mark.parametrize("accum,on_device", [(1, True), (2, True), (2, False)])
def test_the_only_micro_batchs_gradients_stay_where_they_landed(monkeypatch, accum, on_device):
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.002")
    config = base_config(2, accum, 1, clip=0.5)
    config["offload"].update(accumulate_on_device=on_device, speculative_step="off")  # HOLDING, not SPECULATED
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    optimizer = engine.optimizer
    *earlier, last = batches(accum, 2)
    for rows in earlier:
        engine.backward(loss_of(engine, "gpt", rows))
        engine.step()  # between micro-batches: nothing
    engine.backward(loss_of(engine, "gpt", last))
    optimizer.drain()
    shards = list(optimizer.shards.values())
    assert all(s.phase is ShardPhase.HOLDING for s in shards)
    if accum == 1:  # only the landing buffers hold the gradients: no accumulator was ever made
        assert all(s.landed is not None and s.landed.data_ptr() == s.landing.data_ptr() for s in shards)
        assert all(s.grad is None for s in shards) and "gradient accumulators" not in engine.memory_summary()["host"]
    elif on_device:  # the fp32 sums came over once, into fp32 landing buffers; no host accumulator was made
        memory, n = engine.memory_summary(), sum(s.numel for s in shards)
        assert all(s.landed is not None and s.landed.dtype == torch.float32 and s.grad is None for s in shards)
        assert all(s.landed.data_ptr() == s.landing.data_ptr() and s.on_device is not None for s in shards)
        assert memory["device"]["gradient accumulators"] == 4 * n and memory["host"]["gradient landing"] == 4 * n
        assert "gradient accumulators" not in memory["host"]
    else:
        assert all(s.landed is None and s.grad is not None and s.on_device is None for s in shards)
        assert engine.memory_summary()["host"]["gradient accumulators"] == 4 * sum(s.numel for s in shards)
        assert "gradient accumulators" not in engine.memory_summary()["device"]
    engine.close()


def test_on_a_cpu_device_the_only_gradients_are_read_where_the_reduction_left_them():
    import offload
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1, clip=0.5), device="cpu")[0]
    assert engine.accel.host_is_device
    for step, rows in enumerate(batches(2, 2)):
        engine.backward(loss_of(engine, "gpt", rows))
        if step == 1:
            engine.optimizer.drain()
            shards = list(engine.optimizer.shards.values())
            assert all(s.landed is not None and s.landing is None and s.grad is None for s in shards)
        engine.step()
    assert all(s.landed is None and s.grad is None for s in engine.optimizer.shards.values())
    engine.close()


def test_a_unit_whose_gradient_lands_again_adds_the_first_up_before_the_next_comes(monkeypatch):
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.05")
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))[0]
    optimizer = engine.optimizer
    index, state = next(iter(optimizer.shards.items()))
    n = state.numel
    optimizer.last_backward_begins(LastBackward(only=True, steps=False))
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 1.5), None, None, 1.0))
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 0.25), None, None, 0.5))
    # and a third is added too, not left in place
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 0.5), None, None, 0.25))
    optimizer.drain()
    assert state.landed is None and state.phase is ShardPhase.HOLDING
    assert torch.equal(state.grad, torch.full((n,), 1.75))
    total = sum(native.grad_sq_norm(state.grad[seg.start:seg.end]).sum_sq for seg in state.segments)
    assert sum(part.sum_sq for part in state.norm) == total
    engine.close()


def _split_budget(rank: int, world: int, config: dict) -> dict:
    """A device budget with room for the first units' accumulators only (prefetch bucket 0: the gathers are twice
    the largest unit)."""
    import offload
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    device = engine.memory_summary()["device"]
    sizes = [s.numel for s in engine.optimizer.shards.values()]
    largest = max(u.full.numel() * u.full.element_size() for u in engine.units)
    engine.close()
    return {"budget": device["shards"] + 2 * largest + 4 * sum(sizes[:2]), "first_two": 4 * sum(sizes[:2])}


def test_accumulators_split_between_device_and_host_by_the_budget_train_bitwise_as_all_on_the_host():
    config = base_config(2, 3, 2, offload_param={"device": "cpu"}, clip=0.5)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    config["bf16"] = {"enabled": True}
    room = run_ranks(_split_budget, 2, env=LAG, config=config)[0]
    split = {**config, "offload": {**config["offload"], "budgets": {"device": room["budget"]}}}
    host = {**config, "offload": {**config["offload"], "accumulate_on_device": False}}
    kw = dict(name="gpt", steps=3, micro=2, accum=3)
    memory = run_ranks(describe_engine, 2, env=LAG, config=split)[0]["memory"]
    assert memory["device"]["gradient accumulators"] == room["first_two"]  # the first two units', in unit order
    assert memory["host"]["gradient accumulators"] > 0  # the rest add up on the host
    a = run_ranks(train_engine, 2, env=LAG, config=split, **kw)
    b = run_ranks(train_engine, 2, env=LAG, config=host, **kw)
    for x, y in zip(a, b):
        assert x["losses"] == y["losses"]
        for key, value in y["state"].items():
            assert torch.equal(x["state"][key], value), key


def test_a_device_sum_without_a_gradient_in_the_last_micro_batch_comes_over_when_the_step_begins(monkeypatch):
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.01")
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 2, 1))[0]
    optimizer = engine.optimizer
    index, state = next(iter(optimizer.shards.items()))
    n = state.numel
    # an earlier micro-batch's: stays on the device
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 1.5), None, None, 0.5))
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 0.25), None, None, 0.5))
    optimizer.drain()
    assert state.phase is ShardPhase.EMPTY and state.landed is None
    # the last micro-batch gives this unit nothing
    optimizer.last_backward_begins(LastBackward(only=False, steps=False))
    optimizer.landing.send_held()
    optimizer.drain()
    assert state.phase is ShardPhase.HOLDING and torch.equal(state.landed, torch.full((n,), 0.875))
    assert state.gradient() == (state.landed, 1.0) and state.norm is not None
    optimizer.clear_grads()
    # a new step's first gradient starts a new sum
    optimizer.landing.land(ReducedShard(index, torch.full((n,), 2.0), None, None, 1.0))
    assert torch.equal(state.on_device, torch.full((n,), 2.0))
    engine.close()


@pytest.mark.parametrize("host,accum,in_place", [(10**9, 1, True), (550_000, 1, True), (10**9, 2, False)],
                         ids=["nvme-all-on-host", "nvme-split", "nvme-accumulating"])
def test_the_placement_alone_says_whether_gradients_are_read_where_they_land(tmp_path, host, accum, in_place):
    """offload_optimizer.device nvme at one micro-batch a step reads gradients where they land (as device cpu
    does), whether its sub-groups stay on the host or some go to NVMe, and counts no accumulator; accumulation
    makes the accumulators the budget counted, byte for byte."""
    import offload
    config = base_config(2, accum, 1, clip=0.5, sub_group_size=3000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    config["offload"].update(budgets={"host": host}, speculative_step="off")
    engine = offload.initialize(model=make_model("gpt"), config=config, device="cpu")[0]
    try:
        optimizer = engine.optimizer
        tiers = {g.tier for g in optimizer.store.groups}
        assert tiers == ({Tier.HOST} if host > 10**6 else {Tier.HOST, Tier.NVME})
        for rows in batches(accum, 2):
            engine.backward(loss_of(engine, "gpt", rows))
        optimizer.drain()
        shards = list(optimizer.shards.values())
        made = sum(4 * s.numel for s in shards if s.grad is not None)
        counted = engine.memory_summary()["host"].get("gradient accumulators", 0)
        assert optimizer.landing.reads_in_place is in_place
        assert (made == 0) is in_place and made == counted
        # on a CPU device a gradient read where it landed is the reduced shard, held until the step: counted too
        held = sum(s.landed.numel() * s.landed.element_size() for s in shards if s.landed is not None)
        assert (held > 0) is in_place and held == engine.memory_summary()["host"].get(HELD_GRADS, 0)
        engine.step()
    finally:
        engine.close()
