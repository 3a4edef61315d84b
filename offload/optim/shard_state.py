"""One unit's optimizer shard as the step sees it: its segments (runs of one param group), the phase it is in
this step ([Note: shard phases]) and the buffers its gradient moves through, kept by ShardedAdam
(offload/optim/sharded.py, which has the notes on how gradients land and how the step runs)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.machine import native
from offload.machine.accelerator import DoneEvent, Event
from offload.optim.hyper import Hyper
from offload.store.sub_groups import SubGroup
from offload.store.tier import Tier


@dataclass(frozen=True)
class Segment:
    """A run of a shard whose elements all belong to one param group (``start``/``end`` shard-relative)."""

    start: int
    end: int
    group: int


def shard_segments(slots: Iterable[Any], start: int, numel: int, group_of: dict[int, int],
                   per_param: bool = False) -> list[Segment]:
    """The optimizer segments of the shard [start, start + numel) of a flat buffer whose parameters sit at
    ``slots`` (each with ``param``, ``offset`` and ``numel``); padding and params in no group are left out.
    Neighbours of one group make one segment, or (``per_param``) each parameter's piece is one."""
    lo, hi = start, start + numel
    segments: list[Segment] = []
    for slot in slots:
        group = group_of.get(id(slot.param))
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if group is None or start >= end:
            continue
        if not per_param and segments and segments[-1].group == group and segments[-1].end == start - lo:
            segments[-1] = Segment(segments[-1].start, end - lo, group)
        else:
            segments.append(Segment(start - lo, end - lo, group))
    return segments


@dataclass
class StateSplit:
    """Which units' optimizer state is stepped on the host and which on the compute device (see [Note: a partial
    offload] in offload/optim/sharded.py): the one owner of that fact, read by the landing, the update and the step;
    the refit moves units to the device (``move_to_device``)."""

    offload: bool  # offload_optimizer.device is not "none"
    on_device: frozenset[int] = frozenset()  # an offloading optimizer's units stepped on the device all the same
    # units whose state is homed on the host and stepped on the device (see [Note: the streamed lane])
    streamed: frozenset[int] = frozenset()
    # of those, the units homed on NVMe: their new shards leave through a host copy, as the host lane's (see [Note:
    # NVMe state streamed] in offload/optim/streamed_step.py)
    through_host: frozenset[int] = frozenset()

    @classmethod
    def planned(cls, offload: bool, groups: Iterable[SubGroup]) -> StateSplit:
        """The split the placement's sub-groups make."""
        def units(keep: Callable[[SubGroup], bool]) -> frozenset[int]:
            return frozenset(m.unit for g in groups if keep(g) for m in g.members)
        return cls(offload, units(lambda g: g.tier is Tier.DEVICE) if offload else frozenset(),
                   units(lambda g: g.streamed), units(lambda g: g.streamed and g.tier is Tier.NVME))

    def steps_on_host(self, index: int) -> bool:
        """Whether unit ``index``'s state is offloaded and the host steps it (its step writes a host copy of the
        shard)."""
        return self.offload and index not in self.on_device and index not in self.streamed

    def writes_host_copy(self, index: int) -> bool:
        """Whether the step writes unit ``index``'s new shard into a host copy (a device home's then copied back)."""
        return self.steps_on_host(index) or index in self.through_host

    @property
    def partial(self) -> bool:
        return bool(self.on_device)

    def move_to_device(self, units: frozenset[int]) -> None:
        self.on_device |= units
        self.streamed -= units  # a streamed unit's state now stays where it is stepped
        self.through_host -= units


class ShardPhase(enum.Enum):
    """Where one shard is in the current step.

    [Note: shard phases] A gradient moves EMPTY to HOLDING (the first overwrites the accumulator, later ones add);
    Adam during backward moves HOLDING to STEPPED; ``apply`` steps EMPTY (zeros) and HOLDING shards, skips STEPPED
    ones and leaves every shard EMPTY. ``clear_grads`` empties HOLDING shards but keeps STEPPED ones: a backward that
    failed after stepping some shards left the step half applied, and the next step finishes it without stepping
    those again (a retried backward's gradients for them are dropped). A failed NVMe write of a stepped sub-group
    moves its shards back to HOLDING: the next step steps them again from the state on disk. The speculative step
    moves HOLDING to SPECULATED; ``apply`` keeps or recomputes it; dropping the speculation (``clear_grads``, a
    failed backward) moves it back, and another gradient of the unit in the same backward to HOLDING."""

    EMPTY = "empty"
    HOLDING = "holding"
    SPECULATED = "speculated"  # holding, and Adam ran with a guessed factor into the other slot
    STEPPED = "stepped"


class Route(enum.Enum):
    """How a unit's reduced shard reaches its optimizer state: fixed by where that state is stepped and whether
    the machine copies it down, so chosen once a unit (``GradientLanding._route``, kept by the shard), not at every
    landing."""

    NOWHERE = "no optimizer state: only waited for"
    DEVICE = "stepped on the device: added into its device accumulator, or kept as it landed"
    DEVICE_SUM = "offloaded, summed on the device: the sum goes down once, in fp32, on the last micro-batch"
    HOST_READ = "offloaded, and host memory is the device's: the landing worker reads it where it lies"
    COPIED = "offloaded: copied down into its landing buffer, where the landing worker reads it"


@dataclass(frozen=True)
class Guess:
    """The factor, hyperparameters and step number a speculative Adam ran with: kept when the step's are these."""

    factor: float
    hypers: tuple[Hyper, ...]
    step: int


@dataclass(frozen=True)
class Overlap:
    """The last backward's plan for stepping shards as their gradients land: which units, with what."""

    units: frozenset[int]
    hypers: list[Hyper]
    step: int
    # Speculating with this factor (see [Note: speculative step] in speculation.py); None: exact.
    guess: float | None = None


@dataclass
class ShardEvents:
    """What orders a shard's buffers between the threads and streams that touch them, each re-recorded by its
    writer (see [Note: events re-recorded] in offload/machine/accelerator.py); the shard owns them, and each is set
    through the one ShardState method named for the fact it records."""

    free: Event = field(default_factory=DoneEvent)  # the landing buffer is free once this completes
    copied: Event | None = None  # the last gradient's copy into the landing buffer
    adam_read: Event | None = None  # the delayed update's Adam has read this shard's gradient (optimizer thread)
    added: Event | None = None  # the last add into the device accumulator (``on_device``)


@dataclass
class ShardState:
    """One unit's per-rank optimizer buffers besides master/moments (those live in the state store), and the phase
    its gradient is in. The phase changes only through the named transitions below, each of which checks the phase
    it leaves ([Note: shard phases]); the landing, the speculation and the step call them, and read the rest."""

    index: int  # the unit's
    name: str  # the unit's, for traces
    grad: torch.Tensor | None  # fp32 accumulator (host when offloaded; made on first use, see accumulator())
    segments: list[Segment]
    gaps: list[tuple[int, int]] = field(default_factory=list)  # elements no segment covers (frozen, padding)
    phase: ShardPhase = ShardPhase.EMPTY
    numel: int = 0  # the shard's elements
    landing: torch.Tensor | None = None  # where the gradient lands from a separate device (host, compute dtype)
    events: ShardEvents = field(default_factory=ShardEvents)
    norm: list[native.SqNorm] | None = None  # the final gradient's norm per segment, taken as it landed
    # This step's only gradient, read in its landing buffer with its factor (see [Note: gradients read where they
    # land]), or a device-stepped unit's kept as it was reduced (or, reduced twice, their fp32 sum: see [Note: a
    # device gradient kept as it landed] in sharded.py); None while the accumulator holds the gradient.
    landed: torch.Tensor | None = None
    landed_scale: float = 1.0
    # The fp32 accumulator on the compute device (see [Note: gradients accumulated on the device]), and whether it
    # holds this step's gradients so far (the training thread's flag: the next add overwrites it when not).
    on_device: torch.Tensor | None = None
    device_holds: bool = False
    guessed: Guess | None = None  # what a SPECULATED shard's Adam assumed ([Note: speculative step], speculation.py)
    route: Route | None = None  # how its reduced gradient comes in, once the landing chose it (``routed``)

    def gradient(self) -> tuple[torch.Tensor, float]:
        """The gradient the step reads, and the factor to read it with (a shard that holds one: not EMPTY)."""
        if self.landed is not None:
            return self.landed, self.landed_scale
        assert self.grad is not None, f"unit {self.name!r} holds no gradient"
        return self.grad, 1.0

    def accumulator(self) -> torch.Tensor:
        """The fp32 accumulator, made now if this is its first use (host memory, unpinned)."""
        if self.grad is None:
            self.grad = torch.zeros(self.numel, dtype=torch.float32)
        return self.grad

    # ------------------------------------------------------------ transitions ([Note: shard phases])

    def _leaving(self, to: str, *allowed: ShardPhase) -> None:
        assert self.phase in allowed, (f"unit {self.name!r}: {to} from {self.phase.value} (only from "
                                       f"{' or '.join(a.value for a in allowed)})")

    def add(self, grad: torch.Tensor, scale: float, threads: int | None) -> None:
        """EMPTY/HOLDING -> HOLDING: ``scale`` x grad into the fp32 accumulator (the first gradient of a step
        overwrites it)."""
        self._leaving("add a gradient", ShardPhase.EMPTY, ShardPhase.HOLDING)
        add_into(self.accumulator(), grad, scale, overwrite=self.phase is ShardPhase.EMPTY, threads=threads)
        self.phase = ShardPhase.HOLDING

    def keep_landed(self, grad: torch.Tensor, scale: float, threads: int | None) -> None:
        """EMPTY/HOLDING -> HOLDING: a device-stepped unit's gradient kept as it landed, with its factor (see
        [Note: a device gradient kept as it landed] in offload/optim/sharded.py); a second one in the same step is
        added to the first in fp32 (a transient accumulator, dropped with the step), as an accumulator would have
        added them."""
        self._leaving("keep a gradient", ShardPhase.EMPTY, ShardPhase.HOLDING)
        if self.phase is ShardPhase.EMPTY:
            self.landed, self.landed_scale = grad, scale
        else:
            assert self.landed is not None, f"unit {self.name!r} holds a gradient that was not kept"
            # the first one widened and scaled as an accumulator takes it (the sum already, from a third on)
            self.landed, self.landed_scale = widened(self.landed, self.landed_scale, threads), 1.0
            add_into(self.landed, grad, scale, overwrite=False, threads=threads)
        self.phase = ShardPhase.HOLDING

    def read_in_place(self, grad: torch.Tensor, scale: float) -> None:
        """EMPTY/HOLDING -> HOLDING: the step's only gradient, read where it landed with its factor (see [Note:
        gradients read where they land] in offload/optim/landing.py); it replaces what a failed backward left."""
        self._leaving("read a gradient in place", ShardPhase.EMPTY, ShardPhase.HOLDING)
        self.landed, self.landed_scale, self.phase = grad, scale, ShardPhase.HOLDING

    def materialize(self, threads: int | None) -> None:
        """HOLDING -> HOLDING: a gradient left where it landed goes into the accumulator (another is coming);
        nothing to do for a shard that holds none there, or is not HOLDING (stepped already)."""
        if self.landed is None or self.phase is not ShardPhase.HOLDING:
            return
        landed, scale = self.landed, self.landed_scale
        self.landed, self.phase = None, ShardPhase.EMPTY
        self.add(landed, scale, threads)

    def took_norm(self, parts: list[native.SqNorm]) -> None:
        """HOLDING: the final gradient's norm per segment, taken as it landed."""
        self._leaving("take the norm", ShardPhase.HOLDING)
        self.norm = parts

    def speculated(self, guess: Guess) -> None:
        """HOLDING -> SPECULATED: Adam ran with ``guess`` into the other slot ([Note: speculative step])."""
        self._leaving("speculate", ShardPhase.HOLDING)
        self.phase, self.guessed = ShardPhase.SPECULATED, guess

    def settled(self) -> None:
        """SPECULATED: the step kept or recomputed the speculated slot; the shard is emptied with the step."""
        self._leaving("settle a speculation", ShardPhase.SPECULATED)
        self.guessed = None

    def stale(self) -> None:
        """SPECULATED -> HOLDING: the speculation no longer holds (another gradient, a failed or dropped one); the
        gradient stays and the step (or a new speculation) steps it."""
        self._leaving("drop a speculation", ShardPhase.SPECULATED)
        self.phase, self.guessed = ShardPhase.HOLDING, None

    def stepped(self) -> None:
        """HOLDING -> STEPPED: Adam ran on the shard inside backward (overlapped, exact)."""
        self._leaving("step in backward", ShardPhase.HOLDING)
        self.phase = ShardPhase.STEPPED

    def unstep(self) -> None:
        """STEPPED/SPECULATED -> HOLDING: the pass that stepped it did not complete; the next step steps it again
        (from the state on disk or its intact current slot). Other phases are left as they are."""
        if self.phase in (ShardPhase.STEPPED, ShardPhase.SPECULATED):
            self.phase, self.guessed = ShardPhase.HOLDING, None

    def empty(self) -> None:
        """-> EMPTY: the step is done with the shard's gradient (see [Note: shard phases])."""
        self.phase, self.norm, self.landed, self.guessed = ShardPhase.EMPTY, None, None, None

    def moved_to_device(self, grad: torch.Tensor | None) -> None:
        """EMPTY: the refit moved the unit's step to the compute device; ``grad`` is its accumulator there (None
        where the device keeps gradients as they land), and the host-side buffers are gone."""
        self._leaving("move to the device", ShardPhase.EMPTY)
        self.grad = grad
        self.landing, self.on_device, self.device_holds, self.route = None, None, False, None

    def routed(self, route: Route) -> None:
        """The landing chose how this shard's gradients come in (kept until the refit moves the shard)."""
        self.route = route

    # ------------------------------------------------------------ events ([Note: events re-recorded])

    def landing_busy_until(self, event: Event) -> None:
        """The landing buffer is read (or written) until ``event`` completes."""
        self.events.free = event

    def copied_by(self, event: Event) -> None:
        """The last gradient's copy into the landing buffer completes with ``event``."""
        self.events.copied = event

    def read_by_adam(self, event: Event) -> None:
        """The delayed update's Adam has read this shard's gradient once ``event`` completes."""
        self.events.adam_read = event

    def added_on_device(self, event: Event) -> None:
        """A gradient was added into the device accumulator (it holds this step's sum now) by ``event``."""
        self.device_holds = True
        self.events.added = event

    def new_device_sum(self) -> None:
        """The next gradient starts a new sum in the device accumulator (the step took the last one)."""
        self.device_holds = False


def by_group(segments: list[Segment]) -> dict[int, list[Segment]]:
    """A shard's segments by parameter group (one fused call each: a group has one set of hyperparameters)."""
    groups: dict[int, list[Segment]] = {}
    for seg in segments:
        groups.setdefault(seg.group, []).append(seg)
    return groups


def gaps(segments: list[Segment], n: int) -> list[tuple[int, int]]:
    gaps, at = [], 0
    for seg in segments:
        if seg.start > at:
            gaps.append((at, seg.start))
        at = seg.end
    if at < n:
        gaps.append((at, n))
    return gaps


def widened(grad: torch.Tensor, scale: float, threads: int | None = None) -> torch.Tensor:
    """``grad`` x ``scale`` in fp32, rounded as an accumulator holds it (``add_into`` overwriting); ``grad`` itself
    where it is that already (an accumulator's, factor 1)."""
    if grad.dtype == torch.float32 and scale == 1.0:
        return grad
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    add_into(out, grad, scale, overwrite=True, threads=threads)
    return out


def add_into(acc: torch.Tensor, grad: torch.Tensor, scale: float, *, overwrite: bool, threads: int | None) -> None:
    """acc = scale x grad (``overwrite``) or acc += scale x grad, rounded as the native kernel rounds (a product,
    then a fused multiply-add). Host buffers go through that kernel on offload's threads: a torch op on a host
    queue's thread would start an OpenMP team of its own whose threads spin after each op, beside backward's."""
    if acc.device.type == "cpu" and grad.device.type == "cpu" and grad.is_contiguous():
        native.accumulate_(acc, grad, scale, overwrite=overwrite, threads=threads)
    elif overwrite:
        acc.copy_(grad)
        if scale != 1.0:
            acc.mul_(scale)
    else:
        acc.add_(grad, alpha=scale)


def unstep(shards: dict[int, ShardState], groups: Iterable[Any]) -> None:
    """The sub-groups' shards stepped or speculated by a pass that did not complete are stepped again by the next
    step (``groups``: the store's ``SubGroup``s, from ``abort_pass`` or ``drop_read_ahead``)."""
    for g in groups:
        for m in g.members:
            shards[m.unit].unstep()
