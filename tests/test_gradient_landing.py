"""Gradients land without blocking backward, and change no result (see [Note: gradients land]).

A separate device (emulated: ``OFFLOAD_EMULATED_DISCRETE_DEVICE``) copies each reduced gradient into the unit's
landing buffer on the D2H stream; a CPU device lets the landing worker read it where it lies. Same arithmetic on
the same values: the two train bitwise alike, with the copies lagging and gradients accumulated or not.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_cases import base_config, batches, loss_of, make_model, train_engine
from offload import native
from offload.launch import run_ranks
from offload.optim.sharded import ShardPhase

LAG = {"OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}  # implies a discrete device: every copy a GPU makes


@pytest.mark.parametrize("world,accum,bf16,early", [(1, 1, False, "off"), (2, 4, False, "off"), (3, 1, False, "off"),
                                                    (3, 1, True, "off"), (2, 1, True, "on")],
                         ids=["W1", "W2-accum4", "W3", "W3-bf16", "W2-bf16-early"])
def test_landed_gradients_train_bitwise_as_gradients_read_in_place(world, accum, bf16, early):
    """With one micro-batch the landed gradient is read where it landed, times 1/W (W = 3: a factor that rounds),
    by the norm and Adam (see [Note: gradients read where they land]); with four, it is added up first."""
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
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 2, 1, clip=0.5), device="cpu")[0]
    first, last = batches(2, 2)
    engine.backward(loss_of(engine, "gpt", first))
    engine.step()  # between micro-batches: nothing
    engine.backward(loss_of(engine, "gpt", last))
    engine.optimizer.drain()
    shards = engine.optimizer.shards.values()
    assert all(s.phase is ShardPhase.HOLDING and s.norm is not None for s in shards)
    total = 0.0
    for state in shards:  # the pass the step made before: every segment's native norm, in unit order
        for seg in state.segments:
            total += native.grad_sq_norm(state.grad[seg.start:seg.end]).sum_sq
    engine.step()
    assert engine.last_grad_norm == math.sqrt(total)
    assert all(s.norm is None for s in shards)  # taken afresh next step
    engine.close()


def test_a_gradient_whose_landing_buffer_is_busy_is_copied_by_the_worker_in_order(monkeypatch):
    """Two micro-batches' gradients of one unit back to back, the worker far behind: the second copy waits for the
    first add, and both count."""
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.05")
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 2, 1))[0]
    optimizer = engine.optimizer
    index, state = next(iter(optimizer.shards.items()))
    n = state.numel
    first, second = torch.full((n,), 1.5), torch.full((n,), 0.25)
    optimizer.accumulate(index, first, 1.0)
    optimizer.accumulate(index, second, 0.5)
    assert optimizer.deferred_copies == 1
    optimizer.drain()
    assert torch.equal(state.grad, torch.full((n,), 1.625))
    engine.close()


@pytest.mark.parametrize("accum", [1, 2])
def test_the_only_micro_batchs_gradients_stay_where_they_landed(monkeypatch, accum):
    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.002")
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, accum, 1, clip=0.5))[0]
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
    else:
        assert all(s.landed is None and s.grad is not None for s in shards)
        assert engine.memory_summary()["host"]["gradient accumulators"] == 4 * sum(s.numel for s in shards)
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
    optimizer.last_backward_begins(overlap=False, only=True)
    optimizer.accumulate(index, torch.full((n,), 1.5), 1.0)
    optimizer.accumulate(index, torch.full((n,), 0.25), 0.5)
    optimizer.accumulate(index, torch.full((n,), 0.5), 0.25)  # and a third is added too, not left in place
    optimizer.drain()
    assert state.landed is None and state.phase is ShardPhase.HOLDING
    assert torch.equal(state.grad, torch.full((n,), 1.75))
    total = sum(native.grad_sq_norm(state.grad[seg.start:seg.end]).sum_sq for seg in state.segments)
    assert sum(part.sum_sq for part in state.norm) == total
    engine.close()
