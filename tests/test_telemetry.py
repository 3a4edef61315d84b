"""Telemetry: seconds per phase, the Chrome-trace timeline, and the share of background copies hidden."""

import json
import threading
import time

import pytest
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.observe.telemetry import AUTOGRAD_THREAD, Telemetry, TraceEvent


def test_overlap_share_counts_only_time_inside_compute():
    tel = Telemetry()
    tel.start_trace()
    tel._events = [TraceEvent("forward", None, "main", 0.0, 1.0), TraceEvent("backward", None, "main", 2.0, 3.0),
                   TraceEvent("d2h", "u", "copy", 0.5, 2.5),  # 0.5 s inside forward, 0.5 s inside backward
                   TraceEvent("h2d", "u", "copy", 3.5, 4.5)]  # after compute: not hidden
    assert tel.overlap_share() == 1.0 / 3.0
    assert Telemetry().overlap_share() is None


def test_spans_from_threads_add_up_and_the_trace_is_bounded():
    tel = Telemetry()
    tel.start_trace(max_events=5)

    def work():
        for _ in range(4):
            with tel.span("d2h", "unit"):
                time.sleep(0.001)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = tel.snapshot()
    assert snap.counts["d2h"] == 8 and snap.seconds["d2h"] >= 0.008
    kept = tel.events()
    assert len(kept) == 5 and kept[-1].end == max(e.end for e in kept)  # the oldest were dropped, in order
    with tel.span("h2d"):
        pass
    assert len(tel.events()) == 5 and tel.events()[-1].phase == "h2d" and tel.events()[0] == kept[1]
    with pytest.raises(ValueError, match="max_events must be at least 1, got 0"):
        tel.start_trace(max_events=0)


def test_engine_timeline_has_every_thread_and_opens_as_chrome_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")  # the copies and gathers a GPU run makes
    # Host-homed shards, so each use gathers (a device home at W = 1 is read where it lives).
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1,
                                                                                offload_param={"device": "cpu"}))
    engine.telemetry.start_trace()
    for tokens in batches(2, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
    path = engine.telemetry.export_chrome_trace(tmp_path / "trace.json")
    share = engine.telemetry.overlap_share()
    engine.close()
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    by_phase = {}
    for e in spans:
        by_phase.setdefault(e["cat"], set()).add(threads[e["tid"]])
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert by_phase["forward"] == by_phase["backward"] == by_phase["optimizer"] == {"MainThread"}
    # A CPU run's D2H copies run on the emulated copy stream's thread; a GPU run's are issued (onto a CUDA
    # stream) by the gradient hooks, which run on autograd's device thread.
    assert by_phase["d2h"] == ({AUTOGRAD_THREAD} if engine.accel.is_cuda else {"offload-d2h"})
    # One micro-batch: its gradients are read where they land, and the worker takes their norm there.
    assert by_phase["landed_norm"] == {"offload-grad-land"} and "accumulate" not in by_phase
    assert any(e["name"].startswith("gather (") for e in spans)  # labelled with the unit
    assert share is not None and 0.0 <= share <= 1.0


def test_spans_from_a_thread_python_did_not_start_are_on_the_autograd_row():
    import _thread
    telemetry = Telemetry()
    telemetry.start_trace()
    done = threading.Event()

    def hook():  # what autograd's device thread does when it runs a gradient hook
        with telemetry.span("d2h"):
            pass
        done.set()

    _thread.start_new_thread(hook, ())
    assert done.wait(10)
    with telemetry.span("forward"):
        pass
    rows = {e.phase: e.thread for e in telemetry.events()}
    assert rows == {"d2h": AUTOGRAD_THREAD, "forward": threading.current_thread().name}
