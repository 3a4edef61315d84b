"""A check of the device's stream order on the emulated GPU: the wait a real GPU would miss, found on a CPU.

[Note: stream order checked] On the emulated device (see [Note: emulated streams] in accelerator.py) a copy stream
lags, so a copy that forgets to wait for another copy fails a test. The compute stream cannot lag: a CPU runs each
op as it is issued, so compute has always finished whatever a copy stream reads or overwrites after it, and a copy
that forgets to wait for compute works here and races on a GPU (a copy back that frees a place of the streamed
lane's ring before the compute stream has read it, say). ``OFFLOAD_EMULATED_STREAM_CHECK=1`` checks every device
access the way torch's CUDA sanitizer does on a GPU, by the order the streams promise, not by what ran first:

- each agent (the compute stream: the thread that started the engine; each emulated copy stream and host queue)
  has a vector clock. An op on the compute stream ticks its own entry; work enqueued on a stream takes that
  stream's clock when it was enqueued (it runs later, on the stream's thread, in that order);
- an event carries the clock of the point it was recorded at, and of the waits its stream's work made before the
  record ran; ``wait_event`` (a stream), ``compute_wait`` and a thread that blocked on it take it in (work a thread
  enqueues later is ordered after what it has seen complete);
- every aten op run by an agent notes what it reads and writes of device memory (byte ranges of each tensor,
  read or written by the op's schema). An access races an earlier one by another agent, when either writes,
  unless the earlier one is in the accessing agent's clock: that raises ``StreamOrderError``, naming both.

Host memory (the pinned and pageable buffers the engine allocates, ``AlignedBuffer``) is left out: the host's own
program order covers what a host thread writes before it enqueues a copy, and a copy stream's lag already tests
what host threads read of a copy. A fresh tensor an op returns starts a new history where it lies (the CPU's
allocator reuses memory at once; a GPU's caching allocator is stream-aware). Ops of other threads (gloo's, NVMe
I/O) are not seen. It is slow (a Python hook on every op) and for tests: a few steps of a small model.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten

Clock = dict[str, int]
COMPUTE = "compute"
ENV = "OFFLOAD_EMULATED_STREAM_CHECK"  # 1, or "stacks": each access also says where it was issued (slower)
_HOST: set[tuple[int, int]] = set()  # host buffers' storages (see ``_storage``), where the check is wanted: not checked


def wanted() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


class StreamOrderError(RuntimeError):
    """A device access not ordered after an earlier conflicting one by another stream."""


@dataclass
class _Access:
    start: int
    end: int
    agent: str
    tick: int  # the agent's own clock entry at the access
    write: bool
    op: torch._ops.OpOverload  # made a string only in an error: this runs on every op
    where: str = ""  # where the access was issued (OFFLOAD_EMULATED_STREAM_CHECK=stacks)


def _merge(into: Clock, other: Clock) -> None:
    for agent, tick in other.items():
        if into.get(agent, 0) < tick:
            into[agent] = tick


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """A storage's key: the storage object and where its memory starts. Memory freed and taken again by another
    storage (a gradient's, then a gathered unit's resized back) starts a new history; what the CPU's allocator
    reuses is not what a GPU's stream-aware one would (see the note)."""
    storage = t.untyped_storage()
    return storage._cdata, storage.data_ptr()


_Memory = tuple[tuple[int, int], int, int]  # a tensor's storage key, and the addresses [start, end) it can touch


def _memory(t: torch.Tensor) -> _Memory | None:
    """The storage and bytes ``t`` can touch (None: no memory). Computed once per tensor and op: this runs on
    every op of every engine test."""
    if not t.is_cpu or t.is_sparse:
        return None
    numel = t.numel()
    if numel == 0:
        return None
    start = t.data_ptr()
    last = numel - 1 if t.is_contiguous() else \
        sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return _storage(t), start, start + (last + 1) * t.element_size()


class StreamCheck:
    """The clocks, the events' clocks and the device accesses of one process (see [Note: stream order checked])."""

    def __init__(self) -> None:
        self.stacks = os.environ.get(ENV) == "stacks"
        self.closed = False
        self.compute_thread = threading.get_ident()
        self.clocks: dict[str, Clock] = {COMPUTE: {COMPUTE: 0}}
        self._events: dict[int, Clock] = {}  # by id of the event object: its latest record's clock
        # by storage (see ``_storage``), then by agent, bytes and kind: the latest such access
        self._accesses: dict[tuple[int, int], dict[tuple[str, int, int, bool], _Access]] = {}
        self._lock = threading.RLock()
        self._local = threading.local()  # the agent and clock of the work running on this thread, if any
        self.main_host: Clock = {}  # what the compute thread has seen complete (its blocking waits)
        self._ran: dict[str, Clock] = {}  # by stream: the clocks its work ran with, waits made inside included
        self._mode = _Mode(self)
        _push_mode(self._mode)  # on the compute thread, until ``close``

    def close(self) -> None:
        """The engine is done: nothing more is checked, and the mode leaves the compute thread (where it is the
        newest; else it stays, doing nothing)."""
        self.closed = True
        if threading.get_ident() == self.compute_thread and _get_current_dispatch_mode() is self._mode:
            _pop_mode()

    # ------------------------------------------------------------------ the agents' order

    def _host_clock(self) -> Clock:
        """What the calling thread has seen complete: a stream's work running here (its clock as enqueued, and
        what it waited for since), the compute thread's blocking waits, another host thread's own."""
        running = getattr(self._local, "running", None)
        if running is not None:
            return running[1]
        if threading.get_ident() == self.compute_thread:
            return self.main_host
        host = getattr(self._local, "host", None)
        if host is None:
            host = self._local.host = {}
        return host

    def _stream_clock(self, stream: str) -> Clock:
        """``stream``'s clock as work is enqueued on it now: after all the enqueuing thread has seen complete."""
        clock = self.clocks.setdefault(stream, {})
        _merge(clock, self._host_clock())
        return clock

    def enqueued(self, stream: str, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` enqueued on ``stream`` now: it runs later on the stream's thread, ordered by the stream's clock
        as it stands here."""
        with self._lock:
            clock = self._stream_clock(stream)
            clock[stream] = clock.get(stream, 0) + 1
            taken = dict(clock)
        issued = _where() if self.stacks else ""

        def run() -> object:
            self._local.running = (stream, taken)
            self._local.issued = issued
            _push_mode(_Mode(self))
            try:
                return fn()
            finally:
                _pop_mode()
                self._local.running = None
                with self._lock:  # what it waited for, its stream's later records carry (``reached``)
                    _merge(self._ran.setdefault(stream, {}), taken)
        return run

    def reached(self, event: object, stream: str) -> None:
        """``stream``'s thread reached ``event``'s record: it completes after all the work before it ran, and
        after every wait that work made on the way."""
        with self._lock:
            clock = self._events.get(id(event))
            if clock is not None:
                _merge(clock, self._ran.get(stream, {}))

    def recorded(self, event: object, stream: str | None) -> None:
        """``event`` recorded on ``stream`` (None: the compute stream) at this point of its order."""
        with self._lock:
            clock = self._stream_clock(stream) if stream is not None else self.clocks[COMPUTE]
            self._events[id(event)] = dict(clock)

    def waited(self, event: object, stream: str | None = None) -> None:
        """``stream`` waits for ``event`` (a wait enqueued there); None: the calling thread blocked until it
        completed, so what it does next, and the compute stream's work it issues, comes after it."""
        with self._lock:
            clock = self._events.get(id(event))
            if clock is None:
                return
            if stream is not None:
                _merge(self._stream_clock(stream), clock)
                return
            if getattr(self._local, "stream_wait", False):
                return
            _merge(self._host_clock(), clock)
            if threading.get_ident() == self.compute_thread and getattr(self._local, "running", None) is None:
                _merge(self.clocks[COMPUTE], clock)

    @contextlib.contextmanager
    def compute_waits(self, event: object) -> Iterator[None]:
        """The compute stream waits for ``event``: a stream's wait on a GPU, where the host goes on (the emulated
        device blocks the thread inside, which orders nothing more here)."""
        with self._lock:
            clock = self._events.get(id(event))
            if clock is not None:
                _merge(self.clocks[COMPUTE], clock)
        self._local.stream_wait = True
        try:
            yield
        finally:
            self._local.stream_wait = False

    # ------------------------------------------------------------------ the accesses

    def _agent(self) -> tuple[str, Clock] | None:
        running = getattr(self._local, "running", None)
        if running is not None:
            return running
        if threading.get_ident() != self.compute_thread:
            return None
        clock = self.clocks[COMPUTE]
        clock[COMPUTE] += 1
        return COMPUTE, clock

    def op(self, func: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object],
           out: object) -> None:
        if self.closed:
            return
        with self._lock:
            agent = self._agent()
            if agent is None or func.is_view:  # a view touches no data
                return
            name, clock = agent
            reads, writes = _accessed(func, args, kwargs)
            inputs = {m[0] for m in reads + writes}
            fresh = [m for m in _memories(out) if m[0] not in inputs]
            for m in fresh:  # a new allocation: its memory's history starts here
                self._accesses.pop(m[0], None)
            if func in _NO_ACCESS:
                return  # allocated (on a GPU, from the pool of the stream that asked), not written
            for m in reads:
                self._access(m, False, name, clock, func)
            for m in writes + fresh:
                self._access(m, True, name, clock, func)

    def _access(self, memory: _Memory, write: bool, agent: str, clock: Clock, op: torch._ops.OpOverload) -> None:
        key, start, end = memory
        if key in _HOST:
            return
        history = self._accesses.setdefault(key, {})
        for a in history.values():
            if a.agent != agent and a.start < end and start < a.end and (write or a.write) \
                    and clock.get(a.agent, 0) < a.tick:
                raise StreamOrderError(
                    f"{agent} {'writes' if write else 'reads'} device bytes [{start:#x}, {end:#x}) in {op}"
                    f"{self._issued(agent)} that "
                    f"{a.agent} {'wrote' if a.write else 'read'} in {a.op}{a.where} with no wait for it between "
                    f"them: on a GPU the two may run in either order (its access {a.tick} of {a.agent}'s order, "
                    f"{agent} ordered after {clock.get(a.agent, 0)}; see [Note: stream order checked])")
        slot = (agent, start, end, write)  # an agent's latest access of one kind to the same bytes is what counts
        history.pop(slot, None)
        history[slot] = _Access(start, end, agent, clock.get(agent, 0), write, op, self._issued(agent))

    def _issued(self, agent: str) -> str:
        """Where the access running now was issued (``stacks`` only): a stream's work where it was enqueued, the
        compute stream's op here."""
        if not self.stacks:
            return ""
        return f" (issued at {getattr(self._local, 'issued', '') if agent != COMPUTE else _where()})"


_NO_ACCESS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.detach.default, torch.ops.aten.set_.source_Storage_storage_offset,
              torch.ops.aten.resize_.default}

# by op: (position, name, written) of each argument that can hold a tensor, read once from its schema
_PLANS: dict[torch._ops.OpOverload, tuple[tuple[int, str, bool], ...]] = {}


def _plan(func: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    plan = _PLANS.get(func)
    if plan is None:
        plan = _PLANS[func] = tuple(
            (i, arg.name, arg.alias_info is not None and arg.alias_info.is_write)
            for i, arg in enumerate(func._schema.arguments) if "Tensor" in str(arg.type))
    return plan


def _memories(value: object) -> list[_Memory]:
    """The memory of each tensor in ``value`` (a tensor, None, or a nest of them)."""
    if value is None:
        return []
    memories = []
    for t in [value] if isinstance(value, torch.Tensor) else tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and (m := _memory(t)) is not None:
            memories.append(m)
    return memories


def _accessed(func: torch._ops.OpOverload, args: tuple[object, ...],
              kwargs: dict[str, object]) -> tuple[list[_Memory], list[_Memory]]:
    """The memory ``func`` reads and that it writes, by its schema."""
    reads: list[_Memory] = []
    writes: list[_Memory] = []
    for i, name, written in _plan(func):
        (writes if written else reads).extend(_memories(args[i] if i < len(args) else kwargs.get(name)))
    return reads, writes


class _Mode(TorchDispatchMode):
    def __init__(self, check: StreamCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.check.op(func, args, kwargs, out)
        return out


_ACTIVE: StreamCheck | None = None


def start() -> StreamCheck | None:
    """A check for a new emulated device, on its thread, where ``OFFLOAD_EMULATED_STREAM_CHECK`` asks for one (an
    older engine's stops: one check follows the process's streams at a time), else None."""
    global _ACTIVE
    if not wanted():
        return None
    if _ACTIVE is not None:
        _ACTIVE.close()
    _ACTIVE = StreamCheck()
    return _ACTIVE


def active() -> StreamCheck | None:
    """The check following the streams now, if any."""
    return _ACTIVE if _ACTIVE is not None and not _ACTIVE.closed else None


def host_memory(tensor: torch.Tensor, owner: object) -> None:
    """``tensor``'s storage is host memory, not checked (see the note), until ``owner`` (what keeps the memory
    mapped) is collected."""
    if wanted():
        key = _storage(tensor)
        _HOST.add(key)
        weakref.finalize(owner, _HOST.discard, key)


def _where() -> str:
    """The engine's frames of the calling stack, innermost last."""
    frames = [f for f in traceback.extract_stack() if "/offload/" in f.filename and "stream_check" not in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/offload/', 1)[1]}:{f.lineno}" for f in reversed(frames[-6:]))
