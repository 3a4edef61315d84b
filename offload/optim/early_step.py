"""The step handed to a host thread so that engine.step() returns before Adam: the early step (exact, the next
forward waits per unit), with its NVMe pass, and the delayed update (opt-in, one step late). Which one runs is
offload/engine/step_schedule.py's choice (``Early``, ``EarlyNvme``, ``Delayed``).

[Note: early step] With the state on the host (no NVMe transfer can fail half way) and
ZeRO stage 3, ``apply_early`` hands the step to the landing worker and returns: Adam runs
there shard by shard in unit order, the forward's order, each new shard copied back at
once, while the training thread goes on into the next forward. The parameter store keeps
each shard's step event, and the shard's next reader waits for it (its gather, or an
in-place unit's first use): the forward waits per unit, only for the units Adam has not
reached. The next backward's gradients queue behind the step on the same worker, so
none lands in an accumulator Adam still reads; every other reader of the optimizer state
drains the worker first. Same kernel, same values: bitwise the step after backward.

[Note: the early step on NVMe] With optimizer state on NVMe, the early step
runs the step's NVMe pass on the landing worker too, in the forward's order: a sub-group is taken once its read
completes, its shards stepped and each new shard copied back at once (the forward waits per unit, as above), and
its write to the other slot starts; the last write's completion flips the slots. The pass's first reads start when
the last backward does, in that order, queued behind the last step's pass on the same worker. So the reads, Adam
and the writes of the state all run beside the next forward and backward instead of between them, which on a
machine where they are mostly I/O takes the disk off the step. It runs only on steps whose backward did not step
the NVMe sub-groups itself (overlapped or speculated: those passes run in backward's order and finish in the step).
What it gives up: a transfer that fails after step() returned (or anything else in the pass: every task of such a
step runs guarded, so the worker itself goes on) cannot leave the last step intact, since some units' new parameters
already reached the forward; the pass stops (no slot flips: the swap file keeps the state of the step before), the
rest of the step is dropped with its gradients, and every later drain (the next step, a checkpoint) raises
``EarlyStepLost`` saying so; close() still releases everything. The engine must be rebuilt from the last checkpoint.
At W > 1 the next step says it on every rank (see [Note: one rank's failed step] in offload/engine/agreement.py). Hence
``early_step: auto`` leaves a step with NVMe state whole (a failed transfer there is retried), and ``on`` opts in.
Parameter shards homed on NVMe step early the same way, each made current on its own once written (see [Note: an
early step's parameter writes] in offload/store/param_swap.py); a parameter write that fails then leaves the unit
stale, and the forward that needs it rewrites it from its master first (the step stands).

[Note: delayed update] Opt-in (offload.delayed_update), and not exact by design: ZeRO-Offload's
delayed parameter update. The step is the early step's, but on a host thread of its own, in
backward's unit order, and nothing waits for it: the next forward and backward read the
parameters from before the update. Where compute reads the step's target (a host home, a CPU
device) each new 16-bit shard goes to a staging buffer of its own; a device home's separate
host copy is written in place, and only its copy back waits. The next backward's gradients
land on the landing worker beside it (on one thread they queued behind the whole pass: on an
H100 that was a 22 ms gradient wait a step); each unit's landing first waits for the update
to have read that unit's last gradient (``adam_read``), and backward's order makes that the
first unit stepped. The next engine.step() first ``publish``es it (drains both threads,
copies each staged shard's segments to its target, starts every copy back), then runs its
own; so update t reaches the parameters at step t + 1. Everything that writes the model out
(checkpoints, 16-bit saves) publishes first; readers of the master weights see the newest
update, as they would after any step. A loaded checkpoint drops what was staged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from offload.machine.accelerator import Event, WorkerStream
from offload.observe.telemetry import Telemetry
from offload.optim.hyper import Hyper
from offload.optim.shard_state import ShardPhase
from offload.optim.speculation import Speculation
from offload.optim.streamed_step import StreamedStep
from offload.optim.update import ShardUpdate
from offload.store.optimizer_state import NvmePass, OptimizerStateStore
from offload.store.sub_groups import Member, SubGroup
from offload.store.tier import Tier


class EarlyStepLost(RuntimeError):
    """Work of a step that had returned early (an NVMe transfer, Adam) failed (see [Note: the early step on NVMe])."""


class EarlyLanes(NamedTuple):
    """Where the early step hands its work: ``worker``, the landing worker, which runs the early step; ``adam``, the
    delayed update's thread (None: no delayed update); ``streamed``, the streamed sub-groups' step, on the compute
    stream before step() returns, as the device-resident ones' (None: no such sub-group)."""

    worker: WorkerStream | None
    adam: WorkerStream | None = None
    streamed: StreamedStep | None = None


class EarlyStep:
    """The early and the delayed step's work on their threads, and what they leave: the NVMe pass in flight, the
    delayed update's staged shards and the units not yet published, a lost step."""

    def __init__(self, update: ShardUpdate, store: OptimizerStateStore, speculation: Speculation,
                 telemetry: Telemetry, lanes: EarlyLanes, staged_units: frozenset[int]) -> None:
        """``update``: one shard's Adam, with the accelerator, the shards and the parameter store it writes (this
        step's too); ``staged_units``: the placement's units whose new shard waits in a staging buffer."""
        self.accel, self.shards, self.store, self.params = update.accel, update.shards, store, update.params
        self.update, self.speculation, self.telemetry = update, speculation, telemetry
        self._land, self.adam, self.streamed = lanes
        self._staged_units = staged_units
        self.staged: dict[int, torch.Tensor] = {}  # the delayed update's staged shards, by unit
        self.pending: set[int] = set()  # ... and the units whose staged shard is not yet published
        self.lost: EarlyStepLost | None = None  # sticky (see [Note: the early step on NVMe])
        self.nvme_pass: NvmePass | None = None  # an early step's NVMe pass, until the landing worker finished it

    def add_staging(self, index: int, numel: int, dtype: torch.dtype) -> None:
        if index in self._staged_units:  # the placement stages only for the delayed update
            self.staged[index] = torch.empty(numel, dtype=dtype)  # written before it is read

    def abort(self) -> None:
        """Closing: a worker that failed outside the pass's guard left it running; its I/O ends first."""
        run, self.nvme_pass = self.nvme_pass, None
        if run is not None:
            run.abort()

    def run(self, grad_scale: float, hypers: list[Hyper], step: int, delayed: bool = False) -> None:
        """Step ``step`` handed to the landing worker (``delayed``: to the delayed update's thread, the new shards
        staged until ``publish``); returns at once (see [Note: early step], [Note: delayed update])."""
        assert not delayed or self.adam is not None
        after = self.update.after_compute()  # the shards' last reads
        lane = self.adam if delayed else self._land
        assert lane is not None
        # Last step's copies back read the host copies this step rewrites.
        lane.run(lambda: self.params.wait_copies_back())
        self.params.forget_reads(self.update.nvme_units)  # what the read buffers hold of them is the step before
        if self.streamed is not None:
            self.streamed.run_until()  # a step deferred and never read (see [Note: streamed steps deferred])
        later: list[tuple[SubGroup, Member]] = []  # the delayed update's, handed over in backward's order
        deferring = False  # from the first streamed sub-group not read ahead on (see [Note: streamed steps deferred])
        for group in self.store.groups:  # on the compute stream, before step() returns (and before the NVMe pass)
            if group.streamed:
                assert self.streamed is not None
                deferring = deferring or not self.streamed.ready(group)
                if deferring:
                    self.streamed.defer(group, step, hypers, grad_scale)
                else:
                    self.streamed.step(group, step, hypers, grad_scale)
                    for member in group.members:
                        self.shards[member.unit].empty()
            elif group.tier is Tier.DEVICE:
                for member in group.members:
                    self.update.step_shard(member.unit, group.views(member), step, hypers, grad_scale)
                    self.shards[member.unit].empty()
        # The NVMe pass in the forward's order; from here on only the landing worker touches it, and every task of
        # this step runs guarded by it (see [Note: the early step on NVMe]).
        run = self.nvme_pass = self.store.detach_pass()
        for group in self.store.groups:
            if group.tier is Tier.NVME:
                assert run is not None
                self._hand_over_sub_group(lane, run, group, step, hypers, grad_scale, after)
            elif group.tier is not Tier.DEVICE and not group.streamed:
                for member in group.members:
                    if delayed:
                        later.append((group, member))
                    else:
                        self._hand_over(lane, group, member, step, hypers, grad_scale, after, run=run)
        if run is not None:
            lane.run(lambda: self._early_task(run, step, lambda: self._finish_early(run)))
        # The next backward's first gradients wait for the first shards the delayed update steps.
        for group, member in reversed(later):
            self._hand_over(lane, group, member, step, hypers, grad_scale, after, delayed=True)

    def _hand_over(self, lane: WorkerStream, group: SubGroup, member: Member, step: int, hypers: list[Hyper],
                   grad_scale: float, after: Event, delayed: bool = False, run: NvmePass | None = None) -> None:
        """One shard's early (or delayed) step queued on ``lane``, and the events its next readers wait for;
        ``run``: the step's NVMe pass, which a failure stops (see [Note: the early step on NVMe])."""
        self.accel.graph.work("hook_step", member.unit)
        if run is None:
            lane.run(lambda: self._step_early(group, member, step, hypers, grad_scale, after, delayed))
        else:
            lane.run(lambda: self._early_task(run, step, lambda: self._step_early(group, member, step, hypers,
                                                                                 grad_scale, after)))
        state = self.shards[member.unit]
        if delayed:  # nothing reads the staged shard before publish() drains the thread
            state.read_by_adam(lane.record(into=state.events.adam_read))
            self.pending.add(member.unit)
        else:
            state.landing_busy_until(lane.record(into=state.events.free))  # one read where it landed is read by now
            self.params.step_pending(member.unit, lane)

    def _hand_over_sub_group(self, lane: WorkerStream, run: NvmePass, group: SubGroup, step: int,
                             hypers: list[Hyper], grad_scale: float, after: Event) -> None:
        """An NVMe sub-group's part of the early step, queued on ``lane``: taken once read, its shards stepped
        (each with its events, as a host shard's), then written to the other slot."""
        def take() -> None:
            taken = run.take()
            assert taken is group, f"the NVMe pass took sub-group {taken.index}, the early step expected {group.index}"

        lane.run(lambda: self._early_task(run, step, take))
        for member in group.members:
            self._hand_over(lane, group, member, step, hypers, grad_scale, after, run=run)
        lane.run(lambda: self._early_task(run, step, lambda: run.release(group)))

    def _finish_early(self, run: NvmePass) -> None:
        """The early pass's last writes completed and its slots flipped: the buffers are free."""
        run.finish()
        self.nvme_pass = None

    def _early_task(self, run: NvmePass, step: int, work: Callable[[], None]) -> None:
        """On the landing worker: one task of an early step with an NVMe pass (a transfer, a shard's Adam); any
        failure stops the pass and loses the step, and the worker goes on (see [Note: the early step on NVMe])."""
        if self.lost is not None:  # the step is lost: the rest of its tasks do nothing
            return
        try:
            work()
        except Exception as e:  # noqa: BLE001 - said by every later drain
            what = "an NVMe transfer" if isinstance(e, OSError) else f"the update ({type(e).__name__})"
            self.lost = EarlyStepLost(
                f"{what} of step {step}'s optimizer state failed after step() had returned ({e}): the swap "
                f"file still holds the optimizer state of step {step - 1}, but some parameters had already taken "
                f"step {step}'s values and the rest of that step was dropped, so this engine cannot go on; build a new "
                "one and load the last checkpoint (offload.early_step \"auto\" or \"off\" keeps a step with its "
                "optimizer state on NVMe whole, and a failed transfer then leaves it retryable)")
            self.lost.__cause__ = e
            run.abort()
            self.nvme_pass = None
            for state in self.shards.values():  # the rest of the step is dropped with its gradients
                if state.phase is ShardPhase.HOLDING:
                    state.empty()

    def _step_early(self, group: SubGroup, member: Member, step: int, hypers: list[Hyper], grad_scale: float,
                    after: Event, delayed: bool = False) -> None:
        index = member.unit
        state = self.shards[index]
        self.speculation.claim(state)
        if state.phase is not ShardPhase.STEPPED:
            with self.telemetry.span("optimizer_delayed" if delayed else "optimizer_early", state.name):
                if state.phase is ShardPhase.SPECULATED:
                    self.speculation.settle(group, member, step, hypers, grad_scale)
                else:
                    self.update.step_shard(index, group.views(member), step, hypers, grad_scale,
                                     target=self.staged.get(index) if delayed else None)
            if not delayed:
                self.params.copy_back(index, after=after)
                self.params.commit_early(index)  # an NVMe shard becomes current once written
        state.empty()

    def publish(self) -> None:
        """The last delayed step's new shards reach the parameters (see [Note: delayed update]); the optimizer
        drained both threads first."""
        self.params.wait_copies_back()  # the last publish's copies back read the targets rewritten here
        after = self.update.after_compute()
        with self.telemetry.span("publish"):
            for index in sorted(self.pending):
                if index in self.staged:
                    out, staged = self.params.step_target(index), self.staged[index]
                    for seg in self.shards[index].segments:
                        out[seg.start:seg.end].copy_(staged[seg.start:seg.end])
                self.params.wrote(index)
                self.params.copy_back(index, after=after)
        self.pending.clear()
