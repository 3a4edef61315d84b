"""The GPU step's promise, kept on the CPU: in a steady-state step autograd's thread never blocks, the forward never
blocks, and the step reads one scalar (see [Note: sync ledger] in offload/observe/sync_ledger.py).

The emulated copy streams lag (a copy delay), so the landing worker runs far behind backward: any wait for it on
autograd's thread would be counted here, as it would stall a GPU there.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_cases import base_config, batches, loss_of, make_model

from offload.machine.launch import run_ranks
from offload.observe.sync_ledger import Role, SyncLedger, acting_as, current_role


def ledger_of_a_step(rank: int, world: int, config: dict[str, Any], accum: int, warmup: int = 2) -> dict[str, Any]:
    """``warmup`` steps, then the ledger of the next one (its forward, backward and step)."""
    import offload
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    data = batches((warmup + 1) * accum, 2 * world)
    ledger = engine.accel.ledger
    for step in range(warmup + 1):
        if step == warmup:
            ledger.reset()
        for micro in range(accum):
            rows = data[step * accum + micro][2 * rank:2 * rank + 2]
            engine.backward(loss_of(engine, "gpt", rows))
            engine.step()
    out = {role.value: ledger.waits_by(role) for role in Role}
    out["scalar_reads"] = {f"{r.value}/{what}": n for (r, what), n in ledger.scalar_reads.items()}
    out["events_made"] = dict(ledger.events_made)
    out["summary"] = ledger.summary()
    engine.close()
    return out


@pytest.mark.parametrize("world,accum,params", [(1, 1, "cpu"), (1, 4, "none"), (2, 1, "none"), (2, 4, "cpu")])
def test_a_steady_step_never_blocks_autograd_or_the_forward_reads_one_scalar_and_makes_no_events(world, accum,
                                                                                                 params):
    config = base_config(2, accum, world, offload_param={"device": params})
    results = run_ranks(ledger_of_a_step, world, env={"OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}, config=config,
                        accum=accum)
    for rank, got in enumerate(results):
        assert got["backward"] == {}, f"rank {rank}: autograd's thread blocked:\n{got['summary']}"
        assert got["forward"] == {}, f"rank {rank}: the forward blocked:\n{got['summary']}"
        assert got["scalar_reads"] == {"training/global gradient norm": 1}, got["summary"]
        # The step waits for the landed gradients once; everything else it waits for is named here on purpose.
        assert got["training"].get("gradients drained") == 1, got["summary"]
        # After warm-up every event is re-recorded by its owner (see [Note: events re-recorded]).
        assert got["events_made"] == {}, got["summary"]


@pytest.mark.parametrize("cpu", [True, False], ids=["inputs-on-the-host", "inputs-on-the-device"])
def test_checkpointed_blocks_keep_the_promise_and_reuse_their_events(cpu):
    """Activation checkpointing, its inputs copied out to the host during forward and back during backward: no
    host-blocking wait in forward or on autograd's thread (the bound on copies in flight is a stream wait), and
    the copies' events are re-recorded, not made afresh each step."""
    config = base_config(2, 1, 1)
    config["offload"]["checkpoint_blocks"] = True
    config["activation_checkpointing"] = {"cpu_checkpointing": cpu}
    got = run_ranks(ledger_of_a_step, 1, env={"OFFLOAD_EMULATED_COPY_DELAY_S": "0.002"}, config=config, accum=1)[0]
    assert got["backward"] == {}, got["summary"]
    assert got["forward"] == {}, got["summary"]
    assert got["events_made"] == {}, got["summary"]


def test_the_ledger_counts_by_the_waiting_threads_role():
    import torch

    from offload.machine.accelerator import WorkerStream
    ledger = SyncLedger()
    ledger.block("outside")
    with acting_as(Role.FORWARD):
        ledger.block("in forward")
        assert current_role() is Role.FORWARD
    assert current_role() is Role.TRAINING
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: ledger.block("in a hook"))
    (x * 2).sum().backward()
    worker = WorkerStream("test")
    worker.run(lambda: ledger.block("on a worker"))
    worker.synchronize()
    worker.close()
    assert ledger.waits_by(Role.TRAINING) == {"outside": 1}
    assert ledger.waits_by(Role.FORWARD) == {"in forward": 1}
    assert ledger.waits_by(Role.BACKWARD) == {"in a hook": 1}
    assert ledger.waits_by(Role.WORKER) == {"on a worker": 1}
    assert "backward: in a hook x1" in ledger.summary()
