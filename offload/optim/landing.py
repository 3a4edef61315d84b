"""Gradients from backward's hooks into the optimizer's shards: the D2H stream, the landing worker, landing
buffers, device accumulators and the norms taken as gradients land. Backward's hooks hand each unit's reduced
shard over as a ``ReducedShard`` (``land``). What acts on a shard as its gradient lands is handed to this room
whole (``OnLanding``), and called down: the speculation is claimed before a shard's gradient is touched (its
speculative Adam may be reading it), and the overlapped step is told once a gradient is in (offload/optim/
overlapped_step.py: it steps the shard if the backward steps).

[Note: gradients land] A unit's reduce-scattered gradient shard leaves the device as
soon as it exists, and nothing on the way blocks autograd's thread (the sync ledger
checks it: see offload/observe/sync_ledger.py). Each unit has a landing buffer in host memory
of its own: the backward hook makes the D2H copy stream wait for the reduction and copy
the shard there, then hands the unit to the landing worker, a host thread that waits
for the copy and adds the gradient into the fp32 accumulator. A landing buffer is busy
until the worker has added what landed in it; with gradient accumulation the next
micro-batch's gradient of that unit may find it so, and then the worker itself issues
that copy once it is done (it runs in order), so autograd still never waits. When the
compute device is the CPU the reduced shard already lies in host memory and the worker
reads it there: no landing buffer, no copy. On the last micro-batch the worker also
takes the shard's share of the global norm as it lands (the native norm over the same
segments, combined in unit order after backward, so bitwise what a pass after backward
gives). ``drain`` waits for all of it before the step reads the accumulators.

[Note: landings handed over in batches] Waking the landing worker once per unit costs
backward more than the landing itself where units are small: on a 2-core VM about 60 us a
unit on autograd's thread, most of it the GIL going to the woken worker and back. So
backward's hooks hand their landings over held (see [Note: held hand-offs] in
accelerator.py) and send them once LANDING_BATCH_BYTES of gradient is waiting, and at the
end of backward (``gradients_sent``): a unit of that size or more goes at once, as before,
smaller ones a few at a time. The D2H copies are not held: the hook issues each at once on
its stream. Waiting for any of the worker's events sends what is held first, so nothing
waits on a landing that was never handed over.

[Note: gradients read where they land] With one micro-batch per step (the optimizer state
in host memory or on NVMe) a unit's gradient is its only one, so nothing needs adding up: the
landing worker leaves it where it landed (the landing buffer; on a CPU device the reduced
shard itself, held until the step), in the compute dtype, with the factor the accumulation
would have applied, takes its norm there (the native norm multiplies each element by that
factor in float32 first) and Adam reads it there (its ``pre_scale``, the same rounding
before the clip factor): bitwise the accumulator's result without its pass over the shard
(read 2 bytes, write 4, read 4 again per element in bf16), which sits between the last
gradient and Adam on the landing worker. A landing buffer is then busy until the shard's
Adam has read it: the early step re-records the buffer's ``free`` event after each shard's
step. A unit whose gradient lands twice in one backward (none known today) has the first
added into its accumulator before the second is copied in. The fp32 accumulators are made
on first use, so a run that never accumulates never holds them (4 bytes per element of host
memory; they are plain memory: no copy engine reads them). The placement decides whether
gradients are read where they land (``Placement.grads_read_where_they_land``, offload/store/
placement.py), and its budget counts the accumulators exactly when they are not.

[Note: gradients accumulated on the device] With several micro-batches per step on a GPU,
adding each 16-bit gradient into a host accumulator costs a D2H copy per micro-batch and
a pass of the landing worker over 10 bytes per element (the 1.3B run on the H100 spent
621 ms a step there, 422 ms of it waited for by the step). A unit the placement plan
gives a device accumulator (offload/store/placement.py: as many as the device's room
allows, in unit order; the rest stay on the host) adds each micro-batch's reduced shard
into an fp32 buffer on the compute stream instead, after the reduction and after the
last step's copy of that buffer has read it. On the last micro-batch the sum goes down
once, in fp32, into the unit's fp32 landing buffer, and the landing worker treats it as
a gradient read where it lands with factor 1 (its norm, then Adam). The arithmetic is
the native kernel's (scale x gradient, then a fused multiply-add) done by torch's
kernels, which round the same way; a unit that got no gradient in the last micro-batch
sends its sum when the step begins (``send_held``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from offload.machine import native
from offload.machine.accelerator import Accelerator, Event
from offload.observe.telemetry import Telemetry
from offload.optim.overlapped_step import OverlappedStep
from offload.optim.shard_state import Overlap, Route, ShardPhase, ShardState, StateSplit, add_into
from offload.optim.speculation import Speculation

# Gradient bytes whose landings are handed to the worker together (see [Note: landings handed over in batches]):
# at a norm's 10-20 GB/s, 4 MiB is 200-400 us of landing work, several times a wake-up's cost.
LANDING_BATCH_BYTES = 4 << 20


class Landing(enum.Enum):
    """What the gradients now landing are: set when the last backward begins, reset when the step takes them."""

    COLLECTING = "collecting"  # an earlier micro-batch's: added up
    FINAL = "final"  # the last micro-batch's: their norm is taken as they land
    # ... and each unit's only one (see [Note: gradients read where they land])
    FINAL_IN_PLACE = "final, read where they land"


class ReducedShard(NamedTuple):
    """One unit's reduced gradient shard as backward hands it over, with what guards it: nothing reads ``grad``
    before ``ready``, and ``source`` lives until then."""

    unit: int  # the unit's index
    grad: torch.Tensor  # this rank's shard of the unit's reduced gradient (compute dtype, on the compute device)
    ready: Event | None  # the reduction (None: done already)
    source: torch.Tensor | None  # what the reduction reads (the unit's flat gradient): kept alive until ``ready``
    factor: float  # what the accumulation multiplies ``grad`` by (the average over ranks, after any predivide)


class PacedReads(Protocol):
    """Reads paced by the last backward's landings (the streamed lane's)."""

    def read_next(self) -> None: ...


class OnLanding(NamedTuple):
    """What acts on a shard as its gradient lands: ``speculation`` is claimed before the shard's gradient or state
    is touched (a speculative Adam may be reading them); ``step`` is told once the gradient is in (the backward's
    overlapped step); ``paced`` is called after each landing of the last backward, on the calling thread (the
    streamed lane's reads ahead, one a landing: see [Note: the streamed lane] in offload/optim/streamed_step.py)."""

    speculation: Speculation
    step: OverlappedStep
    paced: PacedReads | None = None


@dataclass(frozen=True)
class LandingPolicy:
    """How gradients land, as the placement chose (offload/store/placement.py)."""

    device_accumulated: frozenset[int] = frozenset()  # units whose sum is kept on the compute device
    # the plan counted no host accumulators (see [Note: gradients read where they land])
    reads_in_place: bool = False
    keeps_device_grads: bool = False  # see [Note: a device gradient kept as it landed] in optim/sharded.py


class GradientLanding:
    """This rank's gradients on their way into the shards' accumulators (or left where they land)."""

    def __init__(self, accel: Accelerator, shards: dict[int, ShardState], split: StateSplit,
                 on_landing: OnLanding, policy: LandingPolicy, *, threads: int | None,
                 telemetry: Telemetry) -> None:
        """``shards``: the optimizer's, by unit (this room reads and fills them); ``split``: which units' state is
        stepped on the host."""
        self.accel = accel
        self.shards = shards
        self.threads = threads
        self.telemetry = telemetry
        self.split = split
        self.speculation, self.overlapped, self.paced = on_landing
        offload = split.offload
        # Gradients leave the device on a stream of their own (no D2H when host memory is the device's), and the
        # landing worker adds them up (see [Note: gradients land]).
        self.d2h = accel.copy_stream("d2h") if offload and not accel.host_is_device else None
        self.worker = accel.host_queue("grad-land") if offload else None
        self.phase = Landing.COLLECTING
        self.overlap: Overlap | None = None  # the last backward's plan for stepping shards as they land
        self.reads_in_place = policy.reads_in_place  # where the plan counted no accumulators
        self.keeps_device_grads = policy.keeps_device_grads
        self._sent_in_place: set[int] = set()  # units whose gradient this backward left in its landing buffer
        self.device_accumulated = policy.device_accumulated if self.d2h is not None else frozenset()
        self._held: set[int] = set()  # device-accumulated units holding gradients not yet sent down
        self.deferred_copies = 0  # gradients that found their landing buffer busy (the worker copied them)
        self._unsent = 0  # bytes of gradient whose landing is held back (see [Note: landings handed over in batches])

    def last_begins(self, only: bool, overlap: Overlap | None) -> None:
        """The coming backward is the last micro-batch's (``only``: the step's only one); ``overlap``: its plan for
        stepping shards as they land."""
        # A call past the boundary comes after another final one (see [Note: more backward calls than micro-batches]
        # in offload/engine/accumulation.py): what that one left where it landed is added up before this one's.
        self.phase = Landing.FINAL_IN_PLACE if only and self.reads_in_place else Landing.FINAL
        self.overlap = overlap

    def stop_overlap(self) -> None:
        """The overlapped backward failed: no shard steps as it lands from here on."""
        self.overlap = None

    def end_accumulation(self) -> None:
        """On the training thread, when the step took the gradients: the next ones start a new accumulation, and
        the next gradient of every device accumulator a new sum."""
        self.overlap = None
        self.phase = Landing.COLLECTING
        self._sent_in_place.clear()
        self._held.clear()
        for index in self.device_accumulated:
            self.shards[index].new_device_sum()

    def clear(self) -> None:
        """The gradients are dropped (zero_grad)."""
        self.end_accumulation()

    def land(self, reduced: ReducedShard) -> None:
        """Add ``factor`` x the reduced gradient shard into its unit's fp32 accumulator (or, the step's only one,
        leave it where it lands: see [Note: gradients read where they land]), once the reduction completes. Called
        by backward's hooks: it never blocks the calling thread (see [Note: gradients land])."""
        if self.paced is not None and self.phase is not Landing.COLLECTING:
            self.paced.read_next()
        state = self.shards.get(reduced.unit)
        route = self._route(reduced.unit, state)
        if route is Route.NOWHERE:
            self.accel.compute_wait(reduced.ready)
            return
        assert state is not None
        if route is Route.DEVICE:
            self.accel.compute_wait(reduced.ready)
            if self.keeps_device_grads and state.grad is None:
                state.keep_landed(reduced.grad, reduced.factor, self.threads)
            else:
                state.add(reduced.grad, reduced.factor, self.threads)
            return
        # Decided now, on the calling thread: the worker may still be adding an earlier micro-batch's gradients
        # when the last one's backward begins, and those are neither final nor stepped.
        final, overlap = self.phase is not Landing.COLLECTING, self.overlap
        if route is Route.DEVICE_SUM:  # its sum's send waits for the delayed Adam, if need be
            self._add_on_device(state, reduced.grad, reduced.factor, reduced.ready)
            if final:
                self._send_sum(state, overlap)
            return
        self._land_on_host(state, reduced, route, final, overlap)

    def _route(self, index: int, state: ShardState | None) -> Route:
        """Unit ``index``'s route, chosen once and kept by its shard (chosen again after the refit moved it)."""
        if state is None:
            return Route.NOWHERE
        route = state.route
        if route is None:
            if not self.split.steps_on_host(index):
                route = Route.DEVICE
            elif state.on_device is not None:
                route = Route.DEVICE_SUM
            else:
                route = Route.HOST_READ if self.d2h is None else Route.COPIED
            state.routed(route)
        return route

    def moved_to_device(self, units: frozenset[int]) -> None:
        """These units are stepped on the device from now on (the refit): their sums are no longer the device's to
        send down (their shards forgot their routes as they moved)."""
        self.device_accumulated -= units

    def _land_on_host(self, state: ShardState, reduced: ReducedShard, route: Route, final: bool,
                      overlap: Overlap | None) -> None:
        """An offloaded unit's gradient: to the landing worker, through its landing buffer (``Route.COPIED``) or
        where it lies (``Route.HOST_READ``)."""
        assert self.worker is not None
        index, shard_grad, ready, scale = reduced.unit, reduced.grad, reduced.ready, reduced.factor
        land, events = self.worker, state.events
        adam_read = events.adam_read
        adam_busy = adam_read is not None and not adam_read.query()
        if adam_busy:  # the delayed Adam still reads the last gradient: nothing of this unit lands before it has
            assert adam_read is not None
            land.wait_event(adam_read, held=True)
        # the device gradient lives until its copy (or, read in place, its add) is done
        refs = [shard_grad, reduced.source]
        # A unit's second gradient in this backward: its first, left where it landed, is added up first, and every
        # later one is added (the unit stays in the set until the next last backward).
        again = index in self._sent_in_place
        in_place = self.phase is Landing.FINAL_IN_PLACE and not again
        if in_place:
            self._sent_in_place.add(index)
        if again:
            land.run(lambda: self._materialize(state), held=True)
        nbytes = shard_grad.numel() * shard_grad.element_size()
        if route is Route.HOST_READ:
            land.run(lambda: self._landed(state, shard_grad, ready, scale, final, overlap, refs, in_place), held=True)
        else:
            assert state.landing is not None
            landing = state.landing[:shard_grad.numel()]
            if events.free.query() and not again and not adam_busy:  # what last landed here is read: copy now
                copied = self._copy_down(state, landing, shard_grad, ready)
                land.run(lambda: self._landed(state, landing, copied, scale, final, overlap, refs, in_place),
                         held=True)
            else:  # still busy: the worker copies after it is done with the buffer (it runs in order)
                self.deferred_copies += 1
                land.run(lambda: self._landed(state, landing, self._copy_down(state, landing, shard_grad, ready),
                                              scale, final, overlap, refs, in_place), held=True)
            self.telemetry.add_bytes("d2h", nbytes)
        state.landing_busy_until(land.record(into=events.free, held=True))
        self._hand_over_landings(nbytes)

    def _hand_over_landings(self, nbytes: int) -> None:
        """``nbytes`` more of gradient is held for landing: the worker gets the batch once it is big enough."""
        self._unsent += nbytes
        if self._unsent >= LANDING_BATCH_BYTES:
            self.gradients_sent()

    def gradients_sent(self) -> None:
        """The landings held back so far go to the worker (see [Note: landings handed over in batches]); backward's
        end calls this."""
        if self.worker is not None:
            self._unsent = 0
            self.worker.flush()

    def _add_on_device(self, state: ShardState, shard_grad: torch.Tensor, scale: float, ready: Event | None) -> None:
        """On the compute stream, after the reduction and after the last sum's copy down read the accumulator."""
        assert state.on_device is not None
        self.accel.compute_wait(ready)
        self.accel.compute_wait(state.events.copied)
        add_into(state.on_device[:shard_grad.numel()], shard_grad, scale, overwrite=not state.device_holds,
                 threads=self.threads)
        state.added_on_device(self.accel.compute_event(into=state.events.added))
        self._held.add(state.index)

    def _send_sum(self, state: ShardState, overlap: Overlap | None) -> None:
        """The device accumulator's sum goes down in fp32, and the landing worker reads it where it lands (see
        [Note: gradients accumulated on the device])."""
        assert self.worker is not None and state.on_device is not None and state.landing is not None
        self._held.discard(state.index)
        events = state.events
        if not events.free.query():  # the worker still reads what landed here before (a second sum this backward)
            self.accel.wait(events.free, "a device-accumulated gradient's landing buffer")
        self.speculation.claim(state)  # ... and so may that sum's speculative Adam
        if events.adam_read is not None and not events.adam_read.query():  # the delayed Adam still reads it (rare:
            # the last micro-batch's sum, sent while the last step's Adam has not reached this unit)
            self.accel.wait(events.adam_read, "a landing buffer the delayed update reads")
        landing = state.landing  # set with the shard, never replaced
        copied = self._copy_down(state, landing, state.on_device, events.added)
        refs: list[Any] = []
        self.worker.run(lambda: self._landed(state, landing, copied, 1.0, True, overlap, refs, in_place=True),
                       held=True)
        state.landing_busy_until(self.worker.record(into=events.free, held=True))
        self.telemetry.add_bytes("d2h", state.on_device.numel() * 4)
        self._hand_over_landings(state.on_device.numel() * 4)

    def send_held(self) -> None:
        """Device-accumulated units that got no gradient in the last micro-batch send their sums now (the step
        begins)."""
        for index in sorted(self._held):
            self._send_sum(self.shards[index], None)

    def _copy_down(self, state: ShardState, landing: torch.Tensor, shard_grad: torch.Tensor, ready: Event | None
                   ) -> Event:
        """Enqueue the D2H copy of a gradient into its landing buffer after ``ready``; returns the copy's event."""
        assert self.d2h is not None
        tel, graph = self.telemetry, self.accel.graph

        def copy() -> None:
            graph.work("d2h", state.index, nbytes=shard_grad.numel() * shard_grad.element_size())
            with tel.span("d2h", state.name):
                landing.copy_(shard_grad, non_blocking=True)

        if ready is not None:
            self.d2h.wait_event(ready)
        self.d2h.run(copy)
        copied = self.d2h.record(into=state.events.copied)
        state.copied_by(copied)
        return copied

    def _landed(self, state: ShardState, grad: torch.Tensor, arrived: Event | None, scale: float, final: bool,
                overlap: Overlap | None, refs: list[Any], in_place: bool = False
                ) -> None:
        """On the landing worker: wait for the gradient, add it in (or, ``in_place``, leave it where it landed),
        take its norm if final, step if overlapped."""
        if arrived is not None:
            self.accel.wait(arrived, "gradient landed")
        del refs[:]  # a device gradient's copy is done: its memory may go
        self.speculation.claim(state)  # another gradient of the unit: its speculation is stale
        if state.phase is ShardPhase.STEPPED:  # a half-applied step's shard: this step is done with it
            return
        if state.phase is ShardPhase.SPECULATED:  # another gradient: the speculation is stale (it runs again)
            state.stale()
        graph = self.accel.graph
        if in_place:
            state.read_in_place(grad, scale)
        else:
            graph.work("accumulate", state.index, nbytes=grad.numel() * (grad.element_size() + 8))
            with self.telemetry.span("accumulate", state.name):
                state.add(grad, scale, self.threads)
        if final:
            values, factor = state.gradient()
            graph.work("norm", state.index, nbytes=values.numel() * values.element_size())
            with self.telemetry.span("landed_norm", state.name):
                state.took_norm([native.grad_sq_norm(values[seg.start:seg.end], threads=self.threads,
                                                     scale=factor) for seg in state.segments])
        self.overlapped.landed(state.index, overlap)

    def _materialize(self, state: ShardState) -> None:
        """On the landing worker: a gradient left where it landed goes into the accumulator (another is coming)."""
        self.speculation.claim(state)
        if state.phase is ShardPhase.SPECULATED:  # stale now (it runs again when the next gradient lands)
            state.stale()
        state.materialize(self.threads)

