"""The copy streams' ordering: with the emulated streams lagging far behind, results are unchanged.

On CPU the D2H/H2D copy streams and the host accumulation thread are worker threads
(offload.machine.accelerator). Each of their operations here sleeps first, so if the engine
forgot to wait for a gradient copy before the step, or for a parameter copy before a
gather, it would read stale or half-written buffers and the parity check would fail.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_cases import STREAM_CHECK, base_config, check_parity, train_engine, train_reference

from offload.machine.accelerator import StreamError, WorkerStream
from offload.machine.launch import run_ranks


def test_lagging_copy_streams_give_the_same_training():
    config = base_config(2, 2, 2)
    results = run_ranks(train_engine, 2, env={**STREAM_CHECK, "OFFLOAD_EMULATED_COPY_DELAY_S": "0.004"}, name="gpt",
                        config=config, steps=4, micro=2, accum=2)
    ref = train_reference("gpt", 4, 8, 2, world=2)
    check_parity(results, ref)


def test_worker_stream_runs_in_order_and_events_wait_for_the_work():
    stream = WorkerStream("test", delay_s=0.002)
    seen = []
    for i in range(5):
        stream.run(lambda i=i: seen.append(i))
    event = stream.record()
    event.synchronize()
    assert seen == [0, 1, 2, 3, 4]
    assert event.query()
    stream.close()


def test_a_re_recorded_event_completes_at_its_latest_record_not_an_earlier_one_still_queued():
    import threading

    from offload.observe.sync_ledger import SyncLedger
    ledger = SyncLedger()
    stream = WorkerStream("gated", ledger=ledger)
    first, reached, second = threading.Event(), threading.Event(), threading.Event()
    stream.run(first.wait)
    event = stream.record()
    stream.run(reached.set)
    stream.run(second.wait)
    assert stream.record(into=event) is event  # re-recorded while its first record is still queued
    first.set()
    assert reached.wait(10)  # the worker has passed the first record and waits for the second gate
    assert not event.query()  # the earlier record completed nothing
    second.set()
    event.synchronize()
    assert event.query()
    assert ledger.events_made == {"gated": 1}  # the re-record made none
    stream.close()


def test_worker_stream_failure_reaches_the_waiter_and_stops_later_work():
    stream = WorkerStream("test")
    ran = []
    stream.run(lambda: 1 / 0)
    stream.run(lambda: ran.append("after"))
    with pytest.raises(StreamError, match="division by zero"):
        stream.synchronize()
    assert ran == []
    stream.close()


def test_an_event_waited_on_by_another_stream_orders_them():
    first, second = WorkerStream("first", delay_s=0.01), WorkerStream("second")
    order = []
    first.run(lambda: order.append("copy"))
    second.wait_event(first.record())
    second.run(lambda: order.append("accumulate"))
    second.synchronize()
    assert order == ["copy", "accumulate"]
    first.close()
    second.close()


def test_held_work_waits_for_a_flush_and_keeps_its_place_in_the_order():
    """[Note: held hand-offs]: held items do not run (their event reads pending) until sent; anything enqueued
    unheld sends them first, so the order is the order of enqueueing."""
    import time
    stream = WorkerStream("test")
    order = []
    stream.run(lambda: order.append("held 1"), held=True)
    held_event = stream.record(held=True)
    stream.run(lambda: order.append("held 2"), held=True)
    time.sleep(0.05)
    assert order == [] and not held_event.query()
    stream.flush()
    stream.run(lambda: order.append("unheld"))
    stream.run(lambda: order.append("held 3"), held=True)
    stream.run(lambda: order.append("unheld, after"))  # sends "held 3" before itself
    stream.synchronize()
    assert order == ["held 1", "held 2", "unheld", "held 3", "unheld, after"] and held_event.query()
    stream.close()


def test_a_recorded_step_graph_issues_held_work_where_it_was_sent():
    """Held work cannot start before it is sent: in a recorded step graph its issue point is the flush's (two host
    items later here), not the enqueue's; unheld work keeps its own."""
    from offload.observe.step_graph import HOST, StepGraph
    graph = StepGraph()
    graph.start()
    stream = WorkerStream("land", graph=graph)
    stream.run(lambda: graph.work("accumulate", 0, nbytes=4), held=True)
    event = stream.record(held=True)
    graph.work("hook_backward", 1, lane=HOST)
    graph.work("hook_backward", 2, lane=HOST)
    stream.flush()  # host lane at 2 items
    stream.run(lambda: graph.work("accumulate", 3, nbytes=4))  # unheld: issued at once, also at 2
    graph.work("hook_backward", 4, lane=HOST)
    stream.run(lambda: graph.work("accumulate", 5, nbytes=4))  # at 3
    event.synchronize()
    stream.synchronize()
    lane = graph.lanes["land"]
    issued = {i.unit: i.issued for i in lane if i.kind == "accumulate"}
    assert issued == {0: (HOST, 2), 3: (HOST, 2), 5: (HOST, 3)}
    assert next(i for i in lane if i.kind == "record").issued == (HOST, 2)
    stream.close()


def test_a_waiter_is_not_stranded_when_its_event_is_re_recorded_held():
    """A thread blocked on an event's sent record, which another thread then records again held: the worker's
    reaching the old record completes nothing (the event names its latest), so the waiter must send the held one."""
    import threading
    stream, gate, done = WorkerStream("land"), threading.Event(), threading.Event()
    stream.run(gate.wait)  # the worker is busy
    event = stream.record()

    def waiter():
        event.synchronize()
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    time.sleep(0.1)  # the waiter has sent what was held (nothing) and blocks
    stream.record(into=event, held=True)  # re-armed, held: nobody else will flush
    gate.set()
    assert done.wait(5.0), "the waiter hung on a record nobody sent"
    stream.close()


def test_a_recorded_wait_for_a_held_record_replays(monkeypatch):
    """The step graph notes a wait only after the held record it waits for is issued (held work is issued where it
    is sent), so the recorded graph can finish."""
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    from offload.bench import replay as R
    from offload.machine.accelerator import Accelerator
    accel = Accelerator("cpu")
    land = accel.host_queue("grad-land")
    accel.start_graph()
    accel.graph.work("hook_backward")
    land.run(lambda: accel.graph.work("accumulate", 0, nbytes=1 << 20), held=True)
    accel.wait(land.record(held=True), "a held record")
    accel.synchronize()
    data = accel.graph.to_json()
    data["meta"] = {"world": 1, "tokens": 1}
    assert R.replay(data, R.MACHINES["h100"]).total_ms > 0  # "cannot finish" before the fix
    accel.close()


def test_waiting_for_a_held_record_sends_it_from_any_thread():
    """No wait can hang on held work: the event's wait sends what its stream holds, whichever thread waits (here
    another stream's worker)."""
    first, second = WorkerStream("first"), WorkerStream("second")
    order = []
    first.run(lambda: order.append("landed"), held=True)
    event = first.record(held=True)
    second.wait_event(event)
    second.run(lambda: order.append("stepped"))
    second.synchronize()  # second's worker waited for event: that sent first's held work
    assert order == ["landed", "stepped"]
    first.run(lambda: order.append("held"), held=True)
    again = first.record(held=True)
    again.synchronize()  # this thread waits: the same
    assert order[-1] == "held"
    first.close()
    second.close()


def test_backward_hands_its_held_landings_over_when_it_ends():
    """[Note: landings handed over in batches]: the test model's units are far below the batch size, so every
    landing is held until backward's end sends them; then the worker lands them with nobody waiting."""
    import time

    from engine_cases import batches, loss_of, make_model

    import offload
    from offload.optim.landing import LANDING_BATCH_BYTES
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))[0]
    optimizer = engine.optimizer
    assert all(s.numel * 4 < LANDING_BATCH_BYTES for s in optimizer.shards.values())
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    deadline = time.monotonic() + 30
    while not all(s.events.free.query() for s in optimizer.shards.values()) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling, not waiting: a wait would send the held work itself
    assert all(s.events.free.query() for s in optimizer.shards.values())
    engine.step()
    engine.close()


def test_weights_saved_right_after_a_step_are_the_stepped_ones(tmp_path, monkeypatch):
    """The new shards reach the device on a copy stream after the step; a save straight after must wait for them
    (it read the previous values before the parameter store's read waited for the copy back)."""
    from engine_cases import batches, loss_of, make_model

    import offload
    monkeypatch.setenv("OFFLOAD_EMULATED_COPY_DELAY_S", "0.05")  # copies back lag far behind the step
    config = base_config(2, 1, 1)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    before = engine.full_state_dict()
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    assert engine.save_16bit_model(tmp_path, "pytorch_model.bin")
    after = engine.full_state_dict()  # fp32 masters: the stepped values
    engine.close()
    saved = torch.load(tmp_path / "pytorch_model.bin")
    changed = [k for k in saved if not torch.equal(before[k], after[k])]
    assert changed, "the step changed some weights"
    for key in changed:
        torch.testing.assert_close(saved[key], after[key], msg=f"{key} was saved with its pre-step values")


EXIT_WITHOUT_CLOSE = """
import sys
sys.path.insert(0, {tests!r})
import offload
from engine_cases import base_config, batches, loss_of
from offload.models.gpt import GPT, GPTConfig
config = base_config(2, 1, 1, unit_bytes=1 << 20)
config["offload"]["overlap_step"] = "on"
model = GPT(GPTConfig(vocab_size=512, context=32, hidden_size=256, layers=6, heads=4))
engine, *_ = offload.initialize(model=model, config=config)
engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
print("backward done", flush=True)
"""


def test_a_script_that_never_closes_its_engine_exits_cleanly(tmp_path):
    # The overlapped step is still stepping shards and copying them back on the engine's threads when the
    # interpreter exits: they must finish before Python finalizes, or a torch op taking the GIL on one of them
    # aborts the process ("terminate called without an active exception").
    script = tmp_path / "train.py"
    script.write_text(EXIT_WITHOUT_CLOSE.format(tests=str(Path(__file__).parent)))
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout == "backward done\n" and "terminate" not in done.stderr


EXIT_IN_A_GROUP = """
import atexit, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
# registered before the engine's: runs after it at exit, while Python is still whole
atexit.register(lambda: open({out!r} + dist.get_rank.__name__ + {rank!r}, "w").write(str(dist.is_initialized())))
import offload
from engine_cases import base_config, batches, loss_of, make_model
dist.init_process_group("gloo")  # the script's (as the Trainer's accelerate makes it), never destroyed
engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 2))
engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
engine.step()
"""


def test_a_gloo_group_left_alive_is_ended_before_python_finalizes(tmp_path):
    """See [Note: the group at exit]: a rank exiting with its gloo group alive aborted now and then; the engine
    ends the group at exit, before the interpreter goes, whoever made it."""
    import os
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29_000 + os.getpid() % 1000),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = []
    for rank in range(2):
        script = tmp_path / f"rank{rank}.py"
        script.write_text(EXIT_IN_A_GROUP.format(tests=str(Path(__file__).parent), out=str(tmp_path / "alive-"),
                                                 rank=str(rank)))
        ranks.append(subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(rank)},
                                      stderr=subprocess.PIPE, text=True))
    for proc in ranks:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    for rank in range(2):
        assert (tmp_path / f"alive-get_rank{rank}").read_text() == "False", "the group outlived the script's end"


def _gather_in_flight_at_exit(rank: int, world: int) -> bool:
    """A unit's all-gather issued and never waited for (a prefetch the script did not use), rank 1 a second late to
    it: what the exit's wait finds (rank 0)."""
    import time

    from engine_cases import make_model

    import offload
    from offload.zero.unit import UnitState, wait_in_flight
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 2))
    unit = next(u for u in engine.units if u.state is UnitState.SHARDED)
    if rank == 1:
        time.sleep(1.0)
    unit.start_unshard()
    wait_in_flight()
    done = unit._work is not None and unit._work.is_completed()
    unit.finish_unshard()
    engine.close()
    return done


def test_the_exit_waits_for_an_all_gather_still_in_flight():
    """See [Note: the group at exit]: a gloo worker that finished a gather while Python finalized would free its
    tensors then; the exit waits for every gather in flight before it ends the group."""
    assert run_ranks(_gather_in_flight_at_exit, 2) == [True, True]
