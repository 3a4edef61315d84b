"""The accelerator room: the compute device, its copy streams and events, pinned allocation, memory stats.

[Note: emulated streams] A GPU is lent to this project rarely, so ordering bugs must
show up on CPU first. On a CPU-only machine a copy stream is a worker thread that
runs what is enqueued on it in submission order, and its events complete only when
that work has run. The engine's stream/event logic is therefore the same code on
both kinds of machine, and a missing wait shows up in a CPU test as a wrong result.
``OFFLOAD_EMULATED_COPY_DELAY_S`` makes every emulated operation sleep first, so tests
can make the worker lag far behind the main thread and a missing wait certain to bite;
``OFFLOAD_EMULATED_HOST_DELAY_S`` delays the host queues alone (on a GPU machine too).
The compute stream cannot lag here; ``OFFLOAD_EMULATED_STREAM_CHECK`` checks the order the streams promise
instead (see [Note: stream order checked] in stream_check.py).

A CPU compute device reads host memory in place, so the engine makes none of the
copies a GPU needs there (``host_is_device``; see [Note: host memory is the device's]
in store/param_store.py). ``OFFLOAD_EMULATED_DISCRETE_DEVICE=1`` (implied by a copy
delay) makes the CPU device behave as a separate memory instead: every copy a GPU
needs is made, on the emulated streams, so their ordering is tested here too.
``OFFLOAD_EMULATED_RATES`` (``host_gbps=135,h2d_gbps=53,...``) gives such a device the rates a GPU machine
would measure at start-up (offload/engine/rates.py): a CPU's own say nothing of a GPU's, and would make a test's
split depend on the box it runs on.

[Note: events re-recorded] An owner that records an event for the same purpose every step
(a shard's landing buffer is free, its copy back is done) passes its last one back,
``record(into=last)``, and gets it re-recorded instead of a new one, so a steady step makes
no events (the ledger counts those made: ``SyncLedger.events_made``). A re-recorded event
means "done up to the latest record", as on CUDA, where every wait issued later waits for
the new record. An emulated event counts its records: reaching an earlier one that is still
queued completes nothing, so re-arming an event whose last record is pending is safe. A
thread that meant to wait for an earlier record may wait for a later one: later, never
sooner, and never for work that could depend on its waiting.

Only the few lines under ``_Cuda*`` run on CUDA alone; everything else is shared.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from offload.machine import stream_check
from offload.machine.buffers import AlignedBuffer
from offload.machine.stream_check import StreamCheck
from offload.observe.step_graph import COMPUTE, Item, StepGraph, running_as, set_lane
from offload.observe.sync_ledger import Role, SyncLedger, acting_as


class Event(Protocol):
    """Completes when everything enqueued on its stream before it has run."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CopyStream(Protocol):
    """An ordered queue of copies beside the compute stream."""

    name: str

    def run(self, fn: Callable[[], object]) -> None:
        """Enqueue ``fn``; it runs after everything enqueued before it (on CUDA: its kernels do)."""

    def record(self, into: Event | None = None) -> Event:
        """An event that completes once everything enqueued so far has run: ``into`` (an event this kind of
        stream made, which its owner records for the same purpose each time) re-recorded, else a new one (see
        [Note: events re-recorded])."""

    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts only after ``event`` completes."""

    def synchronize(self) -> None:
        """Block until everything enqueued has run; re-raises the first failure."""

    def close(self) -> None: ...


class StreamError(RuntimeError):
    """Work enqueued on a stream failed; raised where its result is waited for."""


# --------------------------------------------------------------------------- CPU: emulated


def _waited(event: Event) -> None:
    """The calling thread saw ``event`` complete: the stream order's check, where one runs, takes it in."""
    check = stream_check.active()
    if check is not None:
        check.waited(event)


class DoneEvent:
    """An event that has already completed (recorded on a synchronous stream)."""

    def synchronize(self) -> None:
        _waited(self)  # a compute event: what the host issues after waiting for it comes after that compute

    def query(self) -> bool:
        return True


DONE = DoneEvent()  # one is enough: it carries no state


class MarkedDone(DoneEvent):
    """A completed compute-stream event that a recorded step graph can name (see [Note: recorded step graph])."""


class WorkEvent:
    """A collective's completion (torch.distributed Work) as an event a stream can wait for."""

    def __init__(self, work: object) -> None:
        self.work = work
        check = stream_check.active()
        if check is not None:  # a collective is ordered after the compute it was issued behind
            check.recorded(self, None)

    def synchronize(self) -> None:
        self.work.wait()  # type: ignore[attr-defined]
        _waited(self)

    def query(self) -> bool:
        return bool(self.work.is_completed())  # type: ignore[attr-defined]


_HELD_RECHECK_S = 0.05  # how often a waiter sends its stream's held work again while its event is pending


def send_held_for(event: Event | None) -> None:
    """What ``event``'s stream holds goes out now: before a recorded step graph notes a wait for it, so the held work
    is issued before the wait, not after it (see [Note: held hand-offs])."""
    stream = getattr(event, "_stream", None)
    if stream is not None and not event.query():  # type: ignore[union-attr]
        stream.flush()


class ThreadEvent:
    """Completes when the worker reaches its latest record; carries the worker's failure, if any."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._generation = 0  # of the latest record: an earlier one reached later completes nothing
        self._stream: WorkerStream | None = None  # whose records these are: held ones go out before a wait

    def _rearm(self) -> int:
        """A new record of this event: pending until the worker reaches it (returns its generation)."""
        with self._lock:
            self._generation += 1
            self._error = None
            self._done.clear()
            return self._generation

    def _complete(self, error: BaseException | None, generation: int = 0) -> None:
        with self._lock:
            if generation != self._generation:
                return  # re-recorded since: the latest record completes it
            self._error = error
            self._done.set()

    def synchronize(self) -> None:
        # Its latest record may be held back (see [Note: held hand-offs]), and may be re-armed held by another
        # thread while this one waits: send what is held again whenever the wait wakes without it.
        while not self._done.is_set():
            if self._stream is None:
                self._done.wait()
                break
            self._stream.flush()
            self._done.wait(_HELD_RECHECK_S)
        if self._error is not None:
            raise StreamError(f"work before this event failed: {self._error}") from self._error
        _waited(self)

    def query(self) -> bool:
        return self._done.is_set()


class WorkerStream:
    """A thread that runs enqueued callables in order: an emulated copy stream, or a host queue.

    After a failure the stream runs nothing more; every later event carries the error,
    so whoever waits learns of it, and nothing downstream uses a half-done copy.

    [Note: held hand-offs] Waking the thread costs the enqueuing thread more than the
    hand-off itself: on a 2-core VM about 60 us a wake-up, most of it the GIL passing to the
    woken thread and back while autograd's next hook waits for it (measured with `offload
    bench hooks`: 64 tiny units' landings, each waking the landing worker once). So a caller
    that hands over many small pieces of work (backward's hooks, one unit's landing each)
    may enqueue them ``held``: they wait in order, without waking the thread, until
    ``flush`` sends them as one batch. Anything enqueued not held first sends what is held,
    so the order is kept, and waiting for one of the stream's events sends it too, so no
    wait can hang on work that was never sent; a held record's event reads as pending.
    """

    def __init__(self, name: str, delay_s: float = 0.0, ledger: SyncLedger | None = None,
                 graph: StepGraph | None = None, check: StreamCheck | None = None) -> None:
        self.name = name
        self._delay_s = delay_s
        self._check = check  # the stream order checked (see [Note: stream order checked] in stream_check.py)
        self._ledger = ledger
        self._graph = graph
        self._synced: ThreadEvent | None = None  # synchronize()'s event, re-recorded
        # (kind, what, where it was issued in a recorded step graph, or None)
        self._queue: queue.SimpleQueue[tuple[str, object, Any]] = queue.SimpleQueue()
        self._held: list[tuple[str, object, Any]] = []  # enqueued held, not yet sent (see [Note: held hand-offs])
        self._held_lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"offload-{name}", daemon=True)
        self._thread.start()
        _LIVE_STREAMS.add(self)

    def _loop(self) -> None:
        set_lane(self.name)
        with acting_as(Role.WORKER):
            self._serve()

    def _serve(self) -> None:
        while True:
            kind, item, recorded = self._queue.get()
            if kind == "stop":
                return
            if kind == "batch":
                for held in item:  # type: ignore[attr-defined]
                    self._handle(*held)
            else:
                self._handle(kind, item, recorded)

    def _handle(self, kind: str, item: object, recorded: Any) -> None:
        if kind == "record":
            event, generation = cast("tuple[ThreadEvent, int]", item)  # what record() puts
            if recorded is not None and self._graph is not None:
                rid, issued = recorded
                self._graph.add(Item("record", record=rid, issued=issued))
            if self._check is not None:
                self._check.reached(event, self.name)
            event._complete(self._error, generation)
            return
        if self._error is not None:
            return
        try:
            if self._delay_s:
                time.sleep(self._delay_s)
            if kind == "wait":
                if recorded is not None and self._graph is not None:
                    send_held_for(item)  # type: ignore[arg-type]
                    rid, issued = recorded
                    self._graph.add(Item("wait", waits=[rid] if rid is not None else [], issued=issued))
                item.synchronize()  # type: ignore[attr-defined]
            else:
                with running_as(recorded):
                    item()  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - carried to the waiter
            self._error = e

    def _recording(self) -> StepGraph | None:
        return self._graph if self._graph is not None and self._graph.on else None

    def _put(self, item: tuple[str, object, Any], held: bool) -> None:
        with self._held_lock:  # under the lock, so what was held goes out before anything enqueued after it
            if held:
                self._held.append(item)
                return
            self._send_held()
            self._queue.put(item)

    def flush(self) -> None:
        """Send what was enqueued held (see [Note: held hand-offs]) as one batch."""
        with self._held_lock:
            self._send_held()

    def _send_held(self) -> None:
        """Under ``_held_lock``: what is held goes on the queue as one batch. In a recorded step graph it is issued
        here, by the sender (held work could not start before it was sent), not where it was enqueued."""
        if self._held:
            held, graph = self._held, self._recording()
            if graph is not None:
                point = graph.issue_point()
                held = [(kind, item, _issued_at(kind, recorded, point)) for kind, item, recorded in held]
            self._queue.put(("batch", held, None))
            self._held = []

    def run(self, fn: Callable[[], object], held: bool = False) -> None:
        graph = self._recording()
        if self._check is not None:
            fn = self._check.enqueued(self.name, fn)
        self._put(("run", fn, graph.issue_point() if graph else None), held)

    def record(self, into: Event | None = None, held: bool = False) -> ThreadEvent:
        if isinstance(into, ThreadEvent):
            event = into
        else:
            event = ThreadEvent()
            if self._ledger is not None:
                self._ledger.event_made(self.name)
        event._stream = self
        if self._check is not None:
            self._check.recorded(event, self.name)
        graph = self._recording()
        recorded = (graph.new_record(event), graph.issue_point()) if graph else None
        self._put(("record", (event, event._rearm()), recorded), held)
        return event

    def wait_event(self, event: Event, held: bool = False) -> None:
        if self._check is not None:
            self._check.waited(event, self.name)
        graph = self._recording()
        recorded = (graph.record_of(event), graph.issue_point()) if graph else None
        if not isinstance(event, DoneEvent) or recorded is not None:  # a marked one still orders the graph
            self._put(("wait", event, recorded), held)

    def synchronize(self) -> None:
        self._synced = self.record(self._synced)
        if self._graph is not None:
            self._graph.wait(self._synced)
        self._synced.synchronize()  # the stream order's check takes the wait in there

    def close(self) -> None:
        if self._thread.is_alive():
            self._put(("stop", None, None), held=False)
            self._thread.join()


def _issued_at(kind: str, recorded: Any, point: tuple[str, int]) -> Any:
    """A queued item's graph stamp with its issue point moved to ``point`` (a run's stamp is the point itself; a
    record's or a wait's is (record id, point))."""
    if recorded is None:
        return None
    return point if kind == "run" else (recorded[0], point)


# [Note: streams at exit] A script may end without closing its engine while a stream still has work queued
# (an overlapped step's Adam and copies back, say). Python then finalizes with the daemon thread inside a torch op,
# and the op's next GIL acquisition unwinds through C++ that may not unwind: the process aborts ("terminate called
# without an active exception"). So at exit every live stream runs what it was given and stops first (one waiting on
# another's event is released by it: the other keeps running until its own stop, which comes after all its work).
_LIVE_STREAMS: weakref.WeakSet[WorkerStream] = weakref.WeakSet()


@atexit.register
def finish_streams() -> None:
    """Every live stream runs what it was given, then stops (at exit; see [Note: streams at exit])."""
    for stream in list(_LIVE_STREAMS):
        stream.close()


# --------------------------------------------------------------------------- CUDA


class _CudaEvent:
    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def rerecord(self, stream: torch.cuda.Stream) -> _CudaEvent:
        self.event.record(stream)
        return self

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())


def _record_cuda(stream: torch.cuda.Stream, into: Event | None, ledger: SyncLedger | None,
                 name: str) -> _CudaEvent:
    """``into`` re-recorded (every wait issued later waits for the new record), else a new event."""
    if isinstance(into, _CudaEvent):
        return into.rerecord(stream)
    if ledger is not None:
        ledger.event_made(name)
    return _CudaEvent(stream)


class _CudaStream:
    def __init__(self, name: str, device: torch.device, ledger: SyncLedger | None = None,
                 urgent: bool = False) -> None:
        self.name = name
        # torch's priorities: lower is sooner; -1 is the highest one torch exposes.
        self.stream = torch.cuda.Stream(device=device, priority=-1 if urgent else 0)
        self._ledger = ledger

    def run(self, fn: Callable[[], object]) -> None:
        with torch.cuda.stream(self.stream):
            fn()

    def record(self, into: Event | None = None) -> _CudaEvent:
        return _record_cuda(self.stream, into, self._ledger, self.name)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, _CudaEvent):
            self.stream.wait_event(event.event)
        elif isinstance(event, WorkEvent):
            with torch.cuda.stream(self.stream):
                event.work.wait()  # type: ignore[attr-defined]  # NCCL: this stream waits, the host does not
        else:
            event.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()


# --------------------------------------------------------------------------- the room


@dataclass(frozen=True)
class MemoryStats:
    """Bytes on the compute device as its allocator sees them (CPU: not tracked, zeros)."""

    allocated: int
    peak_allocated: int
    reserved: int


def _emulated_rates(text: str) -> dict[str, float] | None:
    """``OFFLOAD_EMULATED_RATES`` read: name=GB/s pairs, comma-separated (None: not set)."""
    if not text.strip():
        return None
    rates = {}
    for pair in text.split(","):
        name, _, value = pair.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"OFFLOAD_EMULATED_RATES: {pair.strip()!r} is not name=GB/s (e.g. host_gbps=135)"
                             ) from None
    return rates


class Accelerator:
    """The compute device and everything that orders work on it."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported; offload runs on cuda or cpu")
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._delay_s = float(os.environ.get("OFFLOAD_EMULATED_COPY_DELAY_S", "0") or 0)
        # Host queues alone lag (the landing worker, and the early step on it); the device stays the host's memory.
        self._host_delay_s = float(os.environ.get("OFFLOAD_EMULATED_HOST_DELAY_S", "0") or 0) or (
            0.0 if self.is_cuda else self._delay_s)
        discrete = os.environ.get("OFFLOAD_EMULATED_DISCRETE_DEVICE", "0") not in ("", "0") or self._delay_s > 0
        self.host_is_device = not self.is_cuda and not discrete  # compute reads host memory where it lies
        self.emulated_rates = _emulated_rates(os.environ.get("OFFLOAD_EMULATED_RATES", "")) if discrete else None
        self._streams: list[CopyStream] = []
        self._host_buffers: list[AlignedBuffer] = []  # unpinned at close()
        self.ledger = SyncLedger()  # every host-blocking wait, by who waited (see [Note: sync ledger])
        # the streams' order checked on the emulated GPU where asked (see [Note: stream order checked])
        self.check = stream_check.start() if discrete and not self.is_cuda else None
        self.graph = StepGraph()  # off until a recording starts (see [Note: recorded step graph])

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    def copy_stream(self, name: str, urgent: bool = False) -> CopyStream:
        """A new copy stream (CUDA) or its emulation (CPU: see [Note: emulated streams]). ``urgent``: the forward
        waits for its copies (parameters coming in), so on a GPU its kernels go before those of normal streams
        (gradients going out) when both are queued."""
        stream: CopyStream = _CudaStream(name, self.device, self.ledger, urgent) if self.is_cuda else WorkerStream(
            name, self._delay_s, self.ledger, self.graph, self.check)
        self.graph.declare(name, "copy")
        self._streams.append(stream)
        return stream

    def copy_target(self, stream: CopyStream, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor ``stream`` fills and the compute stream then reads (a gathered shard).

        [Note: a copy's target in its stream's pool] Allocated on the compute stream, the tensor could take memory
        compute has just freed and may still be reading, so its copy had to wait for everything enqueued on compute
        so far: the gather of the next unit then waited for this unit's forward, and every gather sat on the
        critical path (the replay on the h100 preset: 60-72 ms a step of the 0.91B GPT). On a GPU it is allocated
        from the copy stream's pool instead (reused only by that stream's later copies, in its order) and marked as
        used by the compute stream (``record_stream``), so its memory goes back to the pool only once compute has
        passed the point where it was freed: the copy waits for nothing. Where a stream is emulated (CPU) the
        copy's closure holds the tensor, so nothing is reused early."""
        if isinstance(stream, _CudaStream):
            with torch.cuda.stream(stream.stream):
                out = torch.empty(numel, dtype=dtype, device=self.device)
            out.record_stream(torch.cuda.current_stream(self.device))
            return out
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_queue(self, name: str) -> WorkerStream:
        """An ordered host thread for CPU work that must wait on device events (e.g. gradient accumulation)."""
        stream = WorkerStream(name, self._host_delay_s, self.ledger, self.graph, self.check)
        self.graph.declare(name, "host")
        self._streams.append(stream)
        return stream

    def start_graph(self, **meta: Any) -> StepGraph:
        """Record the engine's work from now on (see [Note: recorded step graph]): on the emulated streams only,
        so on a CPU compute device that behaves as a discrete one (``OFFLOAD_EMULATED_DISCRETE_DEVICE=1``)."""
        if self.is_cuda or self.host_is_device:
            raise RuntimeError("a step graph is recorded on the emulated streams of a discrete CPU device: run on the "
                               "CPU with OFFLOAD_EMULATED_DISCRETE_DEVICE=1 set before the engine starts")
        self.graph.start(**meta)
        return self.graph

    def compute_event(self, into: Event | None = None) -> Event:
        """An event after everything enqueued on the compute stream so far (``into``: as ``CopyStream.record``)."""
        if self.is_cuda:
            return _record_cuda(torch.cuda.current_stream(self.device), into, self.ledger, "compute")
        if self.graph.on or self.check is not None:  # complete (CPU compute is synchronous), but a point named
            event = into if isinstance(into, MarkedDone) else MarkedDone()
            if self.graph.on:
                self.graph.add(Item("record", record=self.graph.new_record(event)), COMPUTE)
            if self.check is not None:
                self.check.recorded(event, None)
            return event
        return DONE  # CPU compute is synchronous: all of it has already run

    def compute_wait(self, event: Event | None) -> None:
        """Make later compute wait for ``event`` (CPU: block the main thread until it completes)."""
        if event is None:
            return
        if self.is_cuda and isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)
        else:
            if self.graph.on:
                send_held_for(event)
                self.graph.wait(event, COMPUTE)
            with self.check.compute_waits(event) if self.check is not None else contextlib.nullcontext():
                event.synchronize()  # a WorkEvent on CUDA: Work.wait makes the current stream wait

    def wait(self, event: Event, what: str) -> None:
        """Block the calling thread until ``event`` completes; ``what`` names it in the ledger. Every host-blocking
        wait of the engine goes through here, so the ledger sees it (see [Note: sync ledger])."""
        if event is DONE:  # work of a synchronous stream (CPU compute): already done, nothing to wait for
            return
        self.ledger.block(what)
        if self.graph.on:
            send_held_for(event)
            self.graph.wait(event)
        event.synchronize()  # the stream order's check takes the wait in there

    def drain(self, stream: CopyStream, what: str) -> None:
        """Block until everything enqueued on ``stream`` has run (re-raises its first failure); counted as ``wait``."""
        self.ledger.block(what)
        stream.synchronize()

    def read_scalars(self, values: torch.Tensor, what: str) -> list[float]:
        """A small device tensor's values in Python: one device-to-host sync on a GPU, counted in the ledger."""
        self.ledger.scalar_read(what)
        return [float(v) for v in values.tolist()]

    def host_buffer(self, numel: int, dtype: torch.dtype, dma: bool = True) -> tuple[torch.Tensor, AlignedBuffer]:
        """Page-aligned host memory, pinned when a GPU is the compute device and copies to or from it are
        asynchronous (``dma``); memory only host threads read (the optimizer's master weights and moments) stays
        pageable: pinning it would only lock its pages and slow the start. It lives until close(). The buffer comes
        back too, for its capacity (what budgets account)."""
        buf = AlignedBuffer(max(1, numel) * dtype.itemsize, pin=self.is_cuda and dma)
        self._host_buffers.append(buf)
        return buf.view(dtype, numel), buf

    def forget_host_buffer(self, tensor: torch.Tensor) -> int:
        """The host buffer ``tensor`` starts is no longer needed: it is freed (and unpinned) once its last view
        goes, not kept until close(); returns its capacity (what a budget took for it)."""
        for i, buf in enumerate(self._host_buffers):
            if buf.address == tensor.data_ptr():
                del self._host_buffers[i]
                return buf.capacity
        raise ValueError("not a host buffer of this accelerator")

    def total_bytes(self) -> int | None:
        """The device's memory (None on a CPU device, emulated or not)."""
        return torch.cuda.mem_get_info(self.device)[1] if self.is_cuda else None

    def free_bytes(self) -> int | None:
        """Device memory free now (None on a CPU device, emulated or not: nothing bounds it but the host)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.is_cuda else None

    def memory_stats(self) -> MemoryStats:
        if self.is_cuda:
            return MemoryStats(torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device),
                               torch.cuda.memory_reserved(self.device))
        return MemoryStats(0, 0, 0)

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        """Block until every stream's work has run: a whole-device wait, counted as one (a user's
        synchronize_checkpoint_boundary, benchmarks' timing)."""
        self.ledger.block("device synchronized")
        for stream in self._streams:
            stream.synchronize()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
        self._streams.clear()
        if self.check is not None:
            self.check.close()
        for buf in self._host_buffers:
            buf.release_pin()
        self._host_buffers.clear()


def to_device(value: Any, device: torch.device, cast: torch.dtype | None = None) -> Any:
    """``value`` with its tensors on ``device``; with ``cast`` (fp16.auto_cast) floating ones also in that dtype."""
    if isinstance(value, torch.Tensor):
        dtype = cast if cast is not None and value.is_floating_point() else value.dtype
        return value if value.device == device and value.dtype == dtype else \
            value.to(device, dtype, non_blocking=True)
    if isinstance(value, dict):
        return type(value)((k, to_device(v, device, cast)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_device(v, device, cast) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, cast) for v in value)
    return value
