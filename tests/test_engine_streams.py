"""The copy streams' ordering: with the emulated streams lagging far behind, results are unchanged.

On CPU the D2H/H2D copy streams and the host accumulation thread are worker threads
(offload.accelerator). Each of their operations here sleeps first, so if the engine
forgot to wait for a gradient copy before the step, or for a parameter copy before a
gather, it would read stale or half-written buffers and the parity check would fail.
"""

from engine_cases import base_config, check_parity, train_engine, train_reference
from offload.accelerator import StreamError, WorkerStream
from offload.launch import run_ranks

import pytest


def test_lagging_copy_streams_give_the_same_training():
    config = base_config(2, 2, 2)
    results = run_ranks(train_engine, 2, env={"OFFLOAD_EMULATED_COPY_DELAY_S": "0.004"}, name="gpt", config=config,
                        steps=4, micro=2, accum=2)
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
