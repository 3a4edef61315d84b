"""Whether liburing may be imported here, and importing it safely: the room both the engine chooser
(choose.py) and the io_uring engine (uring.py) draw on, so neither imports the other.

[Note: probing liburing in a subprocess] liburing's 2026 wheels execute AVX-512
instructions at import and die with SIGILL on CPUs without it; the kernel (or a
seccomp profile such as Docker's default) may also refuse io_uring_setup. A SIGILL
cannot be caught, so the first use runs a tiny ring in a child process and only a
child that exits cleanly lets this process import liburing.

[Note: importing liburing] The liburing package rewrites a cache file under its
site-packages folder each time it is imported (through `dynamic_import`), so processes
importing it at the same moment (the ranks of one job, their probes) can fail with
FileNotFoundError. Every import, in the probe and in the engine, holds an exclusive
file lock while it runs.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

IMPORT_LOCK = os.path.join(tempfile.gettempdir(), "offload-liburing-import.lock")

_PROBE = r"""
import fcntl, os, sys, tempfile
with open(sys.argv[2], "a") as lock:  # see [Note: importing liburing]
    fcntl.flock(lock, fcntl.LOCK_EX)
    import liburing
ring = liburing.io_uring()
rc = liburing.io_uring_queue_init(4, ring, 0)
if rc < 0:
    print(f"io_uring_queue_init failed: {os.strerror(-rc)}"); sys.exit(3)
efd = os.eventfd(0)
liburing.io_uring_register_eventfd(ring, efd)
import mmap
buf = mmap.mmap(-1, 4096)
with tempfile.NamedTemporaryFile(dir=sys.argv[1]) as f:
    fd = os.open(f.name, os.O_RDWR | os.O_DIRECT)
    sqe = liburing.io_uring_get_sqe(ring)
    liburing.io_uring_prep_write(sqe, fd, memoryview(buf), 4096, 0)
    liburing.io_uring_submit(ring)
    os.eventfd_read(efd)
    cqe = liburing.io_uring_cqe()
    liburing.io_uring_peek_cqe(ring, cqe)
    if cqe.res != 4096:
        print(f"an O_DIRECT write returned {cqe.res}"); sys.exit(4)
    os.close(fd)
liburing.io_uring_queue_exit(ring)
print("ok")
"""


@dataclass(frozen=True)
class Probe:
    ok: bool
    reason: str


@functools.lru_cache(maxsize=None)
def probe_io_uring(directory: str | None = None) -> Probe:
    """Whether io_uring works here (CPU, kernel, seccomp, liburing build), decided in a child process."""
    directory = directory or tempfile.gettempdir()
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, directory, IMPORT_LOCK], capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        return Probe(False, "the io_uring probe hung for 60 s")
    if proc.returncode < 0:
        import signal
        name = signal.Signals(-proc.returncode).name
        hint = " (a liburing wheel built for AVX-512 on a CPU without it: pin liburing==2024.5.3)" \
            if name == "SIGILL" else ""
        return Probe(False, f"the io_uring probe died with {name}{hint}")
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return Probe(False, f"the io_uring probe failed: {lines[-1] if lines else 'exit ' + str(proc.returncode)}")
    return Probe(True, "io_uring works here")


def import_liburing() -> Any:  # the liburing module (no stubs, no py.typed: Any to mypy)
    """``import liburing`` under the cross-process lock (see [Note: importing liburing])."""
    with open(IMPORT_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        import liburing
    return liburing
