"""glibc's mmap threshold, fixed, so that the process's RSS tracks the memory the budgets bound.

glibc serves an allocation above its mmap threshold with its own mapping, returned to the
kernel when freed; below it, from the heap, where freed memory mostly stays. It also raises
the threshold (up to 32 MiB) each time a mapped block is freed, so after the first freed
unit-sized buffer every later one comes from the heap, and RSS drifts far above what is live
(measured: 374 MiB of growth against 215-245 MiB with the threshold fixed, for 191 MiB of
host budget). ``mallopt(M_MMAP_THRESHOLD, n)`` fixes it and turns that adjustment off; it is
process-wide, so the library sets it only when asked (``offload.host_malloc``) and the
``offload train`` application sets it at start-up. ``MALLOC_MMAP_THRESHOLD_`` in the
environment does the same before the process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("offload.machine.host_malloc")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_THRESHOLD = 32 << 20  # glibc's HEAP_MAX / 2 on 64-bit: mallopt refuses more
DEFAULT_THRESHOLD = 128 << 10  # glibc's own starting value, kept for good


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes``; False (and a log line) where the C library has no mallopt or
    refuses the value."""
    if not 0 <= nbytes <= MAX_THRESHOLD:
        raise ValueError(f"an mmap threshold is 0 to {MAX_THRESHOLD} bytes (glibc's limit), got {nbytes}")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)):
        logger.warning("could not set the C library's mmap threshold (not glibc?); RSS may drift above the budgets")
        return False
    logger.info("malloc: allocations of %d bytes or more get their own mapping, returned to the system when freed",
                nbytes)
    return True


@dataclass(frozen=True)
class Resident:
    """The process's resident memory. ``anon``: what it allocated, resident now (RssAnon: not the mapped pages of
    its libraries, which the kernel evicts and reloads with other work on the machine; None where the system does
    not say). ``peak``: the high-water mark of all of it."""

    anon: int | None
    peak: int


def resident() -> Resident:
    """Linux's ``/proc/self/status`` (RssAnon, VmHWM), else the peak ``getrusage`` reports."""
    fields: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM") and value.strip().endswith("kB"):
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    peak = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return Resident(fields.get("RssAnon"), peak)
