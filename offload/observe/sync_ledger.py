"""Every host-blocking wait, counted by who blocked: the instrument behind the GPU step's promise.

[Note: sync ledger] On a GPU the step is fast only if the threads that feed the device
never wait on it: autograd's thread (the backward hooks) must never block, the training
thread blocks only where the step needs a result, and the one scalar the step needs
(the global gradient norm) is read once. On a CPU box every wait looks free, so this
promise could rot unseen; instead each wait the engine makes goes through
``SyncLedger.block`` (or ``scalar_read``) with what it waits for, and the ledger counts
it under the role of the thread that called it. A test then asserts the counts of a
steady-state step on the CPU, where the emulated streams run the same code a GPU runs.

Counted are the calls that would block on a GPU, whether or not this one happened to:
an event or stream synchronize, an I/O request's wait, a tensor read into Python. A
stream made to wait for an event (``Accelerator.compute_wait``, a collective's wait on
NCCL) blocks no thread there and is not counted.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Role(enum.Enum):
    """Who is waiting: which thread, and in which part of the step."""

    FORWARD = "forward"  # the training thread inside engine.forward
    BACKWARD = "backward"  # autograd's thread, running the engine's hooks (any thread, on a GPU its own)
    TRAINING = "training"  # the training thread anywhere else (the step, saving, loading)
    WORKER = "worker"  # an offload worker thread (landing, copies, I/O): blocking there is its job


_local = threading.local()


def current_role() -> Role:
    """The role of the calling thread now: a backward hook wherever autograd runs it, else what the thread said."""
    if torch._C._current_graph_task_id() != -1:
        return Role.BACKWARD
    return getattr(_local, "role", Role.TRAINING)


@contextmanager
def acting_as(role: Role) -> Iterator[None]:
    """The calling thread plays ``role`` inside the block (nests; restores the previous role)."""
    previous = getattr(_local, "role", Role.TRAINING)
    _local.role = role
    try:
        yield
    finally:
        _local.role = previous


class SyncLedger:
    """Counts of host-blocking waits and scalar reads, by (role, what); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waits: collections.Counter[tuple[Role, str]] = collections.Counter()
        self.scalar_reads: collections.Counter[tuple[Role, str]] = collections.Counter()
        self.events_made: collections.Counter[str] = collections.Counter()  # by stream: new events, not re-recorded

    def event_made(self, stream: str) -> None:
        """A stream made a new event (after warm-up, owners re-record theirs: see [Note: events re-recorded])."""
        with self._lock:
            self.events_made[stream] += 1

    def block(self, what: str) -> None:
        """The calling thread is about to block until ``what`` is done."""
        key = (current_role(), what)
        with self._lock:
            self.waits[key] += 1

    def scalar_read(self, what: str) -> None:
        """The calling thread is about to read a device tensor's values into Python (a sync on a GPU)."""
        key = (current_role(), what)
        with self._lock:
            self.scalar_reads[key] += 1

    def waits_by(self, role: Role) -> dict[str, int]:
        with self._lock:
            return {what: n for (r, what), n in self.waits.items() if r is role}

    def reset(self) -> None:
        with self._lock:
            self.waits.clear()
            self.scalar_reads.clear()
            self.events_made.clear()

    def summary(self) -> str:
        """One line per role, for logs and failed assertions."""
        with self._lock:
            lines = [f"{role.value}: " + ", ".join(f"{what} x{n}" for (r, what), n in sorted(
                self.waits.items(), key=lambda kv: kv[0][1]) if r is role)
                for role in Role if any(r is role for r, _ in self.waits)]
            reads = ", ".join(f"{r.value}/{what} x{n}" for (r, what), n in self.scalar_reads.items())
            made = ", ".join(f"{stream} x{n}" for stream, n in sorted(self.events_made.items()))
        return "\n".join(lines + ([f"scalar reads: {reads}"] if reads else []) +
                         ([f"events made: {made}"] if made else [])) or "no waits"
