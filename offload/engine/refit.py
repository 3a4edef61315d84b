"""`offload_optimizer.ratio: auto` corrected by the first step's measured peak.

[Note: the split refitted] Without a device budget, the start-up plan cannot know what the activations will
take (that depends on the batch and sequence the script feeds), so `auto` keeps the optimizer state of only as
many units on the device as half the memory then free holds (offload/store/placement.py). After the first
step the device's high-water mark is known: every activation, gather and device Adam of a step has run. The
room between that peak and the device's memory, less a margin for allocator slack and longer batches, takes
the optimizer state of more units, unit by unit in the order of need (the units after those already there:
the next forward's first), a host sub-group split where the room ends. Their state is copied to the device
from its current slot, their gradients are kept there (an fp32 accumulator each, or the 16-bit gradient of
one micro-batch: [Note: a device gradient kept as it landed] in offload/optim/sharded.py), and their host memory (state,
speculative slot, landing buffer, host copy of the shard) is given back; from the next step on they are
stepped by the device Adam. Beside offloaded parameters a unit's shard moves with its state where it was
homed on the host (as `auto` homes the units it keeps on the device at start-up), counted in the room; a
shard homed on NVMe ends the move. Every rank moves as many bytes as the rank with the least room allows, so
the ranks stay alike (unless the device runs out of memory part way on one: each part moves whole or not at
all, and where state lives is each rank's own). The refit runs once, after the first step, and never with a
device budget (the user's number is the plan's), the delayed update, or the state on NVMe;
`offload.auto_refit: false` turns it off. The room is what the allocator holds or could get after the step
(free plus reserved: the CUDA context, a collective's buffers and other processes take the rest) less the
step's peak and the margin; a rehomed unit at one rank is still gathered (copied on the device) rather than
read where it lives, as the units homed there at start-up are: its peak was counted in the first step's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from offload.config.fields import AUTO
from offload.engine import agreement
from offload.machine.accelerator import Accelerator
from offload.optim.sharded import ShardedAdam
from offload.store.sub_groups import SubGroup
from offload.store.tier import Tier
from offload.zero.collectives import Group, smallest

logger = logging.getLogger("offload.engine")

MARGIN_FRACTION = 0.05  # of the device's memory, kept free beside the first step's peak
MARGIN_MIN = 1 << 30


def refit_choice(groups: list[SubGroup], spare: int, shard_bytes: Callable[[int], int | None],
                 accumulated_on_device: frozenset[int], grad_bytes: int = 4) -> list[tuple[SubGroup, int]]:
    """The units whose state moves to the device within ``spare`` bytes, in the order of need (unit order), as
    (host sub-group, how many of its first units): each unit costs its state, the gradient it does not have there
    yet (``grad_bytes`` an element: an fp32 accumulator, or a 16-bit gradient kept until the step) and
    ``shard_bytes(unit)``, what its shard takes on the device beyond what it takes now (None: it cannot move, homed
    on NVMe); the first that does not fit, or cannot move, ends the choice."""
    chosen, used = [], 0
    for g in groups:
        if g.tier is Tier.DEVICE:
            continue
        if g.tier is not Tier.HOST:
            break
        count = 0
        for m in g.members:
            shard = shard_bytes(m.unit)
            if shard is None:
                break
            state = g.fmt.high_in_state().bytes_per_element * m.numel  # on the device, a lent high half too
            cost = state + (0 if m.unit in accumulated_on_device else grad_bytes * m.numel) + shard
            if used + cost > spare:
                break
            used += cost
            count += 1
        if count:
            chosen.append((g, count))
        if count < len(g.members):
            break
    return chosen


def refits(config: Any, *, sized: bool, delayed: bool) -> bool:
    """Whether the first step corrects the split: auto without a device budget, the state on the host, a device
    whose memory has a size (a GPU), no delayed update, and offload.auto_refit on."""
    zero = config.zero_optimization
    return (bool(config.offload.auto_refit) and zero.offload_optimizer.ratio is AUTO and sized and not delayed
            and zero.offload_optimizer.device == "cpu" and config.offload.budgets.device is None)


def margin(total: int) -> int:
    """Device bytes the refit leaves free beside a step's peak, for allocator slack and longer batches."""
    return max(MARGIN_MIN, int(MARGIN_FRACTION * total))


def spare_after(total: int, available: int, peak: int) -> int:
    """Device bytes free beside a step's ``peak``, less the margin: of what the allocator holds or could get now
    (``available``: free plus reserved), on a device of ``total`` bytes."""
    return max(0, available - peak - margin(total))


def room_beside(total: int, activations: int) -> int:
    """The device bytes a refit leaves offload's own state and gathers beside ``activations`` (what `offload
    estimate` predicts the refit ends with: the first step's peak is those plus the activations)."""
    return max(0, total - activations - margin(total))


class Refit:
    """The one correction of `auto`'s split after the first step (see [Note: the split refitted])."""

    def __init__(self, config: Any, accel: Accelerator, optimizer: ShardedAdam, group: Group,
                 delayed: bool) -> None:
        self.accel, self.optimizer, self.group = accel, optimizer, group
        self.armed = refits(config, sized=accel.total_bytes() is not None, delayed=delayed)
        if self.armed:  # the peak that counts is this engine's: its state, then the first step's work
            accel.reset_peak()

    def after_step(self) -> None:
        """After the first step: the refit, once (every rank, as it agrees on the room)."""
        if not self.armed:
            return
        self.armed = False
        # A host thread's failure surfaces on every rank here, not on one alone (see [Note: one rank's failed step]).
        agreement.drained(self.optimizer, self.group, self.accel, "the refit's agreement on the device's room")
        total, free = self.accel.total_bytes(), self.accel.free_bytes()
        assert total is not None and free is not None  # armed only where the device has a size
        stats = self.accel.memory_stats()
        # What the allocator holds or could get now (the CUDA context, a collective's buffers and other processes
        # take the rest), less the first step's peak and the margin.
        spare = smallest(spare_after(total, free + stats.reserved, stats.peak_allocated), self.group,
                         self.accel.device)
        moved = self.apply(spare)
        logger.info("rank %d: the first step peaked at %.2f GiB of the device's %.2f GiB; offload_optimizer.ratio "
                    "auto %s", self.group.rank, stats.peak_allocated / 2**30, total / 2**30,
                    f"moved the optimizer state of {moved} more units to the device, which steps it from now on"
                    if moved else "keeps its split (no more room beside the peak and its margin)")

    def apply(self, spare: int) -> int:
        """Move what ``spare`` device bytes hold; returns the units moved. The device running out of memory part
        way (another process took some) stops the move there on this rank: what moved steps on the device, the
        rest stays (the ranks then differ in where some state lives, which no collective depends on)."""
        opt = self.optimizer
        opt.drain()  # every shard's gradient used and every step run before the choice reads them
        # a streamed sub-group moves too, first in the order of need: its gradients are on the device already
        streamed = frozenset(m.unit for g in opt.sub_groups if g.streamed for m in g.members)
        groups = refit_choice(list(opt.sub_groups), spare, opt.shard_bytes_to_move,
                              opt.device_accumulated | streamed, opt.device_grad_bytes)
        if not groups:
            return 0
        host_before = opt.host_used
        wanted = {m.unit for g, count in groups for m in g.members[:count]}
        try:
            opt.move_to_device(groups)
        except torch.OutOfMemoryError as e:
            logger.warning("rank %d: moving optimizer state to the device stopped, out of its memory (%s)",
                           self.group.rank, str(e).splitlines()[0])
        moved = [m for g in opt.sub_groups if g.tier is Tier.DEVICE for m in g.members if m.unit in wanted]
        logger.info("rank %d: %d units' optimizer state (%s elements) moved to the device; %.2f GiB of host memory "
                    "given back", self.group.rank, len(moved), f"{sum(m.numel for m in moved):,}",
                    (host_before - opt.host_used) / 2**30)
        return len(moved)
