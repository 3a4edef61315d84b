"""One unit's device state: its shard, its gathered flat buffer, and the transitions between them."""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import TYPE_CHECKING

import torch

from offload.machine.accelerator import CopyStream
from offload.store.param_store import ParamStore
from offload.store.tier import Tier
from offload.zero.collectives import Group, all_gather
from offload.zero.partition_view import PartitionView
from offload.zero.plan import UnitPlan, sharded_elsewhere

if TYPE_CHECKING:
    from torch.distributed import Work


@dataclasses.dataclass(frozen=True)
class PartitionNumel:
    """DeepSpeed's ``param.partition_numel()``: the elements of the parameter this rank's shard holds (its part of
    the unit's flat buffer), which Lightning's model summary of a sharded model counts."""

    held: int

    def __call__(self) -> int:
        return self.held


class UnitState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard (1/W of the flat params, in the parameter store) holds memory; ``full`` is empty."""
    GATHERING = "gathering"
    """``full`` has its memory and an all-gather into it is in flight (a prefetch); wait before reading it."""
    UNSHARDED = "unsharded"
    """``full`` holds every parameter's values and the module's parameters point into it."""


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's name for a ZeRO-3 parameter's state, kept on each parameter as ``ds_status`` (TRL reads it to
    decide whether to gather a head it calls directly): the unit's state, in DeepSpeed's words."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_DS_STATUS = {UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
              UnitState.UNSHARDED: ZeroParamStatus.AVAILABLE}


class Use(enum.Enum):
    """What claims a unit between forwards (the running forwards themselves are counted by ``Unit.holders``)."""

    IDLE = "idle"
    """No backward and no prefetch claims it: gathered or not, the runtime may release it when it needs room."""
    PREFETCHED = "prefetched"
    """Gathered (or gathering) ahead of its use by the prefetcher, and not used since."""
    BACKWARD = "backward"
    """Gathered for a backward that has not finished with it: not released to make room."""


class Kept(enum.Enum):
    """Where a unit's small parameters that stay whole between uses (``Unit.kept``) stand; see [Note: small
    parameters stay whole]."""
    UNARMED = "unarmed"
    """No step yet: released with the unit, as DeepSpeed's persistent parameters are until its first step."""
    STALE = "stale"
    """A step returned before Adam finished: released with the unit until its next use gathers the new values."""
    CURRENT = "current"
    """Whole outside uses: the values of the last step, load or gathered block."""


class Unit:
    """A unit's flat parameters on the compute device, sharded over the group.

    The flat buffer is padded to a multiple of W so every rank's shard has the same
    size; rank r owns elements [r*S, (r+1)*S). Each parameter's ``.data`` is a view
    into ``full`` for the whole life of the engine: releasing the unit shrinks the
    storage to nothing and gathering grows it back in place, so tensors that autograd
    saved during forward see the gathered values again in backward.
    """

    def __init__(self, plan: UnitPlan, group: Group, dtype: torch.dtype, device: torch.device, params: ParamStore,
                 resident: bool = False, in_place: bool = False) -> None:
        """Rebinds the parameters into the (empty) flat buffer: read their values first (``initial_values``).

        ``params`` holds this rank's shard (the unit hands it over in ``load_initial``). ``resident`` (ZeRO stages
        0-2): ``full`` keeps its memory for good and the shard is a view into it, so the unit is never released
        and the optimizer writes this rank's partition in place. ``in_place`` (W = 1, where compute can read the
        shard where it lives: ``ParamStore.compute_reads_home``): ``full`` is the shard's own memory, so there is
        nothing to gather or release and no memory beyond the shard's (see [Note: host memory is the device's] and
        [Note: reading the home])."""
        self.plan = plan
        self.index = plan.index
        self.name = plan.name
        self.slots = plan.slots
        self.numel = plan.numel
        self.padded = self.padded_numel(plan, group.world)
        self.shard_numel = self.padded // group.world
        self.shard_start = group.rank * self.shard_numel
        self.group = group
        self.dtype = dtype
        if in_place and group.world != 1:
            raise ValueError(f"unit {plan.name!r}: only a unit that needs no gather (W = 1) is read in place")
        self.resident = resident
        self.in_place = in_place
        self.params = params
        self.full = torch.empty(self.padded, dtype=dtype, device=device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.state = UnitState.UNSHARDED if self.keeps_full else UnitState.SHARDED
        self.holders = 0  # forwards currently running inside one of this unit's anchors
        self.persistent = False  # stays gathered between uses (set once by ``persist``)
        self.use = Use.IDLE
        self._work: Work | None = None  # the in-flight all-gather while GATHERING
        self._transient: torch.Tensor | None = None  # the device shard it reads, kept until the gather is done
        self.trainable = {id(s.param) for s in self.slots if s.param.requires_grad}
        self.has_frozen = len(self.trainable) < len(self.slots)
        self.grads_seen: set[int] = set()  # ids of the trainable parameters whose gradient this backward gave
        self._views = [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self._bound = False  # the parameters are views into ``full`` (else the empty tensor)
        self.unbinds = False  # in place, and released between uses all the same (``persist``)
        self.kept: list[int] = []  # slots whole between uses (the runtime's ``keep``)
        self._kept_copies: list[torch.Tensor] = []  # a gathered unit's own whole copies of them
        self.kept_state = Kept.UNARMED
        self._dropped: set[int] = set()  # kept slots a GatheredParameters block named: released until refreshed
        shard_end = self.shard_start + self.shard_numel
        for s in self.slots:  # the whole shape, and this rank's part of it, under DeepSpeed's names for them
            setattr(s.param, "ds_shape", torch.Size(s.shape))
            setattr(s.param, "ds_numel", s.numel)
            first = max(s.offset, self.shard_start)  # the parameter's first element on this rank, if any
            held = max(0, min(s.offset + s.numel, shard_end) - first)
            setattr(s.param, "partition_numel", PartitionNumel(held))
            start = first - self.shard_start if held else 0
            view = PartitionView(params, self.index, start, held, self._partition_device(device))
            setattr(s.param, "ds_tensor", view)
        self._bind()
        if not self.keeps_full:
            self._release_memory()

    def _partition_device(self, device: torch.device) -> torch.device:
        """Where this rank's shard lives: the compute device for a device home, else host memory (NVMe reads land
        there)."""
        return device if self.params.home(self.index) is Tier.DEVICE else torch.device("cpu")

    def _bind(self) -> None:
        """The parameters are views into ``full``: what forward and backward read while the unit is gathered."""
        for s, view in zip(self.slots, self._views, strict=True):
            s.param.data = view
        self._bound = True

    def persist(self, whole: bool, kept: list[int]) -> None:
        """Set once by the runtime: the unit stays gathered between uses (``whole``: small enough, or it keeps its
        buffer anyway), and ``kept`` slots stay whole when it is released (see ``keep``). It then starts released,
        as every gathered unit does until first used."""
        self.persistent = self.keeps_full or whole
        self.unbinds = self.in_place and not whole
        self.keep(kept)
        self.unbind()

    @property
    def state(self) -> UnitState:
        return self._state

    @state.setter
    def state(self, value: UnitState) -> None:
        self._state = value
        status = _DS_STATUS[value]
        for s in self.slots:
            setattr(s.param, "ds_status", status)

    # ----------------------------------------------------------------- uses

    @property
    def prefetched(self) -> bool:
        return self.use is Use.PREFETCHED

    @property
    def backward_active(self) -> bool:
        return self.use is Use.BACKWARD

    def hold(self) -> None:
        """A forward inside one of its anchors begins."""
        self.holders += 1

    def let_go(self) -> bool:
        """That forward ends; returns whether no forward holds the unit now."""
        self.holders -= 1
        return self.holders == 0

    def mark_prefetched(self) -> None:
        """IDLE -> PREFETCHED: its gather was issued ahead of use."""
        assert self.use is Use.IDLE, f"unit {self.name!r} is {self.use.value}, not idle"
        self.use = Use.PREFETCHED

    def used(self) -> None:
        """PREFETCHED -> IDLE: a use reached it (or it was released) since its prefetch; idempotent."""
        if self.use is Use.PREFETCHED:
            self.use = Use.IDLE

    def begin_backward(self) -> None:
        """-> BACKWARD: a gradient reached one of its modules; it stays gathered until backward is done with it."""
        self.use = Use.BACKWARD

    def end_backward(self) -> None:
        """BACKWARD -> IDLE: backward is done with it (all its gradients in, backward over, or failed);
        idempotent."""
        if self.use is Use.BACKWARD:
            self.use = Use.IDLE

    def grad_arrived(self, param: torch.Tensor) -> bool:
        """One of its parameters' gradient was accumulated; returns whether every trainable one's now has."""
        self.grads_seen.add(id(param))
        return len(self.grads_seen) == len(self.trainable)

    def grads_taken(self) -> None:
        """Its gradients were reduced, kept in ``.grad`` for a later micro-batch, or dropped: the next backward
        counts them afresh."""
        self.grads_seen.clear()

    def drop_grads(self) -> None:
        """Its parameters' ``.grad`` and the count of them are dropped (a failed backward, zero_grad between
        micro-batches)."""
        self.grads_seen.clear()
        for slot in self.slots:
            slot.param.grad = None

    def keep(self, slots: list[int]) -> None:
        """[Note: small parameters stay whole] DeepSpeed keeps each parameter at or below
        ``stage3_param_persistence_threshold`` whole from its first step on, though the rest of its module is
        released: a script may read a LayerNorm's weight between steps. A unit releases all its parameters at
        once, so the small ones of a unit above the threshold (``slots``) keep values apart from ``full``: an
        in-place unit's stay views of its shard (the step writes them in place), a gathered unit's get a whole
        copy each, refreshed by the runtime after each step, load or kept edit (``refreshed``). Until the first
        step (``Kept.UNARMED``) they are released with the unit; after a step that returned before Adam
        (``Kept.STALE``) too, until the next gather, whose values the release copies."""
        self.kept = list(slots)
        if not self.in_place:
            self._kept_copies = [torch.empty(self.slots[i].shape, dtype=self.dtype, device=self.full.device)
                                 for i in self.kept]

    def kept_sizes(self) -> list[int]:
        return [self.slots[i].numel for i in self.kept]

    def kept_in_shard(self) -> list[tuple[int, int, int]]:
        """Where this rank's shard holds kept elements, as (at, lo, n): elements [at, at + n) of the kept parameters
        (one after another, in ``kept`` order) are the shard's [lo, lo + n)."""
        start, end = self.shard_start, self.shard_start + self.shard_numel
        pieces, at = [], 0
        for i in self.kept:
            slot = self.slots[i]
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo < hi:
                pieces.append((at + lo - slot.offset, lo - start, hi - lo))
            at += slot.numel
        return pieces

    def refreshed(self, values: list[torch.Tensor] | None) -> None:
        """The kept parameters' new values (a gathered unit's, flat, in ``kept`` order; None for an in-place unit,
        whose views are the new values already) after a step or load: whole from now on."""
        if values is not None:
            torch._foreach_copy_(self._kept_copies,
                                 [v.view(c.shape) for v, c in zip(values, self._kept_copies, strict=True)])
        self.kept_state = Kept.CURRENT
        self._dropped.clear()
        if not self._bound:
            self._empty_params()

    def drop_kept(self, params: set[int]) -> None:
        """The kept parameters among ``params`` (by ``id``) are released until the next refresh, as DeepSpeed's
        GatheredParameters leaves the persistent parameters it names (partitioned, until its next step gathers
        them)."""
        self._dropped |= {i for i in self.kept if id(self.slots[i].param) in params}
        if not self._bound:
            self._empty_params()

    def kept_stale(self) -> None:
        """A step returned before its Adam finished (the first one too): the kept parameters are released until
        the next gather."""
        if self.kept:
            self.kept_state = Kept.STALE
            if not self._bound:
                self._empty_params()

    def _empty_params(self) -> None:
        """Every parameter the empty tensor, but the kept ones where they are current (see [Note: small
        parameters stay whole])."""
        for s in self.slots:
            s.param.data = self._empty
        if self.kept_state is Kept.CURRENT:
            whole = [self._views[i] for i in self.kept] if self.in_place else self._kept_copies
            for i, values in zip(self.kept, whole, strict=True):
                if i not in self._dropped:
                    self.slots[i].param.data = values
        self._bound = False

    def bind(self) -> None:
        """An in-place unit's parameters, views of its shard again for a use (see [Note: a released parameter])."""
        if self.in_place and not self._bound:
            self._bind()

    def unbind(self) -> None:
        """An in-place unit that ``unbinds``, after a use: its parameters become the empty tensor, as a gathered
        unit's are once released, though its memory (the shard's own) stays."""
        if self.in_place and self.unbinds and self._bound:
            self._empty_params()

    def _release_memory(self) -> None:
        """[Note: a released parameter] ``full``'s memory goes, and every parameter becomes an empty tensor, as
        DeepSpeed's released partitions are (``ds_shape`` keeps the whole shape). A parameter left a view of freed
        memory would read it: a segfault outside forward, at any world size where units are gathered. The views
        are kept apart and bound again by the next gather (``_bind``), before any forward or backward reads them;
        autograd's saved parameters are the parameters themselves, so a backward reads them bound again too. An
        in-place unit (W = 1: its shard is the whole) keeps its memory but is released the same way between uses
        (``unbind``), above the persistence threshold, so that a parameter reads as DeepSpeed's does at any world
        size. A gathered unit's stale kept parameters take their values from ``full`` first (see [Note: small
        parameters stay whole])."""
        if self.kept_state is Kept.STALE and self.state is UnitState.UNSHARDED:
            torch._foreach_copy_(self._kept_copies, [self._views[i] for i in self.kept])
            self.kept_state = Kept.CURRENT
        self.full.untyped_storage().resize_(0)
        self._empty_params()

    @property
    def keeps_full(self) -> bool:
        """``full`` holds memory for good (resident, or read in place): never gathered or released."""
        return self.resident or self.in_place

    @staticmethod
    def padded_numel(plan: UnitPlan, world: int) -> int:
        return -(-plan.numel // world) * world

    @staticmethod
    def initial_values(plan: UnitPlan, world: int) -> torch.Tensor:
        """The unit's parameters as one padded fp32 host buffer (the master weights' source)."""
        flat = torch.zeros(Unit.padded_numel(plan, world), dtype=torch.float32)
        for s in plan.slots:
            if s.param.is_meta:
                raise ValueError(f"parameter {s.name!r} is still on the meta device; materialize_unit gives it "
                                 "memory and initialises it first")
            if s.numel and s.param.untyped_storage().nbytes() < s.numel * s.param.element_size():
                raise sharded_elsewhere(s.name)
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        return flat

    def load_initial(self, values: torch.Tensor, host_copy: bool = False, start: int = 0) -> None:
        """Take the unit's starting values (the same on every rank), elements [start, start + len(values)) of the
        flat buffer: all of it when the unit keeps its buffer, at least this rank's shard otherwise. The whole
        buffer is kept where the unit keeps one; this rank's shard goes to the parameter store (``host_copy``: see
        ``ParamStore.add``)."""
        shard = self.shard_of(values, start)
        view = None
        if self.keeps_full:
            if start != 0 or values.numel() != self.padded:
                raise ValueError(f"unit {self.name!r} keeps its whole buffer: its starting values must cover all "
                                 f"{self.padded} elements, got [{start}, {start + values.numel()})")
            self.full.copy_(values)
            view = self.full[self.shard_start:self.shard_start + self.shard_numel]
        self.params.add(self.index, self.name, shard, device_view=view, host_copy=host_copy)

    def shard_of(self, values: torch.Tensor, start: int = 0) -> torch.Tensor:
        """This rank's shard out of ``values``, which hold flat elements [start, start + len(values))."""
        lo = self.shard_start - start
        if lo < 0 or lo + self.shard_numel > values.numel():
            raise ValueError(f"unit {self.name!r}: values for [{start}, {start + values.numel()}) do not hold this "
                             f"rank's shard [{self.shard_start}, {self.shard_start + self.shard_numel})")
        return values[lo:lo + self.shard_numel]

    def spread_partition(self) -> None:
        """Resident units, after the step wrote this rank's partition of ``full`` in place: all-gather every
        rank's partition (a collective: every rank calls it for the same units in the same order)."""
        assert self.resident, f"unit {self.name!r} is not resident"
        shard = self.params.to_device(self.index, None)  # waits for the copy of the new partition into ``full``
        if self.group.world > 1:
            all_gather(self.full, shard.clone(), self.group)  # an input apart from the output: gloo needs it

    # ----------------------------------------------------------------- transitions

    @property
    def off_device(self) -> bool:
        """The shard's home is host memory or NVMe: a gather first copies it to the device."""
        return self.params.home(self.index) is not Tier.DEVICE

    @property
    def on_nvme(self) -> bool:
        return self.params.home(self.index) is Tier.NVME

    def start_unshard(self, h2d: CopyStream | None = None) -> None:
        """SHARDED -> GATHERING: issue the all-gather without waiting for it.

        The parameter store brings the shard to the device first (from a host or NVMe home on ``h2d``, kept until
        the gather is done); a failed NVMe read raises before anything changes.
        """
        assert self.state is UnitState.SHARDED, f"unit {self.name!r} is {self.state.value}, not sharded"
        shard = self.params.to_device(self.index, h2d)
        self.full.untyped_storage().resize_(self._full_bytes)
        self._bind()
        self._transient = shard
        self._work = all_gather(self.full, shard, self.group, async_op=True)
        if self._work is not None:
            _IN_FLIGHT.add(self)
        self.state = UnitState.GATHERING

    def finish_unshard(self) -> None:
        """GATHERING -> UNSHARDED: wait for the all-gather."""
        assert self.state is UnitState.GATHERING, f"unit {self.name!r} is {self.state.value}, not gathering"
        work, self._work, self._transient = self._work, None, None
        _IN_FLIGHT.discard(self)
        if work is not None:
            work.wait()
        self.state = UnitState.UNSHARDED

    def unshard(self, h2d: CopyStream | None = None) -> bool:
        """-> UNSHARDED from any state; idempotent, returns whether it had to gather or wait."""
        self.bind()
        if self.state is UnitState.UNSHARDED:
            return False
        if self.state is UnitState.SHARDED:
            self.start_unshard(h2d)
        self.finish_unshard()
        return True

    def reshard(self) -> bool:
        """UNSHARDED (or GATHERING, after waiting) -> SHARDED (frees the gathered buffer); idempotent,
        returns whether it freed. A unit that keeps its buffer (resident, in place) is never released; an in-place
        one that ``unbinds`` has its parameters emptied."""
        self.unbind()
        if self.state is UnitState.SHARDED or self.keeps_full:
            return False
        if self.state is UnitState.GATHERING:
            self.finish_unshard()  # the collective must complete on every rank before its buffer goes
        self._release_memory()
        self.state = UnitState.SHARDED
        return True

    def device_memory(self) -> list[torch.Tensor]:
        """What the unit holds on the device between uses: its flat buffer (empty when released) and its kept
        slots' own copies, for lending the device back (offload/machine/parking.py)."""
        return [self.full, *self._kept_copies]

    def close(self) -> None:
        """The engine closes: the flat buffer's memory goes (an in-place unit's too, as a released unit's would,
        so the model cannot be handed to another engine by mistake); stages 0-2 keep their resident buffers."""
        if self.state is UnitState.GATHERING:
            self.finish_unshard()
        if not self.resident:
            self.kept_state = Kept.UNARMED
            self._release_memory()
            self.state = UnitState.SHARDED

    # ----------------------------------------------------------------- gradients

    def take_flat_grad(self) -> torch.Tensor:
        """The parameters' gradients as one padded flat buffer; the per-parameter ``.grad`` are dropped.

        The slots tile ``[0, numel)`` in order, so when every parameter has a gradient the buffer is one
        concatenation (a single op: this runs once per unit in every backward, on autograd's thread)."""
        grads = [s.param.grad for s in self.slots]
        for s in self.slots:
            s.param.grad = None
        if all(g is not None for g in grads):
            parts = [g.reshape(-1) for g in grads]  # type: ignore[union-attr]  # all(...) above: none is None
            if self.padded > self.numel:
                parts.append(torch.zeros(self.padded - self.numel, dtype=self.dtype, device=self.full.device))
            return torch.cat(parts)
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.full.device)
        for s, g in zip(self.slots, grads, strict=True):
            if g is not None:
                flat[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
        return flat

    def __repr__(self) -> str:
        return (f"Unit({self.index} {self.name!r}, {self.numel} elements in {len(self.slots)} params, "
                f"shard {self.shard_numel}, {self.state.value})")


_IN_FLIGHT: weakref.WeakSet[Unit] = weakref.WeakSet()  # units whose all-gather is issued and not yet waited for


def wait_in_flight() -> None:
    """Every all-gather still in flight (a prefetch nobody used) is waited for: at exit, so that no gloo worker
    finishes one, and frees its tensors, while Python finalizes (see [Note: the group at exit] in
    offload/engine/initialize.py)."""
    for unit in list(_IN_FLIGHT):
        work = unit._work
        if work is not None:
            work.wait()
