"""The third lane of the optimizer step: sub-groups whose state is homed on the host, stepped on the compute device.

[Note: the streamed lane] Where the optimizer state is offloaded to the host, the host's Adam alone sets the pace of
the step once backward is done (on an H200, 0.28 ns an element against 0.15 for the bus both ways). The device can
step part of that state instead: each such sub-group's state (``offload.stream_state``: the units the next forward
needs first, placed in sub-groups of their own) is read up into the device's ring on a copy stream of its own, Adam
runs there in torch's kernels on the compute stream (the same update as a device-resident unit's: see [Note: Adam
on a discrete device] in offload/optim/adam.py), and the new state goes back down into its host home on a second
copy stream, with the new weights: into the device home, or down into a host home, whose next gather takes
them on the device instead ([Note: the hand-off] in offload/store/param_store.py). The units' gradients stay on
the device, as a device-stepped unit's do (``StateSplit.streamed``), so the norm and clipping see them where the
device lane's are. The device holds the
state of those in flight in a ring of ``RING_SLOTS`` (three) of the largest sub-group: each takes the next place
(wrapping round), once the copy back of what was there has run, so while a large sub-group is stepped and
written back the next smaller ones are already coming up (two fixed slots made every read wait for the copy
back two sub-groups before, and a first sub-group as large as an embedding held up all the rest, as the recorded
step showed). A read needs no gradient: from the last backward's first landing on, ``READ_PER_LANDING`` bytes of
the next sub-groups' state are read into the ring after each landing, behind the backward enqueued so far (as many
sub-groups as the ring holds beside what is still being written back; a large one, an embedding's, in pieces over
several landings), so the reads share the bus with backward's gathers rather than queue ahead of them; the step
steps them once the norm is known. Every read of a step comes after the last step's copies back (the state it
reads is theirs). Everything that reads the host state otherwise (checkpoints, the refit) drains the optimizer,
which waits for the copies back (``settle``). On a CPU compute device the host's memory is the device's: there is
nothing to stream, and the placement streams nothing there.

[Note: streamed steps deferred] A sub-group whose state is not in the ring yet when the step runs waits for its read,
which waits for a place in the ring, which waits for the copy back of what was there: stepped at once, its Adam
would hold the compute stream, and the next forward queued behind it, until the bus had done all of that. So where
``step()`` returns early (the early step), the sub-groups read ahead are stepped at once and the rest are deferred
(``defer``): each of their units' shards is marked due (``ParamStore.defer``), and whatever reads one first (the
next forward's gather, a checkpoint, the refit: every reader of a shard goes through the parameter store) steps
the deferred sub-groups in order up to its own, on the compute stream, behind the forward of the units before it.
``settle`` and the next step run whatever is still deferred (a unit the forward did not use). A first reader in
backward (a unit the forward did not use, gathered for backward or a checkpointed unit's recompute) steps them on
the autograd thread: its current stream there is the one the engine set for the node it runs (the stream its
forward ran on), so the step joins the compute stream's order as it would from the forward's thread.

[Note: NVMe state streamed] A streamed sub-group homed on NVMe (offload_optimizer.device nvme) goes through the host:
the step's NVMe pass reads it into a host buffer as it reads every NVMe sub-group, and hands it to the lane there
(``_through_host``). Its state goes up into the ring, Adam runs on the compute stream, and the new state comes
back down into the buffer; the host waits for that copy before the pass writes the buffer to the slot that is not
current. The new weights then leave through the parameter store's step target, read from the buffer's master as the
device lane reads its own, exactly where the host lane's Adam writes them: so a failed NVMe transfer leaves the step
as the host lane's leaves it (nothing current flips, the step can be retried), and a device home gets its new
weights once the step is committed (``StateSplit.through_host``: the optimizer's copies back). The pass runs in the
step, so such a step never returns early, and nothing is read ahead under backward: the pass steps its NVMe
sub-groups before the host ones, in ring places the reads ahead would hold. On NVMe the disk, not the host's Adam,
usually sets the pace, so ``auto`` streams none of it; a fixed share streams it where the host's Adam is slower.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TypeVar

import torch

from offload.machine.accelerator import Accelerator, CopyStream, Event
from offload.observe.telemetry import Telemetry
from offload.optim.hyper import Hyper
from offload.optim.shard_state import ShardPhase, ShardState
from offload.optim.update import ShardUpdate
from offload.store.param_store import ParamStore
from offload.store.state_format import StateSlot
from offload.store.sub_groups import RING_SLOTS, SubGroup
from offload.store.tier import Tier

READ_PER_LANDING = 128 << 20  # bytes of state read ahead after each landing of the last backward (see the note)
# Bytes of state a copy back's piece moves (its place in the ring free once it has run). Neither number moves the
# replayed step (the 0.91B GPT on the h100 preset, clipping on, docs/performance.md, session 48): pieces of 128 MiB,
# 256 MiB and 1 GiB, reads of 64, 128 and 256 MiB a landing all 309.3-309.5 ms a step, the host's Adam after
# backward being the critical path. (Session 44's 379.1 against 424.3 came from the replay's old, hash-ordered bus.)
COPY_PIECE = 1 << 30

_Copied = TypeVar("_Copied", torch.Tensor, StateSlot)  # what a copy of the lane moves: a buffer, or a slot whole


@dataclass
class _Reading:
    """A sub-group's state on its way up in pieces: its slot in the ring (its place pinned), the elements read."""

    group: SubGroup
    slot: StateSlot
    done: int = 0


class StreamedStep:
    """The streamed sub-groups' step: their device ring, the copy streams each way, and the last copy back."""

    def __init__(self, accel: Accelerator, update: ShardUpdate, params: ParamStore, shards: dict[int, ShardState],
                 groups: list[SubGroup], telemetry: Telemetry) -> None:
        """``groups``: the streamed sub-groups (homed on the host), in the step's order; the ring holds ``RING_SLOTS``
        of the largest."""
        self.accel, self.update, self.params, self.shards, self.telemetry = accel, update, params, shards, telemetry
        self.groups = groups
        self._nvme = any(g.tier is Tier.NVME for g in groups)  # stepped in the step's pass: nothing read ahead
        self.up = accel.copy_stream("state-h2d")
        self.down = accel.copy_stream("state-d2h")
        self.slot_bytes = max(_placed(g) for g in groups)
        self._ring = torch.empty(RING_SLOTS * self.slot_bytes, dtype=torch.uint8, device=accel.device)
        self._head = 0  # where the next sub-group's state goes
        # the places whose copy back has been enqueued, oldest first: (start, end, the copy back's event)
        self._live: collections.deque[tuple[int, int, Event]] = collections.deque()
        self._ready: dict[int, tuple[StateSlot, Event]] = {}  # read ahead, not stepped: (its slot, its read)
        self._pinned: dict[int, tuple[int, int]] = {}  # the places of those: no read may take them
        self._last: Event | None = None  # the last copy back (what ``settle`` waits for)
        self._step = 0  # the step whose sub-groups are being read
        self._armed: int | None = None  # the step the last backward's landings read ahead for (None: not now)
        self._reading: _Reading | None = None  # the sub-group read in pieces now (its place pinned)
        self.read_per_landing, self.copy_piece = READ_PER_LANDING, COPY_PIECE
        # stepped when first read (see [Note: streamed steps deferred]): (sub-group, step, hypers, grad scale)
        self._deferred: collections.deque[tuple[SubGroup, int, list[Hyper], float]] = collections.deque()

    @property
    def device_bytes(self) -> int:
        return self._ring.numel()

    def read_ahead(self, step: int) -> None:
        """The last backward before step ``step`` begins: from its first landing on, the first sub-groups' state
        goes up (``read_next``). A step still deferred (a unit the forward did not read) runs first. With NVMe
        sub-groups nothing is read ahead: the step's pass steps them first, in places of the ring the reads ahead
        would hold (see [Note: NVMe state streamed])."""
        self.run_until()
        self._armed = None if self._nvme else step

    def read_next(self) -> None:
        """A gradient of the last backward landed: the next sub-group's state goes up (a read needs no gradient),
        if the ring holds it beside what is still being copied back, after the backward enqueued so far (whose
        gathers need the bus up first)."""
        if self._armed is None:
            return
        self.up.wait_event(self.accel.compute_event())
        budget = self.read_per_landing
        while budget > 0:
            if self._reading is None:
                # read already (or for a step that was skipped: the host state has not changed); an NVMe
                # sub-group's state is read by the step's pass, not ahead
                group = next((g for g in self.groups if g.index not in self._ready and g.tier is Tier.HOST), None)
                start = None if group is None else self._fits(_placed(group))
                if group is None or start is None:
                    self._armed = None  # every sub-group read, or the ring full until the step
                    return
                self._reading = self._begin(group, self._armed, start)
            budget -= self._read_some(budget)

    def step(self, group: SubGroup, step: int, hypers: list[Hyper], grad_scale: float) -> None:
        """One streamed sub-group's Adam: its state read up (unless read ahead), stepped on the compute stream, and
        written back with its units' new weights (see [Note: the streamed lane]); returns once it is enqueued. A
        sub-group homed on NVMe is in the step's pass buffer now: see [Note: NVMe state streamed]."""
        assert group.streamed and group.resident is not None, f"sub-group {group.index} is not streamed"
        if group.tier is Tier.NVME:
            assert self._reading is None and not self._ready, "nothing is read ahead beside NVMe sub-groups"
        self._armed = None
        device = self._stepped(group, step, hypers, grad_scale)
        if group.tier is Tier.NVME:
            self._through_host(group, device)
            return
        for member in group.members:  # the weights first: the next forward waits for them, not for the state
            weights = device.narrow(member.offset, member.numel).master
            if self.params.home(member.unit) is Tier.DEVICE:
                self.params.write_device(member.unit, weights)
            else:
                self.params.write_down(member.unit, weights, self.down)
                self.params.hand_off(member.unit, weights.to(self.params.dtype, copy=True))
        # The writes into a device home and the hand-off's copies read the ring on the compute stream after the
        # Adam: the copy back, which frees the place for the next read, waits for them too
        self.down.wait_event(self.update.after_compute())
        self._copy_back(group.resident, device, group.members[0].unit)

    def _stepped(self, group: SubGroup, step: int, hypers: list[Hyper], grad_scale: float) -> StateSlot:
        """``group``'s state in the ring (the rest of its read now, or all of it) and its Adam enqueued on the
        compute stream, which the copy stream down then waits for; returns its slot in the ring."""
        if group.index not in self._ready:
            if self._reading is None:
                self._reading = self._begin(group, step, self._place(_placed(group)))
            assert self._reading.group is group, "the streamed sub-groups are read in the order they are stepped"
            self._read_some(None)
        device, read = self._ready.pop(group.index)
        self._pinned.pop(group.index, None)
        self.accel.compute_wait(read)
        for member in group.members:
            assert self.shards[member.unit].phase is not ShardPhase.STEPPED, member.unit  # never stepped early
            self.update.step_shard(member.unit, device.narrow(member.offset, member.numel), step, hypers, grad_scale,
                                   publish=False)
        self.down.wait_event(self.update.after_compute())
        return device

    def _through_host(self, group: SubGroup, device: StateSlot) -> None:
        """An NVMe sub-group stepped (see [Note: NVMe state streamed]): its new state back down into the pass's
        buffer, the host waiting for that before the pass writes it; the new weights then go through the parameter
        store's step target, as the host lane's do."""
        host = group.resident
        assert host is not None
        self._copy_back(host, device, group.members[0].unit)
        assert self._last is not None
        self.accel.wait(self._last, "the streamed NVMe state's copy back")
        for member in group.members:
            self.params.step_target(member.unit).copy_(host.narrow(member.offset, member.numel).master)
            self.params.wrote(member.unit)

    def _copy_back(self, host: StateSlot, device: StateSlot, unit: int) -> None:
        """The new state down into its host home, buffer by buffer in pieces of ``COPY_PIECE`` bytes, each piece's
        place in the ring free once its own copy has run (``_live``): a read placed over the start of a large
        sub-group's place waits for the pieces it takes, not for the whole copy back."""
        base = self._ring.data_ptr()
        for target, source in zip(host.buffers(), device.buffers(), strict=True):
            per = max(1, self.copy_piece // max(1, source.element_size()))
            for lo in range(0, source.numel(), per):
                out = source[lo:lo + per]
                nbytes, first = out.numel() * out.element_size(), out.data_ptr() - base
                self._copy(self.down, "d2h", unit, target[lo:lo + per], out, nbytes)
                self._last = self.down.record()
                self._live.append((first, first + nbytes, self._last))

    @property
    def deferred(self) -> int:
        """Sub-groups deferred and not yet stepped."""
        return len(self._deferred)

    def ready(self, group: SubGroup) -> bool:
        """Whether ``group``'s state was read ahead (its step waits for no place in the ring)."""
        return group.index in self._ready

    def defer(self, group: SubGroup, step: int, hypers: list[Hyper], grad_scale: float) -> None:
        """``step`` of ``group`` is stepped (and its shards' gradients go) when one of its shards is first read
        (see [Note: streamed steps deferred]); sub-groups deferred are stepped in the order deferred."""
        self._deferred.append((group, step, hypers, grad_scale))
        for member in group.members:
            self.params.defer(member.unit, self)

    def run_due(self, unit: int) -> None:
        """A shard of ``unit`` is about to be read: the deferred sub-groups up to its own are stepped."""
        group = next((g for g, *_ in self._deferred if any(m.unit == unit for m in g.members)), None)
        if group is not None:
            self.run_until(group)

    def run_until(self, group: SubGroup | None = None) -> None:
        """Step the deferred sub-groups in order, up to ``group`` (None: all of them)."""
        while self._deferred:
            g, step, hypers, grad_scale = self._deferred.popleft()
            for member in g.members:
                self.params.defer(member.unit, None)
            self.step(g, step, hypers, grad_scale)
            for member in g.members:
                self.shards[member.unit].empty()
            if g is group:
                return

    def _begin(self, group: SubGroup, step: int, start: int) -> _Reading:
        """``group``'s read into the ring at ``start`` (free: ``_place`` waited; pinned from now), after the last
        step's copies back (the state read is the one they wrote)."""
        if step != self._step and self._last is not None:  # a step's first read
            self.up.wait_event(self._last)
        self._step = step
        self._pinned[group.index] = (start, start + _placed(group))
        return _Reading(group, group.fmt.slot(self._ring.narrow(0, start, _placed(group)), group.numel))

    def _read_some(self, budget: int | None) -> int:
        """The next elements of the sub-group being read go up, ``budget`` bytes of them at most (None: all the
        rest); once all have, it is ready (its place, its slot, the read's event). Returns the bytes."""
        reading = self._reading
        assert reading is not None
        group, host = reading.group, reading.group.resident
        assert host is not None
        left = group.numel - reading.done
        n = left if budget is None else max(1, min(left, budget * group.numel // max(1, _nbytes(reading.slot))))
        device, source = reading.slot.narrow(reading.done, n), host.narrow(reading.done, n)
        nbytes = _nbytes(device)
        self._copy(self.up, "h2d", group.members[0].unit, device, source, nbytes)
        reading.done += n
        if reading.done == group.numel:
            self._ready[group.index] = (reading.slot, self.up.record())
            self._reading = None
        return nbytes

    def _copy(self, stream: CopyStream, kind: str, unit: int, into: _Copied, out: _Copied, nbytes: int) -> None:
        """``into`` from ``out`` on ``stream`` (``kind``: h2d or d2h), counted as the state's bytes that way and as
        the recorded step's work (offload/observe/step_graph.py)."""
        graph = self.accel.graph

        def copy() -> None:
            graph.work(kind, unit, nbytes=nbytes)
            into.copy_(out, non_blocking=True)
        stream.run(copy)
        self.telemetry.add_bytes(f"state_{kind}", nbytes)

    def _fits(self, nbytes: int) -> int | None:
        """Where ``nbytes`` can go without taking a place read ahead and not yet stepped (None: nowhere now)."""
        start = self._head if self._head + nbytes <= self._ring.numel() else 0
        if any(s < start + nbytes and start < e for s, e in self._pinned.values()):
            return None
        return self._place(nbytes)

    def _place(self, nbytes: int) -> int:
        """The next place for ``nbytes`` in the ring (wrapping round), once the copies back of what was there have
        run: the up stream waits for the newest of them (the copy stream runs its copies back in order)."""
        start = self._head if self._head + nbytes <= self._ring.numel() else 0
        end = start + nbytes
        newest: Event | None = None
        while self._live and any(s < end and start < e for s, e, _ in self._live):
            newest = self._live.popleft()[2]
        if newest is not None:
            self.up.wait_event(newest)
        self._head = end
        return start

    def device_memory(self) -> torch.Tensor:
        """The ring: scratch between steps (settled), so lent back without its bytes."""
        return self._ring

    def drop(self, group: SubGroup) -> None:
        """``group`` leaves the lane (the refit moved its state to the device, between steps, settled); with the
        last one the ring is given back."""
        self.groups = [g for g in self.groups if g is not group]
        if not self.groups:
            self._ring = torch.empty(0, dtype=torch.uint8, device=self.accel.device)
            self._live.clear()
            self._head = 0

    def settle(self) -> None:
        """Block until every copy back has run: the host state (and host-homed weights) are the step's. What was
        read ahead is dropped (what reads the state next may change it: a checkpoint's load), its reads run out
        first (they read host memory that a load rewrites and a close gives back). Deferred steps run first."""
        self.run_until()
        if self._ready or self._reading is not None:
            self.accel.wait(self.up.record(), "the streamed state's reads ahead")
        self._armed = self._reading = None
        self._ready.clear()
        self._pinned.clear()
        if self._last is not None:  # the copy stream runs its copies in order: the last is after every other
            self.accel.wait(self._last, "the streamed state's copy back")


def _nbytes(slot: StateSlot) -> int:
    """Bytes a slot's buffers hold (what a copy of it moves)."""
    return sum(b.numel() * b.element_size() for b in slot.buffers())


def _placed(group: SubGroup) -> int:
    """Bytes ``group``'s state takes in the ring: its slot's, rounded up as the plan counts it (so every place
    starts aligned for any dtype's view)."""
    return group.nbytes
