"""How far ahead the host's Adam prefetches its streams, chosen on the CPU that runs it, from a measurement.

[Note: prefetch by measurement] A software prefetch in the Adam pass (see [Note: software prefetch] in
native/kernels.cpp) took the Xeon's step to 0.82-0.89x its time, and cost an AMD Zen 5 EPYC about 10% (1.10x median,
0.94-1.35x); on another Zen 5 it made no difference. A tuning measured on one CPU says little of the next, so the
choice is made where the step runs: the native Adam over buffers larger than the caches, with the variant's
prefetch and without, in interleaved rounds (memory bandwidth drifts on a shared host, and alternating spreads the
drift over both). Prefetching stays on only where it is faster by more than ``MARGIN``: on a tie the hardware's own
prefetchers are enough, and the pass issues fewer instructions. Measuring takes a few tenths of a second, which
every rank of every run would pay, so the answer is kept per CPU model, kernel variant and thread count in a small
JSON file under the user's cache directory; ``offload.host_prefetch`` (on, off) fixes it instead, and
``offload bench adam`` times both beside the memory ceiling. The choice changes no value: a prefetch is a hint.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from offload.machine import native

logger = logging.getLogger("offload.engine")

ELEMENTS = 16 << 20  # 64 MiB a buffer, 256 MiB in all: past the caches a few cores share
ROUNDS = 7
MARGIN = 0.03  # prefetching must be this much faster (relative) to be kept
SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class PrefetchChoice:
    """Whether the Adam pass prefetches, and what it was decided from."""

    prefetch: bool
    source: str  # "measured", "cached" (an earlier measurement on this CPU), or "offload.host_prefetch"
    with_ms: float | None = None  # the measured pass, prefetching and not (None: not measured here)
    without_ms: float | None = None

    def describe(self) -> str:
        what = "prefetches its streams" if self.prefetch else "leaves prefetching to the hardware"
        if self.with_ms is None or self.without_ms is None:
            return f"the host's Adam {what} ({self.source})"
        return (f"the host's Adam {what} ({self.source}: {self.with_ms:.1f} ms a pass prefetching, "
                f"{self.without_ms:.1f} ms not, over {ELEMENTS:,} elements)")


def decide(with_s: float, without_s: float) -> bool:
    """Prefetch only where it is faster by more than ``MARGIN``."""
    return with_s < without_s * (1 - MARGIN)


def cpu_key(threads: int) -> str:
    """What a measurement holds for: the CPU model, the kernel variant running and the thread count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {native.active_variant()} | {threads} threads"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "offload" / "host_prefetch.json"


def measure(threads: int) -> tuple[float, float]:
    """Median seconds of the Adam pass prefetching and not, in alternating rounds (its buffers freed after)."""
    p, g, m, v = (torch.zeros(ELEMENTS) for _ in range(4))
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(ROUNDS + 1):
        for on in (True, False) if r % 2 else (False, True):
            with native.prefetching(None if on else 0):
                start = time.perf_counter()
                native.adam_kernel(p, g, m, v, None, grad_scale=1.0, decay=1.0, l2=0.0, one_minus_beta1=0.1,
                                   beta2=0.999, one_minus_beta2=0.001, bc2_sqrt=1.0, eps=1e-8, step_size=1e-4,
                                   threads=threads)
                took = time.perf_counter() - start
            if r:  # the first round warms up
                times[on].append(took)
    return statistics.median(times[True]), statistics.median(times[False])


def choose(setting: str, threads: int, cache: Path | None = None) -> PrefetchChoice:
    """Decide (see [Note: prefetch by measurement]) and set it for every Adam pass of this process."""
    if setting not in SETTINGS:
        raise ValueError(f"offload.host_prefetch is one of {', '.join(SETTINGS)}, not {setting!r}")
    if setting != "auto":
        choice = PrefetchChoice(setting == "on", "offload.host_prefetch")
    else:
        choice = _cached_or_measured(threads, cache or cache_path())
    native.set_prefetch(None if choice.prefetch else 0)
    return choice


_UNKEPT: dict[tuple[Path, str], PrefetchChoice] = {}  # measured in this process where the cache could not keep it


def _cached_or_measured(threads: int, path: Path) -> PrefetchChoice:
    key = cpu_key(threads)
    if (path, key) in _UNKEPT:  # every engine of this process would measure again
        return _UNKEPT[path, key]
    known = _read(path)
    if key in known:
        entry = known[key]
        return PrefetchChoice(bool(entry["prefetch"]), "cached", entry.get("with_ms"), entry.get("without_ms"))
    with_s, without_s = measure(threads)
    choice = PrefetchChoice(decide(with_s, without_s), "measured", with_s * 1e3, without_s * 1e3)
    known[key] = {k: v for k, v in asdict(choice).items() if k != "source"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(known, indent=1))
        os.replace(partial, path)  # readers see the old file or the new one, whole
    except OSError as e:
        logger.info("the host Adam's prefetch choice is not kept for the next run (%s cannot be written: %s)",
                    path, e)
        _UNKEPT[path, key] = choice
    return choice


def _read(path: Path) -> dict[str, dict[str, float | bool | None]]:
    """The kept measurements, or none where the file is missing or unreadable (it is then measured again and
    rewritten: a cache, never an input that can stop a run)."""
    try:
        known = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("%s is not a readable prefetch cache (%s); measuring again and rewriting it", path, e)
        return {}
    if not isinstance(known, dict) or not all(isinstance(v, dict) and "prefetch" in v for v in known.values()):
        logger.warning("%s does not hold prefetch measurements; measuring again and rewriting it", path)
        return {}
    return known
