"""Where each unit's compute-dtype parameter shard lives on this rank: the one owner of that fact.

A shard has one home, chosen at start-up and never changed: the compute device
(offload_param none), host memory (offload_param cpu, or nvme under max_in_cpu) or NVMe
(through the parameter swap). The store owns the home's memory, the host copy that a
host-side optimizer step writes, every read and overwrite, and the copies that bring a
shard to the device; each copy's event is kept with the shard, so whoever uses the
device shard next (a gather, a resident unit's all-gather) waits for exactly that copy.

[Note: the step's target] The optimizer writes a shard's new values into
``step_target``: the host copy (a host home, or a device home whose optimizer state is
offloaded), or a fresh NVMe write buffer (then the elements the step does not write
must be filled from the master first). ``wrote`` hands an NVMe shard to its write;
``copy_back`` starts the copy of a device home's host copy to the device. The ZeRO side
never sees which: it asks for the shard on the device (``to_device``) when it gathers.

[Note: host memory is the device's] When the compute device is the CPU, a host-homed
shard is already where compute reads it, and a device home's host copy would be a
second buffer in the same RAM. So there the store copies nothing: ``to_device`` hands
out the host shard itself, a device home's host copy is the device shard (the step
writes it in place; ``copy_back`` has nothing to do), and a unit that needs no gather
(W = 1) reads its shard in place (``in_place``: the ZeRO side aliases its flat buffer to
it). The step writes a unit's shard only when no compute reads it: after backward, or
during it once the unit's gradients are in.

[Note: reading the home] On a discrete device too, a unit that needs no gather (W = 1)
whose shard is homed on the device reads that shard where it lives: the unit's flat
buffer is the shard's memory, so it is never gathered or released and costs no memory
beyond the shard (``compute_reads_home``). The step still writes the shard's host copy;
the copy back rewrites the device shard once the compute stream's last reads of the old
values are done (``copy_back``'s ``after``), and each use first waits for that copy on
the compute stream (``await_home``), as a gather from the shard would.

[Note: the hand-off] A host-homed shard the streamed lane steps (offload/optim/streamed_step.py) has its new values
on the device when the step is done. They go down into the host home on a copy stream, and the next gather would
bring them straight back up: a round trip over the bus both ways, which the forward's first units (the streamed
ones) wait for. So the lane also hands the new values to the store on the device (``hand_off``: a copy of their
own, made on the compute stream) and the next ``to_device`` takes them instead of copying the home up: no bus
and no wait, in compute-stream order. One gather takes them; later ones (the backward's) read the home as before,
whose copy down they wait for on the device. Whatever rewrites the home (a load, the refit) drops them. The
placement counts their bytes on the device (``STREAMED_HANDED`` in offload/store/placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from offload.machine.accelerator import Accelerator, CopyStream, Event
from offload.machine.buffers import round_up
from offload.observe.telemetry import Telemetry
from offload.store.budget import TierBudget
from offload.store.param_homes import HOST_PARAMS
from offload.store.param_swap import ParamSwap
from offload.store.tier import Tier


class DeferredStep(Protocol):
    """A step that writes shards when they are first read (the streamed lane's: see [Note: streamed steps deferred]
    in offload/optim/streamed_step.py)."""

    def run_due(self, unit: int) -> None:
        """Step what writes ``unit``'s shard now (and clear its ``due``)."""


@dataclass(eq=False)
class ParamShard:
    """One unit's shard on this rank."""

    index: int
    name: str  # the unit's, for traces
    numel: int
    home: Tier
    device: torch.Tensor  # DEVICE home: the shard (a view into the unit's flat buffer at stages 0-2); else empty
    host: torch.Tensor | None = None  # HOST home: the shard; DEVICE home with a host-side step: its host copy
    ready: Event | None = None  # the copy that last wrote ``device``; its next reader waits for it
    stepped: Event | None = None  # an early step's writes of the shard (and its copy back) done (re-recorded)
    step_pending: bool = False  # ``stepped`` not yet waited for: the shard's readers wait first
    # ``stepped`` is a copy stream's (the streamed lane's copy down): a copy up may wait for it there, not the host
    stepped_on_stream: bool = False
    fetched: Event | None = None  # a host home's last copy to the device (re-recorded each time)
    handed: torch.Tensor | None = None  # the streamed lane's new values on the device, for the next gather
    due: DeferredStep | None = None  # a deferred step that writes the shard: run before any read of it


class ParamStore:
    """Every compute-dtype parameter shard of this rank, by unit index."""

    def __init__(self, accel: Accelerator, dtype: torch.dtype, homes: dict[int, Tier], *,
                 swap: ParamSwap | None, host: TierBudget, telemetry: Telemetry, keep_host_copies: bool = False
                 ) -> None:
        """``homes``: every unit's home, decided at start-up (``swap`` holds the NVMe-homed ones).
        ``keep_host_copies``: the step can fail part way (optimizer state on NVMe), so a device home's new values
        wait in a host copy of their own until the whole step succeeded, even where host memory is the device's."""
        nvme = {i for i, h in homes.items() if h is Tier.NVME}
        if nvme != (set(swap.homes) if swap is not None else set()):
            raise ValueError("the parameter swap must hold exactly the units homed on NVMe")
        self.accel = accel
        self.dtype = dtype
        self._planned = dict(homes)  # the homes ``add`` has not taken yet: each moves into its shard there
        self.swap = swap
        self.host_budget = host
        self.telemetry = telemetry
        self._shards: dict[int, ParamShard] = {}
        self._h2d: CopyStream | None = None  # copies of host copies back to the device (made on first use)
        self.host_is_device = accel.host_is_device  # see [Note: host memory is the device's]
        self.keep_host_copies = keep_host_copies
        self._nvme_stepping: set[int] = set()  # NVMe-homed units with an early step not waited for (the hot path's)
        # [Note: kept values of an NVMe shard] An NVMe shard's small ranges that stay whole (``kept_values``) are
        # taken from the values on their way to the disk, so that refreshing them after a step reads nothing back:
        # per unit, the ranges and their values now, and those a step wrote but has not committed.
        self._kept: dict[int, tuple[list[tuple[int, int]], torch.Tensor]] = {}
        self._kept_next: dict[int, torch.Tensor] = {}
        self._staged: dict[int, torch.Tensor] = {}  # NVMe shards' step targets, until ``wrote``
        self.closed = False  # the engine closed: no shard is held any more

    def add(self, index: int, name: str, values: torch.Tensor, *, device_view: torch.Tensor | None = None,
            host_copy: bool = False) -> None:
        """Take unit ``index``'s starting shard ``values`` (any float dtype, host or device).

        ``device_view``: the slice of the unit's flat buffer that is this rank's shard, already holding the values:
        a resident unit's (stages 0-2), or an in-place unit's (see ``in_place``), which becomes the home's memory.
        ``host_copy``: the optimizer steps this shard on the host, so a device home gets a host copy for the step
        to write (reserved in the host budget by the optimizer). A host-homed shard of a unit nothing trains is
        taken from the host budget here."""
        home = self._planned.pop(index)
        numel = values.numel()
        empty = torch.empty(0, dtype=self.dtype, device=self.accel.device)
        shard = ParamShard(index, name, numel, home, empty)
        if home is Tier.DEVICE:
            if device_view is not None:
                shard.device = device_view
            else:
                shard.device = torch.empty(numel, dtype=self.dtype, device=self.accel.device)
                shard.device.copy_(values)
            if host_copy:  # read in place, the device shard is its own host copy
                shard.host = shard.device if self._in_place(home) else self._host_copy(values)
        elif home is Tier.HOST:
            if device_view is not None:
                assert self._in_place(home), "only a CPU compute device reads a host shard in place"
                shard.host = device_view
            else:
                shard.host = self._host_copy(values)
            if not host_copy:
                self.host_budget.take(round_up(numel * self.dtype.itemsize), HOST_PARAMS)
        else:
            assert self.swap is not None
            self.swap.overwrite(index, values.to(self.dtype).cpu())
        self._shards[index] = shard

    def _host_copy(self, values: torch.Tensor) -> torch.Tensor:
        host = self.accel.host_buffer(values.numel(), self.dtype)[0]
        host.copy_(values)
        return host

    # ----------------------------------------------------------------- facts

    def home(self, index: int) -> Tier:
        shard = self._shards.get(index)
        return shard.home if shard is not None else self._planned[index]

    def numel(self, index: int) -> int:
        """The shard's elements on this rank."""
        return self._shards[index].numel

    def in_place(self, index: int) -> bool:
        """Compute can read the shard where it lives and the step writes it there: a host home on a CPU compute
        device, or a device home there unless it keeps a host copy of its own (``keep_host_copies``)."""
        return self._in_place(self.home(index))

    def _in_place(self, home: Tier) -> bool:
        return self.host_is_device and (home is Tier.HOST or (home is Tier.DEVICE and not self.keep_host_copies))

    def compute_reads_home(self, index: int) -> bool:
        """Compute can read the shard where it lives, so a unit needing no gather (W = 1) aliases it instead of
        copying it (see [Note: reading the home]): ``in_place``, or a device home on a discrete device, where the
        step writes a host copy and the copy back rewrites the shard."""
        return self.in_place(index) or (not self.host_is_device and self.home(index) is Tier.DEVICE)

    def await_home(self, index: int) -> None:
        """Before compute reads a shard where it lives: the early step writing it has run, and the compute stream
        waits for the copy back that last rewrote a device home (a stream wait on a GPU, not the host's)."""
        self.wait_step(index)
        shard = self._shards[index]
        if shard.home is Tier.DEVICE:
            self.accel.compute_wait(shard.ready)

    def device_nbytes(self, index: int) -> int:
        """Bytes the shard holds on the compute device between uses."""
        t = self._shards[index].device
        return t.numel() * t.element_size()

    def host_copy(self, index: int) -> torch.Tensor | None:
        """The shard's host memory (a host home, or a device home's copy), if it has any."""
        return self._shards[index].host

    def ready(self, index: int) -> Event | None:
        return self._shards[index].ready

    def stale(self) -> set[int]:
        """NVMe-homed units whose last write failed (see [Note: parameter slots] in param_swap.py)."""
        return self.swap.stale_units() if self.swap is not None else set()

    # ----------------------------------------------------------------- reads and overwrites

    def read(self, index: int) -> torch.Tensor:
        """The shard's current values wherever they live (from NVMe: a fresh copy; else the tensor itself, which
        compute may read: it waits for a copy back still in flight)."""
        self.wait_step(index)
        shard = self._shards[index]
        if shard.home is Tier.NVME:
            assert self.swap is not None
            return self.swap.read_copy(index)
        if shard.home is Tier.HOST:
            assert shard.host is not None
            return shard.host
        self.accel.compute_wait(shard.ready)
        return shard.device

    def overwrite(self, index: int, values: torch.Tensor) -> None:
        """Make ``values`` (any float dtype) the shard now, in every copy it has (a checkpoint load, a repair)."""
        self.wait_step(index)
        shard = self._shards[index]
        shard.handed = None  # the old values (see [Note: the hand-off])
        # A copy back (or a fetch) still in flight reads the host copy written here, or lands after this write.
        for copy in (shard.ready, shard.fetched):
            if copy is not None:
                self.accel.wait(copy, "a shard's copy before it is overwritten")
        if shard.host is not None:
            shard.host.copy_(values)
        if shard.home is Tier.NVME:
            assert self.swap is not None
            self.swap.overwrite(index, values.to(self.dtype).cpu())
            self._follow(index, values)
        elif shard.home is Tier.DEVICE:
            shard.device.copy_(values.to(shard.device.device), non_blocking=False)
            shard.ready = None

    def kept_values(self, index: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The shard's current values in ``ranges`` ([lo, hi) of the shard), one after another: small parameters
        kept whole between uses (see [Note: small parameters stay whole] in zero/unit.py)."""
        if self.home(index) is not Tier.NVME:
            shard = self.read(index)
            return torch.cat([shard[lo:hi] for lo, hi in ranges]) if ranges else shard[:0]
        self.wait_step(index)
        known = self._kept.get(index)
        if known is None or known[0] != ranges:  # the first time: read once, then follow every write
            self._kept[index] = (ranges, self._pick(self.read(index), ranges))
        return self._kept[index][1]

    def _pick(self, values: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """``ranges`` of an NVMe shard's values, on the host (where they are, but for a load's values)."""
        flat = values.reshape(-1)
        parts = [flat[lo:hi].to("cpu", self.dtype) for lo, hi in ranges]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def _follow(self, index: int, values: torch.Tensor) -> None:
        """An NVMe shard's whole new values are ``values``: its kept ranges now hold theirs."""
        known = self._kept.get(index)
        if known is not None:
            self._kept[index] = (known[0], self._pick(values, known[0]))
        self._kept_next.pop(index, None)

    def to_device(self, index: int, h2d: CopyStream | None) -> torch.Tensor:
        """The shard on the compute device, ready for the compute stream (which waits for the copy, or for the
        one that last wrote a device home). An NVMe shard waits for its read, which read-ahead has usually done;
        a failed read raises here, before the caller changes anything. A host home the streamed lane is writing
        down is waited for by the copy up, on the device: the host issuing the forward goes on."""
        self._run_due(index)
        shard = self._shards[index]
        if shard.handed is not None:  # see [Note: the hand-off]: made on the compute stream, no wait
            handed, shard.handed = shard.handed, None
            return handed
        on_stream = h2d is not None and self._written_on_stream(index)
        if not on_stream:
            self.await_home(index)
        if shard.home is Tier.DEVICE:
            return shard.device
        if shard.home is Tier.HOST and self.host_is_device:
            assert shard.host is not None
            return shard.host
        assert h2d is not None, "a shard homed off the device needs a copy stream to come over"
        read = self.swap.fetch(index) if shard.home is Tier.NVME and self.swap is not None else None
        source = self.swap.view(read) if self.swap is not None and read is not None else shard.host
        assert source is not None
        # no wait for compute: see [Note: a copy's target in its stream's pool] in offload/machine/accelerator.py
        out = self.accel.copy_target(h2d, shard.numel, self.dtype)
        if on_stream:  # the streamed lane's copy down of these weights (host readers still wait: step_pending)
            assert shard.stepped is not None
            h2d.wait_event(shard.stepped)
        graph, nbytes = self.accel.graph, out.numel() * out.element_size()

        def fetch() -> None:
            graph.work("h2d", index, nbytes=nbytes)
            out.copy_(source, non_blocking=True)

        h2d.run(fetch)
        self.telemetry.add_bytes("h2d", nbytes)
        if self.swap is not None and read is not None:
            # The swap holds this one until its read buffer is free again: a fresh event, never re-recorded.
            copied = h2d.record()
            self.swap.copied(read, copied)
        else:
            copied = shard.fetched = h2d.record(into=shard.fetched)
        self.accel.compute_wait(copied)
        return out

    # ----------------------------------------------------------------- the step's writes

    def step_target(self, index: int) -> torch.Tensor:
        """Host memory the step writes the new shard into (see [Note: the step's target])."""
        shard = self._shards[index]
        if shard.home is Tier.NVME:
            assert self.swap is not None
            self._staged[index] = self.swap.stage(index)
            return self._staged[index]
        assert shard.host is not None, f"unit {index}'s shard has no host copy to step into"
        return shard.host

    def can_home_on_device(self, index: int) -> bool:
        """Whether the shard can move to a device home between steps: it is there already, or it is homed on the
        host of a discrete device (on a CPU device a host shard is read where it lies: it stays)."""
        home = self.home(index)
        return home is Tier.DEVICE or (home is Tier.HOST and not self.host_is_device)

    def home_on_device(self, index: int, device: torch.Tensor) -> int:
        """A host-homed shard whose step moved to the device moves too, into ``device`` (its elements, on the
        compute device: see [Note: the split refitted] in offload/engine/refit.py): the device keeps it, as it
        keeps a unit homed there at start-up, and the host buffer is freed; returns its bytes."""
        shard = self._shards[index]
        assert shard.home is Tier.HOST and shard.host is not None and not self.host_is_device
        assert device.numel() == shard.numel and device.dtype == self.dtype
        self.wait_step(index)
        if shard.fetched is not None:  # the last copy from it to the device
            self.accel.wait(shard.fetched, "a shard's copy before it moves to the device")
        device.copy_(shard.host)
        shard.handed = None
        nbytes = self._free_host(shard)
        shard.device, shard.home, shard.ready, shard.fetched = device, Tier.DEVICE, None, None
        return nbytes

    def drop_host_copy(self, index: int) -> int:
        """A device home's step moved to the device (see [Note: the split refitted] in offload/engine/refit.py):
        its host copy is freed; returns its bytes (0: it had none of its own)."""
        shard = self._shards[index]
        if shard.home is not Tier.DEVICE or shard.host is None or shard.host is shard.device:
            return 0
        return self._free_host(shard)

    def _free_host(self, shard: ParamShard) -> int:
        """The shard's host buffer is freed once its last view goes; returns the bytes its budget part held."""
        assert shard.host is not None
        self.accel.forget_host_buffer(shard.host)
        nbytes = shard.host.numel() * shard.host.element_size()
        shard.host = None
        return nbytes

    def write_device(self, index: int, values: torch.Tensor) -> None:
        """The step ran on the compute device: write its result into a device home (compute-stream order)."""
        self._shards[index].device.copy_(values)

    def write_down(self, index: int, values: torch.Tensor, lane: CopyStream) -> None:
        """The step ran on the compute device (the streamed lane) and the shard is homed on the host: ``values``
        go down into it on ``lane``, after what is queued there (the lane waits for the step); the shard's readers
        wait for that copy, as for an early step's (``step_pending``)."""
        shard = self._shards[index]
        assert shard.home is Tier.HOST and shard.host is not None, f"unit {index}'s shard is not homed on the host"
        target, nbytes = shard.host, values.numel() * shard.host.element_size()
        graph = self.accel.graph

        def copy() -> None:
            graph.work("d2h", index, nbytes=nbytes)
            target.copy_(values, non_blocking=True)
        lane.run(copy)
        self.telemetry.add_bytes("d2h", nbytes)
        self.step_pending(index, lane)
        shard.stepped_on_stream = True

    def hand_off(self, index: int, values: torch.Tensor) -> None:
        """The streamed lane's new values of a host-homed shard, on the device (the compute stream's, a copy of
        their own in the compute dtype): the next gather takes them instead of the home (see [Note: the
        hand-off]); ``write_down`` has sent them to the home already."""
        shard = self._shards[index]
        assert shard.stepped_on_stream and values.dtype == self.dtype and values.numel() == shard.numel
        shard.handed = values

    def handed_bytes(self) -> int:
        """Bytes of new values handed over and not yet gathered (see [Note: the hand-off])."""
        return sum(s.handed.numel() * s.handed.element_size() for s in self._shards.values()
                   if s.handed is not None)

    def wrote(self, index: int) -> None:
        """The step finished writing ``step_target``: an NVMe shard goes to its other slot."""
        if self.home(index) is Tier.NVME:
            assert self.swap is not None
            staged, known = self._staged.pop(index, None), self._kept.get(index)
            if staged is not None and known is not None:  # see [Note: kept values of an NVMe shard]
                self._kept_next[index] = self._pick(staged, known[0])
            self.swap.write(index)

    def copy_back(self, index: int, after: Event | None) -> Event | None:
        """A device home's new host copy goes to the device (asynchronously) once ``after`` completes (the compute
        stream's last reads of the old values, when they may still be running); returns the copy's event, which
        the shard's next reader waits for. Nothing to do for other homes (returns None)."""
        shard = self._shards[index]
        if shard.home is not Tier.DEVICE or shard.host is None or shard.host is shard.device:
            return None
        if self._h2d is None:
            self._h2d = self.accel.copy_stream("h2d", urgent=True)
        if after is not None:
            self._h2d.wait_event(after)
        source, target, tel, graph = shard.host, shard.device, self.telemetry, self.accel.graph

        def copy() -> None:
            graph.work("h2d", index, nbytes=source.numel() * source.element_size())
            with tel.span("h2d", shard.name):
                target.copy_(source, non_blocking=True)

        self._h2d.run(copy)
        shard.ready = self._h2d.record(into=shard.ready)
        tel.add_bytes("h2d", source.numel() * source.element_size())
        return shard.ready

    def step_pending(self, index: int, lane: CopyStream) -> None:
        """An early step queued on ``lane`` writes the shard (and starts its copy back) by the time what is queued
        there so far has run (see [Note: early step] in offload/optim/early_step.py)."""
        shard = self._shards[index]
        shard.stepped, shard.step_pending, shard.stepped_on_stream = lane.record(into=shard.stepped), True, False
        if self.home(index) is Tier.NVME:
            self._nvme_stepping.add(index)

    def defer(self, index: int, step: DeferredStep | None) -> None:
        """``step`` (deferred: see [Note: streamed steps deferred] in offload/optim/streamed_step.py) writes the
        shard: whatever reads it first runs it (None: it has run)."""
        self._shards[index].due = step

    def _run_due(self, index: int) -> None:
        step = self._shards[index].due
        if step is not None:
            step.run_due(index)  # it clears ``due`` of every shard it writes

    def wait_step(self, index: int) -> None:
        """Before anything reads the shard: a deferred step writing it runs, and an early step still writing it
        has run."""
        self._run_due(index)
        shard = self._shards[index]
        if shard.step_pending:
            assert shard.stepped is not None
            self.accel.wait(shard.stepped, "a unit's early step")
            shard.step_pending = False
            self._nvme_stepping.discard(index)

    def _written_on_stream(self, index: int) -> bool:
        """Whether a host home's pending write is a copy stream's (the streamed lane's copy down), which a copy
        up may wait for on the device."""
        shard = self._shards[index]
        return (shard.step_pending and shard.stepped_on_stream and shard.home is Tier.HOST
                and not self.host_is_device)

    def prepare(self, index: int) -> bool:
        """The one door before a gather reads the shard (now, or ahead of use): an early step still writing it has
        run, and an NVMe shard's read is in flight. False where a failed write left the NVMe shard stale (see
        [Note: an early step's parameter writes] in param_swap.py): nothing was started, and whoever gathers has
        the shard rewritten from its master (the optimizer) and prepares it again. A host home the streamed lane
        is writing down is left to the copy up to wait for, on the device (``to_device``)."""
        self._run_due(index)
        if not self._written_on_stream(index):
            self.wait_step(index)
        if self.home(index) is not Tier.NVME:
            return True
        assert self.swap is not None
        if index in self.swap.stats.stale:
            return False
        self.swap.start(index)
        return True

    @property
    def gather_ahead(self) -> int:
        """How many NVMe-homed units a gather may run ahead of use (none without NVMe homes)."""
        return self.swap.gather_ahead if self.swap is not None else 0

    def read_ahead(self, units: list[int], skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Start reads of the NVMe-homed ``units`` (the upcoming order; not those in ``skip``, gathered already)
        while buffers are free, never waiting; a unit an early step is still writing is read once it has (see
        [Note: an early step's parameter writes] in param_swap.py)."""
        if self.swap is not None and units:
            self.swap.read_ahead(units, skip=skip, later=self.stepping())

    def stepping(self) -> set[int]:
        """NVMe-homed units an early step has not finished writing: not to be read ahead yet (see [Note: an early
        step's parameter writes] in param_swap.py)."""
        busy = set()
        for index in self._nvme_stepping:
            shard = self._shards[index]
            if shard.step_pending and shard.stepped is not None and not shard.stepped.query():
                busy.add(index)
        return busy

    def forget_reads(self, units: set[int] | frozenset[int]) -> None:
        """An early step will write ``units``' NVMe shards: drop what the read buffers hold of them."""
        if self.swap is not None and units:
            self.swap.forget(units)

    def commit_early(self, index: int) -> None:
        """On the early step's thread: the unit's new NVMe shard, written, becomes current on its own."""
        if self.home(index) is Tier.NVME:
            assert self.swap is not None
            self._commit_kept([index])
            self.swap.commit_unit(index)

    def wait_copies_back(self) -> None:
        """Every copy back has run (the next step rewrites the host copies they read)."""
        if self._h2d is not None:
            self.accel.drain(self._h2d, "parameter copies back")

    def commit(self) -> None:
        """The step's NVMe shard writes become current (see [Note: parameter slots]); may raise ParamSwapError."""
        if self.swap is not None:
            self._commit_kept(list(self._kept_next))  # the values written, even where a write then failed
            self.swap.commit()

    def _commit_kept(self, units: list[int]) -> None:
        for index in units:
            values = self._kept_next.pop(index, None)
            if values is not None:
                self._kept[index] = (self._kept[index][0], values)

    def abort(self) -> None:
        """The step failed before its optimizer state was committed: forget its NVMe writes."""
        self._kept_next.clear()
        self._staged.clear()
        if self.swap is not None:
            self.swap.abort()

    def device_memory(self) -> list[torch.Tensor]:
        """The device-homed shards (a resident or in-place unit's: a view of its flat buffer) and the new values
        handed over and not yet gathered, for lending the device back (offload/machine/parking.py)."""
        homes = [s.device for s in self._shards.values() if s.home is Tier.DEVICE]
        return homes + [s.handed for s in self._shards.values() if s.handed is not None]

    def close(self) -> None:
        self.closed = True
        if self._h2d is not None:
            self.accel.drain(self._h2d, "parameter copies back")
        if self.swap is not None:
            self.swap.close()
            self.swap = None
        for shard in self._shards.values():
            shard.device = torch.empty(0, dtype=self.dtype, device=shard.device.device)
            shard.host = shard.ready = shard.handed = None
