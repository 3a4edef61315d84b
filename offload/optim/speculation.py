"""The speculative step: Adam during the last backward with a guessed clip factor, kept or recomputed once the norm
is known. How it is chosen is offload/engine/step_schedule.py's (``Speculative``); the lane it runs on for host
shards is speculation_lane.py's; the second slot it writes is the store's (offload/store/optimizer_state.py).

[Note: speculative step] Clipping (or fp16's overflow check) makes every shard's update
wait for the global norm, so the overlapped step above cannot run. Yet the factor it waits
for is usually known in advance: clipping does not fire on most steps, and then the factor
is exactly ``unclipped_factor`` (the unscale alone). So, with ``guess`` set when the last
backward begins, each host-resident shard's Adam runs as its gradient lands (on a host thread
of its own: see [Note: speculation on a lane of its own] in offload/optim/speculation_lane.py,
which also says how the step takes over a shard not yet begun), as in the overlapped step,
but with the guessed factor and into the other slot of
its state (offload/store/optimizer_state.py: [Note: the speculative slot]; the elements no
segment covers are copied over), leaving the state of the last step intact: the shard is
SPECULATED. Its new 16-bit shard is written to the step's target but not copied back. When
the step's factor, hyperparameters and step number are the ones guessed, the step keeps the
other slot (``flip``) and copies the shard back; otherwise it runs Adam again from the
current slot with the real factor into the other slot, then flips: the same kernel on the
same values either way, so bitwise the step after backward. A step that does not happen
(fp16 overflow, a failed backward, ``zero_grad``) drops the speculation and rewrites the
target from the current master (what the last step wrote there: the kernel's rounding of the
same value). An NVMe sub-group needs no second slot in memory: its swap file has two, and
the pass writes the one that is not current (see the store's [Note: NVMe sub-groups stepped
during backward]), so it is stepped in its read buffer with the guess once all its units'
gradients are in; a wrong guess aborts the pass (nothing flips) and the step runs it again
from the current slots; a dropped speculation aborts it and reads each master back for the
target. Units whose parameters are homed on NVMe step after backward.
"""

from __future__ import annotations

import logging

from offload.observe.telemetry import Telemetry
from offload.optim.hyper import Hyper
from offload.optim.shard_state import Guess, Overlap, ShardPhase, ShardState, unstep
from offload.optim.speculation_lane import SpeculationLane, TicketPhase
from offload.optim.update import ShardUpdate
from offload.store.optimizer_state import OptimizerStateStore
from offload.store.state_format import StateSlot
from offload.store.sub_groups import Member, SubGroup
from offload.store.tier import Tier

logger = logging.getLogger("offload.optim")


class Speculation:
    """This rank's speculated shards: host ones on their lane (``lane``, None without host second slots), NVMe ones
    in their read buffers on the landing worker."""

    def __init__(self, shards: dict[int, ShardState], store: OptimizerStateStore, update: ShardUpdate,
                 telemetry: Telemetry, lane: SpeculationLane | None) -> None:
        self.shards, self.store, self.update, self.telemetry = shards, store, update, telemetry
        self.lane = lane

    def hand_over(self, index: int, group: SubGroup, member: Member, overlap: Overlap) -> None:
        """A host shard's gradient is in: its speculative Adam goes to the lane."""
        assert self.lane is not None  # a host shard speculates only with its second slot (plan.second_slots)
        self.lane.hand_over(index, lambda: self._speculate_or_leave(group, member, overlap))

    def _speculate(self, group: SubGroup, member: Member, overlap: Overlap) -> None:
        """On the speculation lane: Adam with the guessed factor into the other slot (see [Note: speculative
        step])."""
        state = self.shards[member.unit]
        if state.phase is not ShardPhase.HOLDING:
            return
        assert overlap.guess is not None
        current, other = group.views(member), group.views(member, other=True)
        for start, end in state.gaps:  # the other slot becomes current whole
            for src, dst in zip(current, other, strict=True):
                dst[start:end].copy_(src[start:end])
        with self.telemetry.span("optimizer_speculative", state.name):
            self.update.step_shard(member.unit, current, overlap.step, overlap.hypers, overlap.guess, into=other)
        state.speculated(Guess(overlap.guess, tuple(overlap.hypers), overlap.step))

    def _speculate_or_leave(self, group: SubGroup, member: Member, overlap: Overlap) -> None:
        """On the speculation lane: a speculation that fails is left to the step, which then steps the shard from
        its intact current slot (a guess is only ever a head start), so the lane goes on and nothing half-done
        reaches a claim."""
        state = self.shards[member.unit]
        try:
            self._speculate(group, member, overlap)
        except Exception as e:  # noqa: BLE001 - the step redoes it; said below
            logger.warning("unit %r: its speculative Adam failed (%s: %s); the step runs it", state.name,
                           type(e).__name__, e)
            with self.telemetry.span("speculation_failed", state.name):
                self.update.restore_target(member.unit, group.views(member)[0])  # the guess may have written part of it
            if state.phase is ShardPhase.SPECULATED:
                state.stale()

    def claim(self, state: ShardState) -> None:
        """Before this thread touches the shard's gradient or state (see [Note: speculation on a lane of its
        own])."""
        if self.lane is not None and self.lane.claim(state.index) is TicketPhase.CANCELLED:
            with self.telemetry.span("speculation_cancelled", state.name):
                pass

    def in_place(self, index: int, views: StateSlot, overlap: Overlap) -> None:
        """On the landing worker: an NVMe sub-group's shard stepped with the guess in its read buffer."""
        state = self.shards[index]
        if state.phase is not ShardPhase.HOLDING:
            return
        assert overlap.guess is not None
        with self.telemetry.span("optimizer_speculative", state.name):
            self.update.step_shard(index, views, overlap.step, overlap.hypers, overlap.guess)
        state.speculated(Guess(overlap.guess, tuple(overlap.hypers), overlap.step))

    def _nvme_speculated(self) -> list[ShardState]:
        return [s for i, s in self.shards.items()
                if s.phase is ShardPhase.SPECULATED and self.store.place(i)[0].tier is Tier.NVME]

    def settle_nvme(self, step: int, hypers: list[Hyper], grad_scale: float) -> None:
        """Before the step's pass goes on: keep the speculated NVMe sub-groups (their new slots flip with the
        pass), or, if the guess was wrong for them, abort the pass so that it steps every one again."""
        speculated = self._nvme_speculated()
        if not speculated:
            return
        kept = all(s.guessed == Guess(grad_scale, tuple(hypers), step) for s in speculated)
        for state in speculated:
            with self.telemetry.span("speculation_kept" if kept else "speculation_recomputed", state.name):
                pass
        if not kept:
            unstep(self.shards, self.store.abort_pass())

    def unspeculate_nvme(self) -> None:
        """No step follows (or something else needs the buffers first): the speculated NVMe sub-groups' new
        slots are dropped with the pass, and each of their targets gets the current master's value back."""
        speculated = self._nvme_speculated()
        if not speculated:
            return
        unstep(self.shards, self.store.abort_pass())
        for state in speculated:
            self.update.restore_target(state.index, self.store.fmt.weights_of(self.store.read_master(state.index)))

    def settle(self, group: SubGroup, member: Member, step: int, hypers: list[Hyper],
                            grad_scale: float) -> None:
        """The step's factor is known: keep the speculated slot, or recompute it with that factor."""
        state = self.shards[member.unit]
        if state.guessed == Guess(grad_scale, tuple(hypers), step):
            with self.telemetry.span("speculation_kept", state.name):
                pass
        else:
            with self.telemetry.span("speculation_recomputed", state.name):
                self.update.step_shard(member.unit, group.views(member), step, hypers, grad_scale,
                                 into=group.views(member, other=True))
        group.flip(member)
        state.settled()

    def drop(self, phase: ShardPhase = ShardPhase.EMPTY) -> None:
        """No step follows the speculation: the state stays as it was, and each speculated shard's target gets
        the current master's 16-bit value back (see [Note: speculative step])."""
        for index, state in self.shards.items():
            if state.phase is not ShardPhase.SPECULATED:
                continue
            group, member = self.store.place(index)  # a host one (NVMe ones: ``_unspeculate_nvme``)
            self.update.restore_target(index, group.views(member)[0])
            if phase is ShardPhase.EMPTY:
                state.empty()
            else:
                state.stale()
