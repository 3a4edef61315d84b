"""Parameter shards whose home is NVMe (offload_param: nvme): two slots per unit, a bounded set of host
buffers that reads land in, and read-ahead in the order the prefetch trace predicts.

[Note: parameter slots] Each unit's compute-dtype shard has two slots in the rank's
parameter swap file (offload/store/two_slots.py). Gathers read the current slot; the step
writes each new shard to the other slot, and ``commit`` makes them current once every
write of the step has completed. A step that fails before its optimizer state is committed discards what it
wrote (``abort``), so the last completed step stays readable. A parameter write that
fails after the optimizer state was committed leaves that unit *stale*: its master
weights are ahead of its 16-bit copy, and the engine rewrites it from them
(``overwrite``) before any forward can gather it, so stale values are never used.

[Note: read buffers] A read lands in one of ``buffer_count`` host buffers (pinned with
a GPU, so the copy to the device is asynchronous). A buffer is FREE, READING (a read in
flight), READY (holds a unit's current values, not used yet) or COPYING (the
host-to-device copy that reads it may still run; free again once its event has). A
COPYING buffer still holds its unit's values, so a unit used again soon (the last
blocks of forward are the first of backward) is copied again without a second read.
Read-ahead takes only buffers that are free now and never waits. A fetch for use now
takes the unit's own buffer if read-ahead started one, else a free one, else waits
for the oldest copy, else drops the read-ahead the trace guessed furthest out (a wasted
read, never a wrong value). Which units are read ahead is rank-local: the gathers
(collectives) stay in the same order on every rank whatever the disk does.

The step's new shards go through write buffers of their own, so a step overlapped with
backward (on the host thread) never waits for a buffer that the training thread holds.

[Note: an early step's parameter writes] With an early step (``offload.early_step: on``)
the landing worker steps the units after engine.step() returned, in the forward's order,
and each unit's new shard becomes current alone once written (``commit_unit``), before
the unit's step event fires. Before returning, the training thread ``forget``s what the
read buffers hold of the units being stepped; a gather of a unit waits for its step
first, and read-ahead skips units whose step has not run yet (the runtime asks the
parameter store), so no read ever sees the slot the step is replacing; each such unit
keeps a read buffer free for itself (a read of a later unit taking it would be dropped
when the skipped one is needed, its wait and its read wasted). A write that
fails leaves that unit stale, and the read that meets it first has the engine rewrite it
from its master weights (``ParamStore.prepare`` says it is stale, and the runtime asks the
optimizer's ``repair_stale``; on this rank alone, no collective, after the step's other writes),
so the step stands and the forward goes on.
"""

from __future__ import annotations

import enum
import math
import os
import threading
from dataclasses import dataclass, field

import torch

from offload.aio.base import Request, RequestGroup, SwapIOError, wait_quietly
from offload.machine.accelerator import Event
from offload.machine.buffers import AlignedBuffer, BufferPool
from offload.observe.sync_ledger import SyncLedger
from offload.observe.telemetry import Telemetry
from offload.store.param_homes import WRITE_BUFFERS, param_buffer_bytes, plan_homes
from offload.store.swapdir import TierRoom
from offload.store.two_slots import TwoSlotFile


class BufferState(enum.Enum):
    FREE = "free"
    READING = "reading"
    READY = "ready"
    COPYING = "copying"


@dataclass(eq=False)
class ReadBuffer:
    memory: AlignedBuffer
    state: BufferState = BufferState.FREE
    unit: int | None = None
    request: Request | None = None
    copied: Event | None = None  # the host-to-device copy reading it (COPYING)
    order: int = 0  # when it was last taken: the oldest copy is waited for first, the newest read-ahead dropped


@dataclass
class ParamSwapStats:
    reads_ahead: int = 0  # reads issued by read-ahead
    reads_on_demand: int = 0  # reads a gather had to start itself
    wasted_reads: int = 0  # reads dropped unused (a wrong guess, or values a step replaced)
    waits: int = 0  # fetches that found their read still in flight
    reuses: int = 0  # fetches served by a buffer still holding the unit from its last use
    stale: set[int] = field(default_factory=set)


class ParamSwapError(SwapIOError):
    """New parameter shards could not be written after the optimizer state was committed."""


class ParamSwap:
    """Owns the parameter swap file of one rank, its read and write buffers, and every unit's two slots."""

    def __init__(self, sizes: list[tuple[int, int]], dtype: torch.dtype, room: TierRoom, *, pin: bool,
                 telemetry: Telemetry | None = None, ledger: SyncLedger | None = None) -> None:
        """``sizes``: (unit index, shard elements) of the units homed on NVMe, within ``room`` (the placement plan
        checked its budgets: offload/store/placement.py)."""
        if room.swap is None:
            raise ValueError("parameter shards on NVMe need a swap directory and an I/O engine (TierRoom.swap)")
        swap, rank, host, nvme, buffer_count = room.swap, room.rank, room.host, room.nvme, room.buffer_count
        self.dtype = dtype
        self.telemetry = telemetry or Telemetry()
        self.ledger = ledger or SyncLedger()  # the accelerator's: every wait here is a host block
        self.homes, offset = plan_homes(sizes, dtype.itemsize)
        largest = max(h.nbytes for h in self.homes.values())
        buffers = param_buffer_bytes([h.numel for h in self.homes.values()], dtype.itemsize, buffer_count)
        nvme.take(offset, "parameter shards (two slots per unit)")
        host.take(buffers, "parameter NVMe buffers")
        swap_dir, engine = swap
        self.file = TwoSlotFile(engine, swap_dir, f"params-rank{rank}.swap",
                                [(unit, home.nbytes) for unit, home in self.homes.items()])
        self._pool = BufferPool(buffers, pin=pin, name="parameter NVMe buffers")
        self._reads = [ReadBuffer(self._pool.acquire(largest)) for _ in range(buffer_count)]
        self._writes: list[tuple[AlignedBuffer, int | None, RequestGroup | None]] = [
            (self._pool.acquire(largest), None, None) for _ in range(WRITE_BUFFERS)]
        self._next_write = 0
        self._staged: dict[int, int] = {}  # unit -> write buffer holding its new shard
        self._written: list[int] = []  # units whose new shard went to the other slot this step
        self._failed: dict[int, SwapIOError] = {}
        self._lock = threading.Lock()  # the host thread writes while the training thread reads
        self._taken = 0
        self._next_use: dict[int, int] = {}  # unit -> position in the upcoming order last given to read_ahead
        self.stats = ParamSwapStats()

    # ----------------------------------------------------------------- reads

    def _holding(self, unit: int) -> ReadBuffer | None:
        """The buffer that holds (or is reading) the unit's current values, if any."""
        for b in self._reads:
            if b.unit == unit and b.state is not BufferState.FREE:
                return b
        return None

    def _distance(self, b: ReadBuffer) -> float:
        """How far ahead the unit a buffer still holds is needed again (Belady: evict the furthest)."""
        return math.inf if b.unit is None else self._next_use.get(b.unit, math.inf)

    def _take(self, wait: bool, before: float = math.inf) -> ReadBuffer | None:
        """A buffer to read into. Without ``wait`` only one free now whose values are not needed before position
        ``before`` of the upcoming order; with it, waits for a copy or drops a read-ahead if it must."""
        usable = [b for b in self._reads if self._usable(b)]
        if usable:
            b = max(usable, key=self._distance)
            if wait or self._distance(b) > before:
                return self._claim(b)
        if not wait:
            return None
        copying = [b for b in self._reads if b.state is BufferState.COPYING]
        if copying:
            b = max(copying, key=lambda b: (self._distance(b), -b.order))
            assert b.copied is not None
            self.ledger.block("parameter buffer copied")
            b.copied.synchronize()
            return self._claim(b)
        b = max(self._reads, key=lambda b: b.order)  # the read-ahead guessed furthest out
        self._drop(b)
        return self._claim(b)

    @staticmethod
    def _usable(b: ReadBuffer) -> bool:
        """Whether a read could take ``b`` now without waiting or dropping anything."""
        return b.state is BufferState.FREE or (
            b.state is BufferState.COPYING and b.copied is not None and b.copied.query())

    def _claim(self, b: ReadBuffer) -> ReadBuffer:
        self._taken += 1
        b.state, b.unit, b.request, b.copied, b.order = BufferState.FREE, None, None, None, self._taken
        return b

    def _drop(self, b: ReadBuffer) -> None:
        if b.state is BufferState.READING and b.request is not None:
            self.ledger.block("parameter read dropped")  # a read-ahead guessed wrong: its buffer is needed now
            wait_quietly(b.request)
        if b.state in (BufferState.READING, BufferState.READY):
            assert b.unit is not None  # a read is always of a unit
            self.stats.wasted_reads += 1
            self.telemetry.add_bytes("nvme_read_wasted", self.homes[b.unit].nbytes)  # counted in nvme_read too
        b.state, b.unit, b.request = BufferState.FREE, None, None

    def _start_read(self, b: ReadBuffer, unit: int) -> None:
        home = self.homes[unit]
        b.unit, b.state = unit, BufferState.READING
        b.request = self.file.read(unit, b.memory.tensor)
        self.telemetry.add_bytes("nvme_read", home.nbytes)

    def read_ahead(self, units: list[int], skip: set[int] | frozenset[int] = frozenset(),
                   later: set[int] | frozenset[int] = frozenset()) -> int:
        """Start reads for ``units`` (the upcoming order; those homed here, not in ``skip`` and not already held)
        while buffers are free now, never evicting values needed sooner; never waits. Returns how many. A unit in
        ``later`` (an early step is still writing it) cannot be read yet but will need a buffer before the units
        after it: each keeps one free, or its read, when it comes, drops a read of a unit needed after it."""
        self._next_use = {}
        for position, unit in enumerate(units):
            self._next_use.setdefault(unit, position)
        started = reserved = 0
        for position, unit in enumerate(units):
            if unit not in self.homes or unit in skip or unit in self.stats.stale or self._holding(unit) is not None:
                continue
            if unit in later:
                reserved += 1
                continue
            if reserved and sum(map(self._usable, self._reads)) <= reserved:
                break
            b = self._take(wait=False, before=position)
            if b is None:
                break
            self._start_read(b, unit)
            started += 1
        self.stats.reads_ahead += started
        return started

    def start(self, unit: int) -> ReadBuffer:
        """Make sure the unit's read is in flight (it is needed now: waits for a buffer if it must)."""
        if unit in self.stats.stale:
            raise RuntimeError(f"unit {unit}'s parameter shard on NVMe is stale (its last write failed, perhaps "
                               "after an early step returned); the engine rewrites it from the master weights before "
                               "the next forward, so run the forward again")
        b = self._holding(unit)
        if b is None:
            b = self._take(wait=True)
            assert b is not None
            self._start_read(b, unit)
            self.stats.reads_on_demand += 1
        return b

    def fetch(self, unit: int) -> ReadBuffer:
        """The unit's current values in a host buffer (waits for its read); give it back with ``copied``."""
        b = self.start(unit)
        if b.state is BufferState.COPYING:  # its values are still there from the last use
            self.stats.reuses += 1
            b.state = BufferState.READY
        if b.state is BufferState.READING:
            assert b.request is not None
            if not b.request.done():
                self.stats.waits += 1
            try:
                with self.telemetry.span("param_wait", str(unit)):
                    self.ledger.block("parameter read")
                    try:
                        b.request.wait()
                    except SwapIOError:  # a read-ahead failed: read once more now, and report it if that fails too
                        self._start_read(b, unit)
                        self.stats.reads_on_demand += 1
                        b.request.wait()
            except BaseException:
                b.state, b.unit, b.request = BufferState.FREE, None, None
                raise
            request = b.request
            if request.finished_at is not None:
                self.telemetry.interval("param_read", str(unit), request.submitted_at, request.finished_at, "nvme")
            b.state = BufferState.READY
        return b

    @property
    def gather_ahead(self) -> int:
        """How many NVMe-homed units a gather may run ahead of use: half the read buffers (at least one)."""
        return max(1, len(self._reads) // 2)

    def view(self, b: ReadBuffer) -> torch.Tensor:
        assert b.unit is not None
        return b.memory.view(self.dtype, self.homes[b.unit].numel)

    def copied(self, b: ReadBuffer, event: Event) -> None:
        """The copy that reads ``b`` has been issued; the buffer is reused once ``event`` completes."""
        b.state, b.copied, b.request = BufferState.COPYING, event, None

    def read_copy(self, unit: int) -> torch.Tensor:
        """A fresh host tensor with the unit's current values (checkpoints, exports)."""
        b = self.fetch(unit)
        out = self.view(b).clone()
        if b.copied is not None:  # a copy issued earlier may still read it
            b.state = BufferState.COPYING
        else:
            b.state, b.unit, b.request = BufferState.FREE, None, None
        return out

    # ----------------------------------------------------------------- writes

    def stage(self, unit: int) -> torch.Tensor:
        """A host buffer for the unit's new shard (waits until that buffer's previous write is done)."""
        with self._lock:
            i = self._next_write
            self._next_write = (i + 1) % len(self._writes)
            memory, previous, pending = self._writes[i]
            self._writes[i] = (memory, None, None)
            self._staged[unit] = i
        if pending is not None:
            self._settle(previous, pending)
        return memory.view(self.dtype, self.homes[unit].numel)

    def write(self, unit: int) -> None:
        """Write the staged new shard to the unit's other slot (see [Note: parameter slots])."""
        home = self.homes[unit]
        with self._lock:
            i = self._staged.pop(unit)
            memory = self._writes[i][0]
        request = self.file.write_next(unit, memory.tensor)
        with self._lock:
            self._writes[i] = (memory, unit, request)
            self._written.append(unit)
        self.telemetry.add_bytes("nvme_write", home.nbytes)

    def _settle(self, unit: int | None, pending: RequestGroup) -> None:
        with self.telemetry.span("nvme_wait", "param-write"):
            self.ledger.block("parameter written")
            try:
                pending.wait()
            except SwapIOError as e:
                if unit is not None:
                    with self._lock:
                        self._failed[unit] = e

    def _settle_all(self) -> None:
        for i, (memory, unit, pending) in enumerate(list(self._writes)):
            if pending is not None:
                self._settle(unit, pending)
                self._writes[i] = (memory, None, None)

    def commit(self) -> None:
        """Every write of the step is done: make the new shards current. Units whose write failed become
        stale (their master weights are ahead) and the first failure is raised as ParamSwapError."""
        self._settle_all()
        with self._lock:
            written, failed = self._written, self._failed
            self._written, self._failed = [], {}
        for unit in written:
            if unit not in failed:
                self.file.flip(unit)
                self.stats.stale.discard(unit)
        self._invalidate(set(written))
        if failed:
            self.stats.stale.update(failed)
            first = next(iter(failed.values()))
            raise ParamSwapError(first.errno or 0, first.path, first.offset, first.length, "write",
                                 f"{os.strerror(first.errno or 0)} ({len(failed)} unit shard(s) not written)")

    def forget(self, units: set[int] | frozenset[int]) -> None:
        """An early step will write ``units``' new shards: what the read buffers hold of them is old (see [Note: an
        early step's parameter writes]). On the training thread, before the step returns."""
        self._invalidate(units)

    def commit_unit(self, unit: int) -> None:
        """An early step wrote ``unit``'s new shard: once written it becomes current on its own; a write that
        failed leaves the unit stale (its master is ahead), for the engine to rewrite before it is read."""
        pending = None
        with self._lock:
            for i, (memory, written, request) in enumerate(self._writes):
                if written == unit and request is not None:
                    pending, self._writes[i] = request, (memory, None, None)
        if pending is not None:
            self._settle(unit, pending)
        with self._lock:
            self._written.remove(unit)
            error = self._failed.pop(unit, None)
            if error is not None:
                self.stats.stale.add(unit)  # the training thread may be copying the set
                return
        self.file.flip(unit)

    def stale_units(self) -> set[int]:
        """Units whose last write failed (see [Note: parameter slots])."""
        with self._lock:
            return set(self.stats.stale)

    def abort(self) -> None:
        """The step failed before its optimizer state was committed: forget what it wrote."""
        self._settle_all()
        with self._lock:
            self._written, self._failed = [], {}
            self._staged.clear()

    def overwrite(self, unit: int, values: torch.Tensor) -> None:
        """Make ``values`` the unit's shard now (a checkpoint load, or rewriting a stale unit)."""
        self.stage(unit).copy_(values)
        self.write(unit)
        self._settle_all()
        with self._lock:
            self._written.remove(unit)
            error = self._failed.pop(unit, None)
        if error is not None:
            raise error
        self.file.flip(unit)
        self.stats.stale.discard(unit)
        self._invalidate({unit})

    def _invalidate(self, units: set[int] | frozenset[int]) -> None:
        """Reads of ``units`` hold values a write replaced."""
        for b in self._reads:
            if b.unit in units and b.state in (BufferState.READING, BufferState.READY):
                self._drop(b)
            elif b.unit in units:
                b.unit = None  # COPYING: reusable once the copy is done, but no longer the unit's values

    def close(self) -> None:
        for b in self._reads:
            if b.state is BufferState.READING and b.request is not None:
                wait_quietly(b.request)
            if b.copied is not None:
                try:
                    b.copied.synchronize()
                except Exception:  # noqa: BLE001 - closing after a failure
                    pass
        for _, _, pending in self._writes:
            if pending is not None:
                wait_quietly(pending)
        self.file.close()
        for b in self._reads:
            self._pool.release(b.memory)
        for memory, _, _ in self._writes:
            self._pool.release(memory)
        self._reads.clear()
        self._writes.clear()


