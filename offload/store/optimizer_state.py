"""Where each sub-group's fp32 master weights and Adam moments live, and the pipelined pass over them.

A rank's optimizer state is cut into sub-groups of whole units' shards, up to
``sub_group_size`` elements each. A sub-group's master, exp_avg and exp_avg_sq are one
buffer (a ``StateSlot``: fp32 [3, n], or fewer bytes in another format, see
offload/store/state_format.py) whose home is a tier:
- ``device``: the compute device (no optimizer offload);
- ``host``: host memory, updated in place, no copies at all;
- ``nvme``: a swap file, read into one of ``buffer_count`` host buffers for the step.
With ``offload_optimizer.device: nvme`` and a host budget, the host keeps the first
sub-groups that fit in what the budget leaves and the rest go to NVMe.

[Note: the step pipeline] NVMe sub-groups are processed first, in backward's order
(the last units' sub-group first): the read of the next sub-group (and further, up to
the free buffers) is in flight while Adam runs on one, and its write-back starts as
soon as Adam is done with it; a buffer is read into again only after its write has
completed. Host sub-groups are processed after every NVMe write has completed.
``NvmePass`` holds one step's pass and its states.

[Note: reads ahead of the step] The step's first reads do not depend on the gradients,
so ``read_ahead`` issues them (as many as the buffers hold, in the pass's order: see
[Note: sub-groups packed into the buffers]) when the last micro-batch's backward begins,
and the pass takes them over: with up to buffer_count NVMe sub-groups (DeepSpeed's
defaults, sub_group_size 1e9 and 4 buffers, cover 4B parameters per rank), or small ones
that fit together, every read of the step hides under backward. Anything else that
uses the buffers (a master read, a checkpoint, building) first waits for them and drops
them; nothing writes a current slot while they are in flight.

[Note: NVMe sub-groups stepped during backward] In an overlapped backward (see
offload/optim/sharded.py) the host thread reports each unit whose last gradient has
landed (``arrive``); once every unit of the pass's next sub-group has, that sub-group is
taken (its read began when backward did), stepped and written back right there, and
the pass goes on with the next. Backward produces gradients from the last unit to the
first, the pass's order, so with sub_group_size well below a rank's state most NVMe
reads, steps and writes happen under backward; what has not completed by its end
(the first units' sub-groups, or any whose unit got no gradient) continues in
engine.step(). The new slots still become current only when the whole pass has
written, so a step that fails afterwards is retried from the last completed state (the
sub-groups stepped during backward are stepped again, to the same values).

[Note: the speculative slot] With the speculative step (see [Note: speculative step] in
offload/optim/speculation.py) every host sub-group has a second buffer of the same shape,
``spare``. Adam for a speculated unit reads the current slot and writes the other, so
the state of the last completed step stays intact until the step's factor is known;
``flip`` then makes the other slot current for that unit. Which slot is current is
kept per unit (``in_spare``), so units flip one at a time, as the early step reaches
them; every reader goes through ``views``, which follows it.

[Note: the weights are the high half] A 16+16 master (offload/store/state_format.py) is the bf16 weights and a
16-bit low half. Where a host sub-group's units keep their weights in host memory that the step writes in place
(the parameter store's host shards: a host home, or a device home's host copy), the sub-group holds the low halves
and the moments alone, and each unit's high half is lent to it (``lend_high``): the kernel updates the weights and
the master in one write, 6 bytes of state an element with bf16 moments instead of 8, and nothing more to copy. Not
where a step writes into a second place before it counts (the speculative slot, the delayed update's staging), nor
for NVMe state or NVMe-homed weights: there the high half is held in the state, beside the weights' copy, as exact
but no smaller. A unit whose state the refit moves to the device (``auto``) takes its high half back: the device's
state holds all of it, copied from the weights before the parameter store moves them there (or drops their host
copy), as the units that start on the device hold theirs.

[Note: a failed step loses nothing] Each NVMe sub-group has two slots in the swap
file; a step reads the slot holding the last completed step and writes the other, and
flips which slot is current only when every write of the step has completed. Host
state is touched only after that. A read or write that fails (disk full, I/O error, a
checksum mismatch) therefore leaves the state of the last completed step intact and
readable, and the step can be retried.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from offload.aio.base import Request, RequestGroup, wait_quietly
from offload.machine.accelerator import Accelerator
from offload.machine.buffers import AlignedBuffer, BufferPool
from offload.observe.sync_ledger import SyncLedger
from offload.observe.telemetry import Telemetry
from offload.store.slots import layout
from offload.store.state_format import FP32, StateSlot
from offload.store.sub_groups import SPECULATIVE_SLOT, Member, StatePlacement, SubGroup, nvme_buffers
from offload.store.swapdir import TierRoom
from offload.store.tier import Tier
from offload.store.two_slots import TwoSlotFile

logger = logging.getLogger("offload.store")

class CommitPoint(Protocol):
    """Where the step's pass asks whether it may make its new state current: the ranks' vote (offload/zero/
    collectives.py's ``Vote``), whose ``commit`` raises to stop the step there."""

    def commit(self) -> None: ...


class OptimizerStateStore:
    """Owns every sub-group's master/moment buffer on its tier, and the pass that the step runs over them."""

    def __init__(self, groups: list[SubGroup], room: TierRoom, *, accel: Accelerator,
                 telemetry: Telemetry | None = None, spare: bool = False) -> None:
        """``groups``: the sub-groups with their tiers, as the placement plan (offload/store/placement.py) made
        them within ``room``'s budgets (its swap is needed for NVMe ones); ``spare``: host sub-groups get a second
        slot (see [Note: the speculative slot])."""
        host, nvme, swap, rank, buffer_count = room.host, room.nvme, room.swap, room.rank, room.buffer_count
        self.accel = accel
        self.telemetry = telemetry or Telemetry()
        self.groups = groups
        self.fmt = groups[0].fmt if groups else FP32  # every sub-group's (plan_sub_groups gives them one)
        self._by_unit = {m.unit: (g, m) for g in self.groups for m in g.members}
        self.host, self.nvme = host, nvme
        self.placement = StatePlacement()
        self._file: TwoSlotFile | None = None
        self._pool: BufferPool | None = None
        self._buffers: list[AlignedBuffer] = []
        self._fill: AlignedBuffer | None = None
        self._pass: NvmePass | None = None  # this step's NVMe pass, begun ahead of the step
        self.reads_ahead = 0
        for g in self.groups:
            self.placement.tiers[g.tier.value] = self.placement.tiers.get(g.tier.value, 0) + g.numel
            if g.tier is Tier.DEVICE:
                g.resident = g.fmt.empty_slot(g.numel, accel.device)
            elif g.tier is Tier.HOST:
                # Read and written by host threads only (Adam, checkpoints), but a streamed sub-group's, which the
                # copy engines carry each step (offload/optim/streamed_step.py).
                t, buf = accel.host_buffer(g.fmt.slot_bytes(g.numel), torch.uint8, dma=g.streamed)
                host.take(buf.capacity, "optimizer state")
                g.resident = g.fmt.slot(t, g.numel)
                g.resident.zero_()
                if spare:  # written before it is read (the speculative step fills every element it flips)
                    t, buf = accel.host_buffer(g.fmt.slot_bytes(g.numel), torch.uint8, dma=False)
                    host.take(buf.capacity, SPECULATIVE_SLOT)
                    g.spare = g.fmt.slot(t, g.numel)
        nvme_groups = [g for g in self.groups if g.tier is Tier.NVME]
        if nvme_groups:
            assert swap is not None, "nvme optimizer state needs a swap directory and an I/O engine"
            swap_dir, engine = swap
            sizes = [(g.index, g.nbytes) for g in nvme_groups]
            nvme.take(layout(sizes)[1], "optimizer state (two slots per sub-group)")
            self._file = TwoSlotFile(engine, swap_dir, f"optimizer-rank{rank}.swap", sizes)
            count, size = nvme_buffers(nvme_groups, buffer_count)
            # Between the disk (O_DIRECT needs alignment, not pinning) and host Adam: never a device copy's end.
            self._pool = BufferPool(count * size, pin=False, name="optimizer NVMe buffers")
            self._buffers = [self._pool.acquire(size) for _ in range(count)]
            host.take(count * size, "optimizer NVMe buffers")
        logger.info("optimizer state: %s", ", ".join(f"{t} {n:,} elements" for t, n in self.placement.tiers.items()))

    # ----------------------------------------------------------------- filling and reading

    def place(self, unit: int) -> tuple[SubGroup, Member]:
        """The sub-group that holds the unit's state, and where in it (a split moves units to a new one)."""
        return self._by_unit[unit]

    def units(self, where: Callable[[SubGroup], bool]) -> frozenset[int]:
        """The units whose sub-group is ``where``."""
        return frozenset(u for u, (g, _) in self._by_unit.items() if where(g))

    def keeps_high_elsewhere(self, unit: int) -> bool:
        """Whether the unit's 16+16 high half is lent by the parameter store (see [Note: the weights are the high
        half])."""
        return self._by_unit[unit][0].fmt.high_elsewhere

    def lend_high(self, unit: int, weights: torch.Tensor) -> None:
        """The unit's weights (its shard's host memory, which the step writes in place) become its master's high
        half; before ``init_member``."""
        g, m = self._by_unit[unit]
        assert g.fmt.high_elsewhere and weights.numel() == m.numel and weights.dtype == torch.bfloat16, unit
        g.highs[unit] = weights

    def init_member(self, unit: int, master: torch.Tensor) -> None:
        """Set a unit's master weights (moments start at zero). Units arrive in order; an NVMe sub-group is
        written to its slot when its last unit has arrived, so building holds one sub-group at a time."""
        g, m = self._by_unit[unit]
        if g.tier is not Tier.NVME:
            g.views(m).set_master(master)
            return
        self.drop_read_ahead()
        if m.offset == 0:
            self._fill = self._buffers[0]
            g.resident = g.fmt.slot(self._fill.tensor, g.numel)
            g.resident.zero_()
        g.views(m).set_master(master)
        if m is g.members[-1]:
            assert self._file is not None and self._fill is not None
            self._file.write_current(g.index, self._fill.tensor).wait()
            g.resident, self._fill = None, None

    def read_master(self, unit: int) -> torch.Tensor:
        """A copy of one unit's master shard as fp32 (from NVMe when that is its home; a 16-bit master widened)."""
        g, m = self._by_unit[unit]
        if g.tier is not Tier.NVME:
            return g.views(m).master_fp32().detach()
        assert self._file is not None
        self.drop_read_ahead()
        buf = self._buffers[0]
        self._file.read(g.index, buf.tensor).wait()
        return g.fmt.slot(buf.tensor, g.numel).narrow(m.offset, m.numel).master_fp32()

    def one_at_a_time(self, *, read: bool, write: bool) -> Iterator[SubGroup]:
        """Every sub-group resident in turn, an NVMe one through one buffer: read from its current slot first
        (``read``) and written back to that slot after the caller is done with it (``write``: the caller
        replaced the whole sub-group). Never more than one sub-group in memory; for checkpoints."""
        self.drop_read_ahead()
        for g in self.groups:
            if g.tier is not Tier.NVME:
                yield g
                continue
            assert self._file is not None
            buf = self._buffers[0]
            if read:
                self._file.read(g.index, buf.tensor).wait()
                self.telemetry.add_bytes("nvme_read", g.nbytes)
            g.resident = g.fmt.slot(buf.tensor, g.numel)
            try:
                yield g
                if write:
                    self._file.write_current(g.index, buf.tensor).wait()
                    self.telemetry.add_bytes("nvme_write", g.nbytes)
            finally:
                g.resident = None

    # ----------------------------------------------------------------- the step

    def step_pass(self, commit: CommitPoint | None = None) -> Iterator[SubGroup]:
        """Yield every sub-group this step's pass has not handed out yet, resident in memory: NVMe ones
        pipelined (see [Note: the step pipeline]), and every NVMe sub-group's new slot becomes current once all
        writes completed; then the host/device ones. ``commit.commit()`` is called once, when every write completed and
        before anything becomes current or host state is touched; it raises to stop the step there (another
        rank's failed: see [Note: one rank's failed step]). After a failure, ``abort_pass``."""
        if self._file is not None:
            run = self._pass = self._pass or self._new_pass()
            while run.remaining():
                g = run.take()
                yield g
                run.release(g)
            run.finish(commit)
            self._pass = None
        elif commit is not None:
            commit.commit()
        for g in self.groups:
            if g.tier is not Tier.NVME:
                yield g

    def read_ahead(self, forward: bool = False) -> int:
        """Start this step's NVMe pass now, its first reads in flight (see [Note: reads ahead of the step]), in
        backward's order or (``forward``: for a step that returns early) the forward's; returns how many reads it
        issued."""
        if self._file is None or self._pass is not None:
            return 0
        self._pass = self._new_pass(forward)
        self.reads_ahead += self._pass.reads
        return self._pass.reads

    def detach_pass(self) -> NvmePass | None:
        """This step's NVMe pass, in the forward's order (the one read ahead, or a new one), handed to the caller,
        who runs it to its end (``take``/``release``/``finish``) or ``abort``s it, on one thread: the early step
        (see [Note: the early step on NVMe] in offload/optim/early_step.py). None without NVMe sub-groups. Until the
        caller is done nothing else may use the buffers: every other user drains the early step first."""
        if self._file is None:
            return None
        run, self._pass = self._pass, None
        if run is not None and not run.forward:  # read ahead in backward's order: only its reads are dropped
            assert not (run.taken or run.released), "an NVMe pass that stepped during backward finishes in step()"
            run.abort()
            run = None
        return run or self._new_pass(forward=True)

    def arrive(self, unit: int) -> Iterator[SubGroup]:
        """On the host thread in an overlapped backward, once ``unit``'s last gradient is accumulated: yield each
        NVMe sub-group that can now be stepped, resident, in the pass's order (see [Note: NVMe sub-groups stepped
        during backward]); the caller steps it before asking for the next."""
        run = self._pass
        g, _ = self._by_unit[unit]
        if run is None or g.tier is not Tier.NVME:
            return
        run.arrived(g, unit)
        while run.next_complete():
            g = run.take()
            yield g
            run.release(g)

    def abort_pass(self) -> list[SubGroup]:
        """Forget this step's pass after a failure: every transfer finishes, no slot flips. Returns the
        sub-groups it had already handed out (their new state is discarded; a retry steps them again)."""
        run, self._pass = self._pass, None
        return run.abort() if run is not None else []

    def drop_read_ahead(self) -> list[SubGroup]:
        """Something else needs the buffers: settle this step's pass (its reads are waited for and dropped; the
        sub-groups it already stepped keep their new state). Returns the sub-groups whose new state could not be
        kept (a failed write): they must be stepped again."""
        run, self._pass = self._pass, None
        return run.settle() if run is not None else []

    def _new_pass(self, forward: bool = False) -> NvmePass:
        assert self._file is not None
        nvme = [g for g in self.groups if g.tier is Tier.NVME]
        if not forward:
            nvme.reverse()  # backward's order: last units first
        return NvmePass(self._file, nvme, self._buffers, self.telemetry, self.accel.ledger, forward=forward)

    # ----------------------------------------------------------------- a split widened

    def split(self, g: SubGroup, count: int) -> SubGroup:
        """Host sub-group ``g``'s first ``count`` units become a sub-group of their own, placed before it; both
        keep views of the one buffer they share (``borrowed``), each unit's state where it was."""
        assert g.tier is Tier.HOST and g.resident is not None and 0 < count < len(g.members)
        cut = g.members[count].offset
        head = SubGroup(max(x.index for x in self.groups) + 1, g.members[:count], cut, Tier.HOST,
                        g.resident.narrow(0, cut), None if g.spare is None else g.spare.narrow(0, cut),
                        {m.unit for m in g.members[:count]} & g.in_spare, borrowed=True, fmt=g.fmt,
                        highs={m.unit: g.highs.pop(m.unit) for m in g.members[:count] if m.unit in g.highs})
        g.members = [Member(m.unit, m.offset - cut, m.numel) for m in g.members[count:]]
        g.numel -= cut
        g.resident = g.resident.narrow(cut, g.numel)
        g.spare = None if g.spare is None else g.spare.narrow(cut, g.numel)
        g.in_spare -= head.in_spare
        g.borrowed = True
        self.groups.insert(self.groups.index(g), head)
        self._by_unit.update({m.unit: (x, m) for x in (head, g) for m in x.members})
        return head

    def move_to_device(self, g: SubGroup, moved: StateSlot) -> None:
        """Host sub-group ``g`` (state settled: no step in flight) moves into ``moved`` (a slot of its elements in
        its format with every part its own, ``fmt.high_in_state()``, on the compute device), each unit's state from
        its current slot, a lent high half from the weights that are it (before the parameter store moves or drops
        them); host memory of its own is given back (see [Note: the split refitted] in offload/engine/refit.py)."""
        assert g.tier is Tier.HOST and g.resident is not None, f"sub-group {g.index} is not on the host"
        assert moved.master.numel() == g.numel, f"sub-group {g.index} moves into a slot of {g.numel} elements"
        for m in g.members:
            moved.narrow(m.offset, m.numel).copy_(g.views(m))
        g.fmt = g.fmt.high_in_state()
        g.highs.clear()
        if not g.borrowed:
            for slot, what in ((g.resident, "optimizer state"), (g.spare, SPECULATIVE_SLOT)):
                if slot is not None:
                    self.host.give(self.accel.forget_host_buffer(slot.start()), what)
        g.tier, g.resident, g.spare, g.in_spare, g.streamed = Tier.DEVICE, moved, None, set(), False
        self.placement.tiers[Tier.HOST.value] -= g.numel
        self.placement.tiers[Tier.DEVICE.value] = self.placement.tiers.get(Tier.DEVICE.value, 0) + g.numel

    # ----------------------------------------------------------------- lifetime

    def device_memory(self) -> list[torch.Tensor]:
        """A view of each device sub-group's slot (master and moments share its one storage), for lending the
        device back (offload/machine/parking.py)."""
        return [g.resident.exp_avg for g in self.groups if g.tier is Tier.DEVICE and g.resident is not None]

    def close(self) -> None:
        self.drop_read_ahead()
        if self._file is not None:
            self._file.close()
            self._file = None
        for buf in self._buffers:
            if self._pool is not None:
                self._pool.release(buf)
        self._buffers.clear()
        for g in self.groups:
            g.resident = None
            g.highs.clear()  # the parameter store's shards: not kept alive from here


@dataclass
class _Space:
    """One NVMe buffer as the pass fills it (see [Note: sub-groups packed into the buffers])."""

    buffer: AlignedBuffer
    used: int = 0  # bytes placed since it was last emptied
    holding: int = 0  # sub-groups placed in it and not released yet
    writes: list[RequestGroup] = field(default_factory=list)  # of the released ones placed since it was emptied


class NvmePass:
    """One step's pass over the NVMe sub-groups, in a fixed order. A sub-group goes upcoming -> reading (its
    read into a buffer in flight) -> resident (taken: the caller steps it) -> writing (released: its new state
    goes to the other slot) -> committed (``finish``: every write completed, the new slots become current).

    [Note: sub-groups packed into the buffers] Each buffer holds the largest sub-group, and a model with one
    large unit (an embedding of 50k x 768 is 39M elements, 463 MB of state) would leave every other buffer
    mostly empty with one small sub-group in it. So the pass packs sub-groups into the buffers by bytes, in its
    order: it fills one buffer, then the next, and comes back to a buffer only once every sub-group placed in it
    was released and its writes completed. With uniform sub-groups that is one per buffer, as before; with one
    large unit most of the step's reads go ahead of it (under backward) in the same memory."""

    def __init__(self, file: TwoSlotFile, groups: list[SubGroup], buffers: list[AlignedBuffer],
                 telemetry: Telemetry, ledger: SyncLedger, forward: bool = False) -> None:
        self.file, self.tel, self.ledger = file, telemetry, ledger
        self.forward = forward  # the forward's order (first units first), for the early step
        self.upcoming: deque[SubGroup] = deque(groups)
        # (sub-group, its buffer, its bytes there, the read)
        self.reading: deque[tuple[SubGroup, _Space, torch.Tensor, Request]] = deque()
        self.spaces = [_Space(b) for b in buffers]
        self._at = 0  # the buffer being filled
        self.taken: dict[int, tuple[SubGroup, _Space, torch.Tensor]] = {}  # resident, not released yet
        self.released: dict[int, tuple[SubGroup, RequestGroup]] = {}  # written (or being written), not committed
        self._transfers: list[Request | RequestGroup] = []  # every read and write: when the pass had I/O in flight
        self._arrived: dict[int, set[int]] = {}
        self._fill()
        self.reads = len(self.reading)

    def remaining(self) -> bool:
        return bool(self.upcoming or self.reading)

    def arrived(self, g: SubGroup, unit: int) -> None:
        self._arrived.setdefault(g.index, set()).add(unit)

    def next_complete(self) -> bool:
        """Whether the pass's next sub-group has every member's gradient (an overlapped backward)."""
        nxt = self.reading[0][0] if self.reading else self.upcoming[0] if self.upcoming else None
        return nxt is not None and len(self._arrived.get(nxt.index, ())) == len(nxt.members)

    def take(self) -> SubGroup:
        """The next sub-group, resident once its read has completed."""
        self._fill()
        g, space, memory, read = self.reading.popleft()
        self.taken[g.index] = (g, space, memory)
        with self.tel.span("nvme_wait", "read"):
            self.ledger.block("optimizer state read")
            read.wait()
        g.resident = g.fmt.slot(memory, g.numel)
        return g

    def release(self, g: SubGroup) -> None:
        """The caller is done with ``g``: write its state to the slot that is not current."""
        _, space, memory = self.taken.pop(g.index)
        g.resident = None
        write = self.file.write_next(g.index, memory)
        self._transfers.append(write)
        space.holding -= 1
        space.writes.append(write)
        self.released[g.index] = (g, write)
        self.tel.add_bytes("nvme_write", g.nbytes)

    def finish(self, commit: CommitPoint | None = None) -> None:
        """Wait for every write, then ``commit`` (which may raise: nothing flips), then the written slots become
        current."""
        with self.tel.span("nvme_wait", "write"):
            for _, write in self.released.values():
                self.ledger.block("optimizer state written")
                write.wait()
        if commit is not None:
            commit.commit()
        for g, _ in self.released.values():
            self.file.flip(g.index)
        self.released.clear()
        for start, end in _union(_span(t) for t in self._transfers):
            self.tel.interval("optimizer_io", None, start, end, "nvme")

    def abort(self) -> list[SubGroup]:
        """Let every transfer finish (buffers are reused after) and flip nothing; returns the sub-groups it
        handed out (their new state is discarded). What it read and wrote for them counts as wasted: a wrong
        speculation or a failed step reads them again."""
        self._drop_reads()
        for g, write in self.released.values():
            wait_quietly(write)
            self.tel.add_bytes("nvme_write_wasted", g.nbytes)  # counted in nvme_write too
        released = [g for g, _ in self.released.values()]
        self.released.clear()
        handed = released + self._drop_taken()
        for g in handed:
            self.tel.add_bytes("nvme_read_wasted", g.nbytes)  # counted in nvme_read too
        return handed

    def settle(self) -> list[SubGroup]:
        """Stop early: reads are dropped, released sub-groups whose write completed are committed (their step
        is kept); returns those whose new state is lost (a failed write, or never released)."""
        self._drop_reads()
        lost = []
        for g, write in self.released.values():
            if wait_quietly(write):
                self.file.flip(g.index)
            else:
                lost.append(g)
        self.released.clear()
        return lost + self._drop_taken()

    def _drop_reads(self) -> None:
        """Reads issued and never taken: waited for (their buffers are reused) and counted as wasted."""
        for g, *_, read in self.reading:
            wait_quietly(read)
            self.tel.add_bytes("nvme_read_wasted", g.nbytes)  # counted in nvme_read too
        self.reading.clear()

    def _drop_taken(self) -> list[SubGroup]:
        taken = [g for g, *_ in self.taken.values()]
        for g in taken:
            g.resident = None
        self.taken.clear()
        return taken

    def _fill(self) -> None:
        """Reads into the buffers' free room, in the pass's order (see [Note: sub-groups packed into the
        buffers]); a buffer is filled again once all it held was released and written."""
        while self.upcoming:
            g, space = self.upcoming[0], self.spaces[self._at]
            if space.used + g.nbytes > space.buffer.capacity:
                following = self.spaces[(self._at + 1) % len(self.spaces)]
                if following.holding:  # still read into or stepped: no room until it is released
                    return
                with self.tel.span("nvme_wait", "write"):
                    for write in following.writes:
                        self.ledger.block("optimizer state written")
                        write.wait()
                following.used, following.writes = 0, []
                self._at = (self._at + 1) % len(self.spaces)
                continue
            self.upcoming.popleft()
            memory = space.buffer.tensor[space.used:space.used + g.nbytes]
            space.used += g.nbytes
            space.holding += 1
            read = self.file.read(g.index, memory)
            self._transfers.append(read)
            self.reading.append((g, space, memory, read))
            self.tel.add_bytes("nvme_read", g.nbytes)


def _span(request: object) -> tuple[float, float]:
    """(submitted, finished) of a completed request or group of requests."""
    parts = getattr(request, "requests", [request])
    return min(r.submitted_at for r in parts), max(r.finished_at for r in parts)


def _union(spans: Iterator[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals merged: the time at least one transfer was in flight."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


