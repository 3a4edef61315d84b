"""Where a step's time and bytes go: seconds per phase, bytes per link, and profiler ranges.

Spans on the training thread (gather, reduce_scatter, grad_wait, optimizer) add up to
the part of a step that is not model compute; spans on the copy and host threads
(d2h, h2d, accumulate, landed_norm) run beside it and are reported as background time. While a torch
profiler is recording, each span is also a ``record_function`` range labelled
``offload::<phase> (<unit>)``, so its trace shows them on the right thread; otherwise a
span costs two clock reads and a lock (hooks run it for every unit, twice a step).

On CUDA a span measures the host's time to issue the work, not the GPU's time to run it.

With ``start_trace()`` every span is also kept as an event (phase, unit, thread, start,
end), up to a bound; ``export_chrome_trace(path)`` writes them as Chrome-trace JSON
(open it in Perfetto or chrome://tracing: one row per thread), and ``overlap_share()``
says how much of the background copies ran while the training thread was computing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

FOREGROUND = ("gather", "gather_wait", "prefetch", "reduce_scatter", "all_reduce", "all_gather", "grad_wait",
              "optimizer")
BACKGROUND = ("d2h", "accumulate", "landed_norm", "h2d", "optimizer_overlapped")
NVME_PARAMS = ("param_read",)  # parameter shards read from NVMe, submit to completion, on the "nvme" row
AUTOGRAD_THREAD = "autograd"
COMPUTE = ("forward", "backward")  # spans of the training thread that contain the model's compute


class TraceEvent(NamedTuple):
    """One kept span. A tuple: cheap to make on every hook call, and the garbage collector stops tracking it (its
    fields are strings and floats), so a long trace does not lengthen every collection."""

    phase: str
    label: str | None
    thread: str
    start: float  # perf_counter seconds
    end: float


@dataclass(frozen=True)
class Snapshot:
    seconds: dict[str, float]
    counts: dict[str, int]
    bytes: dict[str, int]


class Telemetry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._max_events = 0  # 0: not tracing; reset() keeps whether it traces
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._seconds: dict[str, float] = defaultdict(float)
            self._counts: dict[str, int] = defaultdict(int)
            self._bytes: dict[str, int] = defaultdict(int)
            # Bounded: a long traced run drops its oldest events, each in constant time.
            self._events: deque[TraceEvent] = deque(maxlen=self._max_events or None)

    def start_trace(self, max_events: int = 200_000) -> None:
        """Keep every span as an event from now on (the oldest beyond ``max_events`` are dropped)."""
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        with self._lock:
            self._events = deque(maxlen=max_events)
            self._max_events = max_events

    def stop_trace(self) -> None:
        with self._lock:
            self._max_events = 0

    def span(self, phase: str, label: str | None = None) -> _Span:
        """A ``with`` block timed as ``phase`` (``label``: the unit); cheap enough for every hook call."""
        return _Span(self, phase, label)

    def interval(self, phase: str, label: str | None, start: float, end: float, thread: str | None = None) -> None:
        """Record work that ran outside Python (an NVMe transfer in the kernel) on its own trace row (``thread``;
        None: the calling thread's)."""
        with self._lock:
            self._seconds[phase] += end - start
            self._counts[phase] += 1
            if self._max_events:
                self._events.append(TraceEvent(phase, label, thread or _thread_name(), start, end))

    def add_bytes(self, link: str, n: int) -> None:
        with self._lock:
            self._bytes[link] += n

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._seconds), dict(self._counts), dict(self._bytes))

    def events(self) -> list[TraceEvent]:
        with self._lock:
            return list(self._events)

    def export_chrome_trace(self, path: str | os.PathLike[str], rank: int = 0) -> Path:
        """Write the kept events as Chrome-trace JSON: one process per rank, one row per thread."""
        events = self.events()
        origin = min((e.start for e in events), default=0.0)
        threads = {name: i for i, name in enumerate(dict.fromkeys(e.thread for e in events))}
        out = [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
               for name, tid in threads.items()]
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"offload rank {rank}"}})
        for e in events:
            out.append({"name": e.phase if e.label is None else f"{e.phase} ({e.label})", "cat": e.phase, "ph": "X",
                        "pid": rank, "tid": threads[e.thread], "ts": (e.start - origin) * 1e6,
                        "dur": (e.end - e.start) * 1e6})
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
        return target

    def overlap_share(self, phases: tuple[str, ...] = BACKGROUND) -> float | None:
        """Of the time spent in ``phases`` (background copies), the share that ran while the training thread
        was inside forward or backward; None when nothing was traced."""
        events = self.events()
        compute = sorted((e.start, e.end) for e in events if e.phase in COMPUTE)
        busy = [(e.start, e.end) for e in events if e.phase in phases]
        total = sum(end - start for start, end in busy)
        if not compute or total <= 0:
            return None
        merged: list[list[float]] = []
        for start, end in compute:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        hidden = sum(max(0.0, min(end, c_end) - max(start, c_start))
                     for start, end in busy for c_start, c_end in merged)
        return hidden / total


class PhaseReport:
    """DeepSpeed's ``wall_clock_breakdown``: the mean time per step of each phase since the last report."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._since = telemetry.snapshot()
        self._start = time.perf_counter()

    def line(self, steps: int) -> str:
        """One log line for the ``steps`` optimizer steps since the last call, and start the next interval."""
        now, snap = time.perf_counter(), self._telemetry.snapshot()
        steps = max(1, steps)
        spent = {k: (v - self._since.seconds.get(k, 0.0)) * 1e3 / steps for k, v in snap.seconds.items()}
        wall = (now - self._start) * 1e3 / steps
        self._since, self._start = snap, now

        def listed(phases: tuple[str, ...]) -> str:
            return ", ".join(f"{p} {spent[p]:.1f}" for p in phases if spent.get(p, 0.0) > 0.0) or "none"
        return (f"time per step, ms (mean of {steps}): wall {wall:.1f} | {listed(COMPUTE)} | "
                f"{listed(FOREGROUND)} | beside it: {listed(BACKGROUND + NVME_PARAMS)}")


class _Span:
    """One timed block: two clock reads and a lock; a ``record_function`` range too while a torch profiler records
    (a class, not a generator context manager: hooks open one per unit, twice a step)."""

    __slots__ = ("_tel", "_phase", "_label", "_start", "_range")

    def __init__(self, tel: Telemetry, phase: str, label: str | None) -> None:
        self._tel, self._phase, self._label = tel, phase, label
        self._range: Any = None

    def __enter__(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self._range = torch.profiler.record_function(
                f"offload::{self._phase}" + (f" ({self._label})" if self._label else ""))
            self._range.__enter__()
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        if self._range is not None:
            self._range.__exit__(*exc)
        self._tel.interval(self._phase, self._label, self._start, end)


def _thread_name() -> str:
    """The trace row's name: threads Python did not start are autograd's device threads (on a GPU the
    gradient hooks, and so the D2H copies they issue, run there), which Python calls "Dummy-N"."""
    thread = threading.current_thread()
    return AUTOGRAD_THREAD if isinstance(thread, threading._DummyThread) else thread.name
