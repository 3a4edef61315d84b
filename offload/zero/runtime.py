"""The module hooks that gather units around their use and reduce their gradients as backward finishes them.

[Note: when a unit is gathered]
- forward: each anchor (and borrower) module's pre-forward hook acquires the unit
  (gathering it if it is sharded) and its post-forward hook releases it; a unit is
  resharded when no forward inside one of its anchors is running, unless persistent.
  A unit anchored at several modules (a run of small siblings: two transformer blocks,
  the two embeddings) stays gathered from its first anchor's forward to its last one's:
  released between them it would be gathered once per anchor, each time its whole size
  over PCIe or the network. If the last anchor never runs (a branch not taken), the unit
  is idle and gathered: the next gather that needs room, or the step, reshards it.
- backward: a hook on the module's outputs gathers the unit again when the first
  gradient reaches that module (its "pre-backward"). A unit is resharded once every
  trainable parameter in it has had its gradient accumulated: every autograd node
  that reads those weights feeds their AccumulateGrad, so none can still need them.
  A unit holding frozen parameters cannot know that, and is resharded at the end of
  backward, as are units some of whose parameters got no gradient at all.

[Note: stages] Under ZeRO stages 0-2 every unit is resident (gathered for good; see
offload/zero/stage.py): the hooks still run but never gather or release. Stages 0-1
leave gradients in ``.grad`` (autograd accumulates the micro-batches there) and reduce
them during the last micro-batch's backward only (``TrainingState.REDUCING``); stage 0 all-reduces
the whole flat gradient, the others reduce-scatter it.

[Note: gradient reduction order] Reduce-scatters are collectives: every rank must
issue them in the same order. They are issued when a unit's last gradient lands,
which is the same on every rank running the same graph, and the leftovers at the end
of backward go in unit order. Data-dependent control flow that uses a parameter on
one rank but not on another is therefore not supported (DeepSpeed and FSDP have the
same rule). What it would do is checked where it can be: each rank hashes the order
of its reductions since the last step (``ReductionOrder``), the step's norm all-reduce
carries the hashes, and ranks that differ raise before anything is applied (the
reductions paired one unit's gradients with another's; where their sizes agree,
nothing else would have said so). A rank that skips a whole unit issues fewer
reductions, and under ZeRO-3 fewer gathers, than the others: they wait in one until the
process group times out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from offload.machine.accelerator import Accelerator, Event, WorkEvent
from offload.observe.step_graph import COMPUTE, HOST
from offload.observe.telemetry import Telemetry
from offload.optim.landing import ReducedShard
from offload.store.param_store import ParamStore
from offload.zero.backward_state import BackwardState
from offload.zero.collectives import Group, ReductionOrder, all_reduce_sum, reduce_scatter
from offload.zero.compiled import CompileWatch, inside_compiled, say_compiled_whole
from offload.zero.plan import compiled
from offload.zero.prefetch import PrefetchTrace
from offload.zero.stage import Stage
from offload.zero.unit import Unit, UnitState

logger = logging.getLogger("offload.zero")

# set while offload itself reads a module's state_dict (its keys and live tensors), which is no user's call
_OWN_READ: ContextVar[bool] = ContextVar("offload_own_state_dict_read", default=False)


def live_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)``, the live tensors by key, read for offload's own use: without the
    note a user's own ``state_dict()`` of a ZeRO-3 model gets (see ``ZeroRuntime._partitioned_state_dict``)."""
    token = _OWN_READ.set(True)
    try:
        return module.state_dict(keep_vars=True)
    finally:
        _OWN_READ.reset(token)


class GradientSink(Protocol):
    """What takes the reduced gradient shards backward produces: the optimizer's landing (offload/optim/landing.py's
    ``GradientLanding``)."""

    def land(self, reduced: ReducedShard) -> None:
        """Take one unit's reduced shard; never blocks backward."""

    def gradients_sent(self) -> None:
        """Backward is over (or failed): what the sink holds back goes on now."""


class StaleRepair(Protocol):
    """What rewrites the NVMe parameter shards a failed write left stale, from their master weights (the optimizer,
    offload/optim/sharded.py): asked for by the gather that meets one, before the shard is read (see [Note: an early
    step's parameter writes] in offload/store/param_swap.py)."""

    def repair_stale(self) -> None: ...


class Downstream(NamedTuple):
    """The rooms below the hooks that take their work, each called down, never back: ``params``, the parameter store
    (the one door to a shard before its gather: ``ParamStore.prepare``, and reads ahead of use); ``sink``, where each
    reduced gradient shard goes (the optimizer's landing); ``repair``, the optimizer's rewrite of a stale shard."""

    params: ParamStore
    sink: GradientSink
    repair: StaleRepair


class LiveLimitError(RuntimeError):
    """Gathering a unit would exceed the limit on gathered elements."""


@dataclass(frozen=True)
class LiveLimit:
    """The most elements gathered at once, and which setting imposes it (for the error message)."""

    elements: int
    source: str = "zero_optimization.stage3_max_live_parameters"
    remedy: str = "Raise stage3_max_live_parameters or lower offload.unit_bytes"


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """What the config asks of the hooks (zero_optimization, resolved by offload/engine/build.py)."""

    limit: LiveLimit  # the most elements gathered at once
    # Units of at most this many elements stay gathered, and parameters of at most this many stay whole between
    # uses (see [Note: small parameters stay whole] in zero/unit.py), while their elements together stay within
    # ``persistence_cap`` (counted in unit order, as DeepSpeed counts).
    persistence_threshold: int
    persistence_cap: int = 2**63 - 1
    grad_predivide: float = 1.0  # gradients are divided by this before their reduction, by W / this after
    prefetch_elements: int = 0  # how far ahead gathers run
    stage: Stage = Stage(3)
    overlap_comm: bool = True  # false: each reduction completes before backward goes on (DeepSpeed's)


class ZeroRuntime:
    """Owns the units of one model, the hooks on it, and the count of gathered elements."""

    def __init__(self, model: nn.Module, units: list[Unit], group: Group, accel: Accelerator, below: Downstream,
                 settings: RuntimeSettings, telemetry: Telemetry) -> None:
        """``below``: the parameter store, the gradients' landing and the stale shards' repair."""
        persistence_threshold, persistence_cap = settings.persistence_threshold, settings.persistence_cap
        self.model = model
        self.compiles = CompileWatch(model)  # what dynamo made of the compiled units (see zero/compiled.py)
        self.stage = settings.stage
        self.overlap_comm = settings.overlap_comm
        self.units = units
        self.group = group
        self.accel = accel
        self.graph = accel.graph
        self.limit = settings.limit
        self.sink = below.sink
        self.repair = below.repair
        self.got_grad: set[int] = set()  # ids of the parameters whose gradient landed since the last step
        self.grad_predivide = settings.grad_predivide
        self.grad_factor = settings.grad_predivide / group.world  # the average over ranks, after the predivide
        self.telemetry = telemetry
        # Brings host- and NVMe-homed shards (offload_param: cpu, nvme) to the device before their gather; on a
        # GPU its own stream so the copies can be issued ahead of use.
        self.h2d = accel.copy_stream("param-h2d", urgent=True) if any(u.off_device for u in units) else None
        self.params = below.params  # every unit's shards (one store)
        self.prefetch = PrefetchTrace(settings.prefetch_elements)
        self.prefetched_gathers = 0  # gathers issued ahead of use
        self.live = sum(u.padded for u in units if u.resident)  # elements gathered now (or being gathered)
        self.peak_live = self.live
        self.backward = BackwardState()
        self.gathers = 0
        self._acquired: dict[int, list[list[Unit]]] = {}  # per module: the units each running forward holds
        self._handles: list[RemovableHandle] = []
        self._direct: dict[int, list[RemovableHandle]] = {}  # per module: its direct-call hooks (removable)
        self._left: set[int] = set()  # compiled anchors whose insides were cleared of direct-call hooks
        self._said_partitioned = False  # the warning of _partitioned_state_dict, once
        # Per module: the units for which its forward is not the last of their anchors' (see [Note: when a unit is
        # gathered]); their release after it keeps them gathered.
        self._keep_after: dict[int, frozenset[int]] = {}
        self._reduced: dict[int, Event] = {}  # per unit: its last reduction's event (re-recorded)
        # this rank's reductions since the last step (see [Note: gradient reduction order])
        self.order = ReductionOrder()
        persisted = 0  # elements kept whole between uses, against the cap
        for unit in units:
            small = (not unit.resident and unit.numel <= persistence_threshold
                     and persisted + unit.numel <= persistence_cap)
            persisted += unit.numel if small else 0
            # A small unit is whole between its uses; after a step it is released (its copy is stale), and its
            # parameters stay whole as kept ones, refreshed with the step's values as DeepSpeed's persistent ones
            # are (at W = 1 they are views of the shard the step writes).
            kept = [i for i, slot in enumerate(unit.slots) if slot.numel > 0] if small else []
            if not small and not unit.resident:
                for i, slot in enumerate(unit.slots):
                    if 0 < slot.numel <= persistence_threshold and persisted + slot.numel <= persistence_cap:
                        persisted += slot.numel
                        kept.append(i)
            unit.persist(small, kept)
        self._install(model)

    # ----------------------------------------------------------------- hooks

    def _install(self, model: nn.Module) -> None:
        by_name = dict(model.named_modules(remove_duplicate=False))
        inside = inside_compiled(model)
        users: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for unit in self.units:
            # a root-owned unit's owners inside a compiled block: the root's forward holds the unit around theirs
            owners = [n for n in _owners(unit) if n not in inside] if _root_owned(unit) else []
            for name in unit.plan.anchors + unit.plan.borrowers + owners:
                module = by_name[name]
                entry = users.setdefault(id(module), (module, []))
                if unit not in entry[1]:
                    entry[1].append(unit)
        for unit in self.units:
            for name in unit.plan.anchors[:-1]:
                key = id(by_name[name])
                self._keep_after[key] = self._keep_after.get(key, frozenset()) | {unit.index}
        for module, units in users.values():
            self._handles.append(module.register_forward_pre_hook(_eager(self._pre_forward_hook(units))))
            self._handles.append(module.register_forward_hook(_eager(self._post_forward_hook(units)),
                                                              always_call=True))
        direct: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for unit in (u for u in self.units if not _root_owned(u)):
            for name in _owners(unit):
                module = by_name[name]
                if id(module) not in users and name not in inside:
                    direct.setdefault(id(module), (module, []))[1].append(unit)
        for module, units in direct.values():
            self._direct[id(module)] = [
                module.register_forward_pre_hook(_untraced(self._direct_pre_hook(units))),
                module.register_forward_hook(_untraced(self._direct_post_hook(units)), always_call=True)]
        for unit in self.units:
            for slot in unit.slots:
                if slot.param.requires_grad:
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(self._grad_hook(unit)))
        say_compiled_whole(model, [a for u in self.units for a in u.plan.anchors])
        # a function of its own: torch marks the hook with an attribute, which a bound method cannot take
        self._handles.append(model.register_state_dict_post_hook(
            lambda module, state, prefix, metadata: self._partitioned_state_dict()))

    def _partitioned_state_dict(self) -> None:
        """``model.state_dict()`` outside forward holds the released parameters as empty tensors, as DeepSpeed's
        does (see [Note: a released parameter] in zero/unit.py): it saves and loads, but holds no weights. Said once,
        with what gives the weights."""
        if _OWN_READ.get():
            return
        released = [s.name for u in self.units for s in u.slots if s.numel and not s.param.numel()]
        if released and not self._said_partitioned:
            self._said_partitioned = True
            logger.warning("model.state_dict() holds %d ZeRO-3 partitioned parameters as empty tensors (%s%s), as "
                           "DeepSpeed's does; for the weights use engine.full_state_dict() or "
                           "engine.save_16bit_model(dir), or `offload export-weights` on a checkpoint",
                           len(released), ", ".join(released[:3]), " ..." if len(released) > 3 else "")

    def _pre_forward_hook(self, units: list[Unit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.graph.on:
                self.graph.work("hook_forward", lane=HOST)
            if self._direct and id(module) not in self._left and compiled(module):  # compiled since initialize
                self._left.add(id(module))
                _clear_inside(self._direct, module)
            acquired: list[Unit] = []
            # The post-hook runs even when this one raises (always_call): it releases exactly what was acquired.
            self._acquired.setdefault(id(module), []).append(acquired)
            for unit in units:
                self.acquire(unit)
                acquired.append(unit)
        return hook

    def _post_forward_hook(self, units: list[Unit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.graph.on:
                self.graph.work("hook_forward", lane=HOST)
            stack = self._acquired.get(id(module))
            keep = self._keep_after.get(id(module), frozenset())
            for unit in stack.pop() if stack else ():
                self.release(unit, keep=unit.index in keep)
            self._claim_in_backward(output, units)
        return hook

    def _claim_in_backward(self, output: Any, units: list[Unit]) -> None:
        """Backward through ``output`` gathers ``units`` again before their gradients come."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:  # the common case, without the multi-hook's per-graph-task bookkeeping
            tensors[0].register_hook(lambda _grad: self._pre_backward(units))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grad: self._pre_backward(units), mode="any")

    def _direct_pre_hook(self, units: list[Unit]) -> Callable[..., None]:
        """[Note: a submodule called directly] A module inside a unit's anchor, called while no forward of the
        anchor runs (a script's own method calling ``model.blocks[0].mlp(x)``, as DeepSpeed-Chat's critic calls its
        submodules): the units it reads are gathered for that call, as DeepSpeed's per-module gathering does. Inside
        the anchor's forward (every other call) the hook finds them held and does nothing more."""
        def hook(module: nn.Module, args: Any) -> None:
            idle = [unit for unit in units if unit.holders == 0]
            self._acquired.setdefault(id(module), []).append(idle)
            for unit in idle:
                self.acquire(unit)
        return hook

    def _direct_post_hook(self, units: list[Unit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._acquired.get(id(module))
            acquired = stack.pop() if stack else []
            for unit in acquired:
                self.release(unit)
            if acquired:
                self._claim_in_backward(output, acquired)
        return hook

    def _grad_hook(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self.got_grad.add(id(param))
            if unit.grad_arrived(param):
                if self.graph.on:
                    self.graph.work("hook_backward", unit.index, lane=HOST)
                self._reduce_or_keep(unit)
                if not unit.has_frozen:
                    unit.end_backward()
                    self._done_with(unit)
        return hook

    # ----------------------------------------------------------------- forward

    def acquire(self, unit: Unit) -> None:
        self._use(unit)
        unit.hold()

    def release(self, unit: Unit, keep: bool = False) -> None:
        """``keep``: a later anchor of the unit is about to run (see [Note: when a unit is gathered])."""
        if unit.let_go() and self.backward.idle and not keep:
            self._done_with(unit)

    # ----------------------------------------------------------------- backward

    def _pre_backward(self, units: list[Unit]) -> None:
        if self.graph.on:
            self.graph.work("hook_backward", lane=HOST)
        if self.backward.idle:
            self._begin_backward()
        for unit in units:
            unit.begin_backward()
            self._use(unit)

    def _begin_backward(self) -> None:
        """A backward begins; autograd calls ``_end_of_backward`` when it is done."""
        self.backward.begin(self.group.rank)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)


    def abort_backward(self) -> None:
        """Backward raised: autograd will not run the end-of-backward callback, so undo its state here.
        Gradients of the failed pass are dropped; units are released; the next backward starts clean."""
        self.backward.end()
        # the engine takes no more collective work after this at W > 1 (see [Note: one rank's failed pass] in
        # offload/engine/agreement.py)
        self.order.take()
        for unit in self.units:
            unit.end_backward()
            unit.drop_grads()
            if unit.holders == 0:
                self._done_with(unit)
        self.sink.gradients_sent()

    def _end_of_backward(self) -> None:
        for unit in self.units:
            # A unit that got no gradient now may hold some in .grad: an earlier micro-batch's (stages 0-1), or a
            # backward's this engine did not start (any stage).
            if unit.grads_seen or (self.backward.reduces() and any(s.param.grad is not None for s in unit.slots)):
                self._reduce_or_keep(unit)
        for unit in self.units:
            unit.end_backward()
            if unit.holders == 0:
                self._done_with(unit)
        self.backward.end()
        self.sink.gradients_sent()

    def _reduce_or_keep(self, unit: Unit) -> None:
        if self.backward.reduces():
            self._reduce(unit)
        else:  # stages 0-1 before the last micro-batch: the gradients stay in .grad, where autograd adds to them
            unit.grads_taken()

    def _reduce(self, unit: Unit) -> None:
        """Start the reduction of the unit's gradients into this rank's partition (reduce-scatter; stage 0:
        all-reduce of the whole) and hand it to the sink, which copies it to the host once the collective is done
        (backward goes on meanwhile)."""
        kind = "all_reduce" if self.stage.all_reduce else "reduce_scatter"
        self.order.add(unit.index)
        with self.telemetry.span(kind, unit.name):
            flat = unit.take_flat_grad()
            if self.grad_predivide != 1.0:
                flat.div_(self.grad_predivide)
            if self.stage.all_reduce:
                shard, work = flat, all_reduce_sum(flat, self.group, async_op=True)
            elif self.group.world == 1:  # one rank's shard is the whole flat gradient: no copy to make
                shard, work = flat, None
            else:
                shard = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
                work = reduce_scatter(shard, flat, self.group, async_op=True)
            if work is not None and not self.overlap_comm:
                work.wait()
                work = None
            if self.graph.on:  # the flat gradient's copy and the collective, on the compute stream
                self.graph.work("reduce", unit.index, nbytes=unit.padded * unit.dtype.itemsize, lane=COMPUTE)
        # A ring all-reduce moves twice what a reduce-scatter does.
        self.telemetry.add_bytes(kind, _wire_bytes(unit.padded * unit.dtype.itemsize, self.group.world)
                                 * (2 if self.stage.all_reduce else 1))
        unit.grads_taken()
        if work is not None:
            ready: Event = WorkEvent(work)
        else:  # the reduction ran on the compute stream: the unit's event, re-recorded each time
            ready = self._reduced[unit.index] = self.accel.compute_event(into=self._reduced.get(unit.index))
        self.sink.land(ReducedShard(unit.index, shard, ready, flat, self.grad_factor))

    # ----------------------------------------------------------------- accounting

    def begin_iteration(self) -> None:
        """A forward begins: the prefetcher follows (or records) a new iteration."""
        self.prefetch.begin_iteration()

    def _use(self, unit: Unit) -> None:
        """``unit`` gathered for use now, then the gathers the trace says come next started (FSDP2's pre-forward:
        unshard, wait for it, prefetch)."""
        upcoming = self._unshard(unit)
        self._wait_for_unshard(unit)
        if upcoming:
            self._prefetch(unit, upcoming)

    def _unshard(self, unit: Unit) -> list[int]:
        """Start gathering ``unit`` for use now (its shard readied through the one door, ``_ready``), with the
        NVMe reads of the units the trace says come next; returns those units."""
        if unit.in_place:  # compute reads the shard itself: an early step or its copy back may still be writing it
            self.params.await_home(unit.index)
            unit.bind()
        if unit.state is not UnitState.UNSHARDED or unit.prefetched:
            upcoming = self.prefetch.needed(unit.index)
        else:
            upcoming = []  # already gathered for an earlier use (a persistent unit, or still held)
        unit.used()
        # NVMe reads run further ahead than gathers: this unit's first, then the trace's next ones.
        if unit.state is UnitState.SHARDED:
            self._ready(unit)
        if upcoming:
            self.params.read_ahead(upcoming, skip={i for i in upcoming if self.units[i].state is not UnitState.SHARDED})
        if unit.state is UnitState.SHARDED:
            self._make_room(unit)
            with self.telemetry.span("gather", unit.name):
                unit.start_unshard(self.h2d)
            self._graph_gather(unit)
            self._count_gather(unit)
        return upcoming

    def _wait_for_unshard(self, unit: Unit) -> None:
        """GATHERING -> UNSHARDED: the unit's all-gather waited for (nothing to do for a gathered one)."""
        if unit.state is UnitState.GATHERING:
            with self.telemetry.span("gather_wait", unit.name):
                unit.finish_unshard()

    def _ready(self, unit: Unit) -> None:
        """The one door before a unit's shard is read for a gather (now or ahead of use): the store waits for an
        early step still writing it and starts an NVMe read; a shard a failed write left stale is rewritten from its
        master first, asked of the optimizer from here, above the store (see [Note: an early step's parameter
        writes] in offload/store/param_swap.py)."""
        if not self.params.prepare(unit.index):
            self.repair.repair_stale()
            ready = self.params.prepare(unit.index)
            assert ready, f"rank {self.group.rank}: unit {unit.name!r} is still stale after its repair"

    def _prefetch(self, current: Unit, upcoming: list[int]) -> None:
        ahead = 0
        # A gather of an NVMe-homed unit waits for its read: gathers stay within half the read buffers ahead,
        # so the reads run further ahead than they do. The same count on every rank keeps the collectives in step.
        from_nvme, nvme_limit = 0, self.params.gather_ahead
        for index in upcoming:
            unit = self.units[index]
            if unit is current:
                continue
            if unit.state is not UnitState.SHARDED:
                ahead += unit.padded if unit.prefetched else 0
                from_nvme += unit.prefetched and unit.on_nvme
                continue
            if ahead + unit.padded > self.prefetch.lookahead or self.live + unit.padded > self.limit.elements:
                break
            if unit.on_nvme:
                if from_nvme >= nvme_limit:
                    break
                from_nvme += 1
            self._ready(unit)
            with self.telemetry.span("prefetch", unit.name):
                unit.start_unshard(self.h2d)
            self._graph_gather(unit)
            unit.mark_prefetched()
            ahead += unit.padded
            self.prefetched_gathers += 1
            self._count_gather(unit)

    def _graph_gather(self, unit: Unit) -> None:
        """A recorded step graph's gather: on the compute stream, after its input's copy (see [Note: recorded
        step graph]); a unit whose compute reads its shard in place gathers nothing."""
        if self.graph.on and not unit.in_place:
            self.graph.work("gather", unit.index, nbytes=unit.padded * unit.dtype.itemsize, lane=COMPUTE)

    def read_ahead_first(self) -> None:
        """After a step: start reading the units the next iteration needs first (rank-local, no collective)."""
        order = self.prefetch.recording or self.prefetch.trace  # the iteration that just ended comes again
        if order:
            self.params.read_ahead(list(dict.fromkeys(order)))

    def _count_gather(self, unit: Unit) -> None:
        """The gather's bytes (its shard's copy up is the parameter store's to count: it knows whether one ran)."""
        self.telemetry.add_bytes("all_gather", _wire_bytes(unit.padded * unit.dtype.itemsize, self.group.world))
        self.gathers += 1
        self.live += unit.padded
        self.peak_live = max(self.peak_live, self.live)

    def _make_room(self, unit: Unit) -> None:
        limit = self.limit.elements
        if self.live + unit.padded > limit:
            # Idle units (persistent or prefetched ones, or ones whose backward has not begun) are gathered again
            # when next needed: a forward's pre-hook or a backward's pre-backward hook always runs before their use.
            for other in self.units:
                if self.live + unit.padded <= limit:
                    break
                if other.state is not UnitState.SHARDED and other.holders == 0 and not other.backward_active:
                    self._reshard(other)
        if self.live + unit.padded > limit:
            gathered = ", ".join(f"{u.name} ({u.padded})" for u in self.units if u.state is not UnitState.SHARDED)
            raise LiveLimitError(
                f"rank {self.group.rank}: gathering unit {unit.name!r} ({unit.padded} elements) would hold "
                f"{self.live + unit.padded} gathered elements, over {self.limit.source}={limit}; gathered now: "
                f"{gathered or 'nothing'}. {self.limit.remedy}")

    def _done_with(self, unit: Unit) -> None:
        """No use holds the unit now: released, unless persistent; an in-place one's parameters emptied all the
        same where it ``unbinds`` (see [Note: a released parameter])."""
        if not unit.persistent:
            self._reshard(unit)
        else:
            unit.unbind()

    def _reshard(self, unit: Unit) -> None:
        unit.used()
        if unit.reshard():
            self.live -= unit.padded

    def spread_partitions(self) -> None:
        """Stages 0-2, after a step: every resident unit's new partitions all-gathered, in unit order."""
        for unit in self.units:
            if unit.resident:
                with self.telemetry.span("all_gather", unit.name):
                    unit.spread_partition()
                self.telemetry.add_bytes("all_gather", _wire_bytes(unit.padded * unit.dtype.itemsize,
                                                                   unit.group.world))

    def take_order(self) -> list[float]:
        """This rank's reductions since the last step, for the ranks to compare (see [Note: gradient reduction
        order]); the next step's start afresh."""
        return self.order.take()

    def without_grad(self, names: dict[int, str]) -> list[str]:
        """The names, of ``names`` (by ``id`` of their parameter), of the parameters no gradient reached since the
        last step."""
        return [name for key, name in names.items() if key not in self.got_grad]

    def step_taken(self) -> None:
        """The step took (or skipped) the gradients: the next ones are counted anew."""
        self.got_grad.clear()
        self.compiles.stepped()

    def clear_held_grads(self) -> None:
        """Stages 0-1 between micro-batches: the ``.grad`` kept so far is cleared (DeepSpeed's zero_grad); which
        parameters got a gradient since the step is still known."""
        for unit in self.units:
            unit.drop_grads()

    def drop_grads(self) -> None:
        """The gradients since the last step are dropped (``discard_gradients``): those kept in ``.grad`` (stages
        0-1), the record of which parameters got one, and the reductions' order."""
        self.clear_held_grads()
        self.got_grad.clear()
        self.order.take()

    def refresh_kept(self) -> None:
        """After a step whose Adam has finished, or a load: every unit's kept parameters take the new values (a
        collective where units are gathered: each rank contributes the elements its shards hold). See [Note: small
        parameters stay whole] in zero/unit.py."""
        gathered = [u for u in self.units if u.kept and not u.in_place]
        params = self.params
        for unit in self.units:
            if unit.kept and unit.in_place:
                params.wait_step(unit.index)
                unit.refreshed(None)
        if not gathered:
            return
        parts = []
        for unit in gathered:
            pieces = unit.kept_in_shard()
            source = params.kept_values(unit.index, [(lo, lo + n) for _, lo, n in pieces])
            part = torch.zeros(sum(unit.kept_sizes()), dtype=unit.dtype, device=source.device)
            taken = 0
            for at, _, n in pieces:
                part[at:at + n].copy_(source[taken:taken + n])
                taken += n
            parts.append(part.to(self.accel.device))  # one copy a unit where the shards are off the device
        flat = torch.cat(parts)
        all_reduce_sum(flat, self.group)  # each element is nonzero on one rank at most: the sum is exact
        at = 0
        for unit, part in zip(gathered, parts, strict=True):
            unit.refreshed(list(flat[at:at + part.numel()].split(unit.kept_sizes())))
            at += part.numel()

    def kept_stale(self) -> None:
        """A step returned before its Adam finished: kept parameters are released until their unit's next use."""
        for unit in self.units:
            unit.kept_stale()

    def reshard_all(self) -> None:
        """Drop every gathered copy (after a step, persistent units hold stale values)."""
        for unit in self.units:
            if unit.holders:
                raise RuntimeError(f"rank {self.group.rank}: unit {unit.name!r} is in use by a running forward")
            self._reshard(unit)

    def close(self) -> None:
        for handle in self._handles + [h for hs in self._direct.values() for h in hs]:
            handle.remove()
        self._handles.clear()
        self._direct.clear()


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """[Note: hooks outside compiled code] A module compiled by the user (``block.compile()``, ``torch.compile``)
    runs its hooks inside the compiled call: traced, the gathers and the backward claims would break its graph or be
    baked into it. Kept out of tracing, as FSDP2 keeps its own, they run eagerly around the compiled forward, which
    sees the gathered parameters as its inputs. A compiled module below the root is atomic (zero/plan.py), so no
    unit's hooks sit inside one, and the direct-call hooks inside it are removed (``_clear_inside``)."""
    return torch._dynamo.disable(hook, recursive=True, reason="offload's gather and release run outside the graph")


def _clear_inside(direct: dict[int, list[RemovableHandle]], module: nn.Module) -> None:
    """The direct-call hooks inside a compiled module go (once per module: the runtime remembers it): each is a
    guard of its graph, and their ids differ from block to block, so every block would compile again."""
    for inner in list(module.modules())[1:]:  # the module itself comes first
        for handle in direct.pop(id(inner), []):
            handle.remove()


def _untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A direct-call hook (see [Note: a submodule called directly]) on a module inside a compiled block: traced,
    it is the anchor's forward calling its part, where the anchor's hooks hold the unit already, so it is left out of
    the graph entirely (a call to an eager function there would break the block's graph in two)."""
    eager = _eager(hook)

    def gate(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return eager(*args)
    return gate


def _owners(unit: Unit) -> list[str]:
    """The modules that hold a unit's parameters, but for its anchors and borrowers (which gather it already).

    [Note: a method other than forward] A unit anchored at the model's root (a small model whole, or what no
    block took: embeddings, a head) is gathered by the root's forward, which a script may go around: DeepSpeed-Chat's
    critic calls ``model.forward_value``, which calls the submodules itself. DeepSpeed gathers each submodule's own
    parameters, so that works there; here the modules that hold such a unit's parameters gather it too, with the
    full hooks (``_root_owned``). Inside the root's forward they find it held already and only count their use; the
    root's unit is a handful of modules, so the step keeps its hooks. A unit anchored below the root gets the light
    hooks of [Note: a submodule called directly] on the same modules instead."""
    owners = {slot.name.rpartition(".")[0] for slot in unit.slots}
    return sorted(name for name in owners if name and name not in unit.plan.anchors + unit.plan.borrowers)


def _root_owned(unit: Unit) -> bool:
    return "" in unit.plan.anchors


def _wire_bytes(nbytes: int, world: int) -> int:
    """Bytes a rank receives in a ring all-gather / reduce-scatter of ``nbytes``: (W-1)/W of them."""
    return nbytes * (world - 1) // world
