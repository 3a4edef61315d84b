"""Where a step's time and bytes go: seconds per phase, bytes per link, and profiler ranges.

Spans on the training thread (gather, reduce_scatter, grad_wait, optimizer) add up to
the part of a step that is not model compute; spans on the copy and host threads
(d2h, h2d, accumulate) run beside it and are reported as background time. Each span
is also a ``torch.profiler.record_function`` range labelled ``offload::<phase> (<unit>)``,
so a torch profiler trace shows them on the right thread.

On CUDA a span measures the host's time to issue the work, not the GPU's time to run it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FOREGROUND = ("gather", "gather_wait", "prefetch", "reduce_scatter", "grad_wait", "optimizer")
INSIDE_OPTIMIZER = ("nvme_wait",)  # stalls on NVMe inside the optimizer phase
BACKGROUND = ("d2h", "accumulate", "h2d")


@dataclass(frozen=True)
class Snapshot:
    seconds: dict[str, float]
    counts: dict[str, int]
    bytes: dict[str, int]


class Telemetry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._seconds: dict[str, float] = defaultdict(float)
            self._counts: dict[str, int] = defaultdict(int)
            self._bytes: dict[str, int] = defaultdict(int)

    @contextmanager
    def span(self, phase: str, label: str | None = None) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(f"offload::{phase}" + (f" ({label})" if label else "")):
            try:
                yield
            finally:
                elapsed = time.perf_counter() - start
                with self._lock:
                    self._seconds[phase] += elapsed
                    self._counts[phase] += 1

    def add_bytes(self, link: str, n: int) -> None:
        with self._lock:
            self._bytes[link] += n

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._seconds), dict(self._counts), dict(self._bytes))
