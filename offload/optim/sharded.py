"""The optimizer over this rank's shards: fp32 master, Adam moments and gradient accumulator per unit.

With ``offload_optimizer.device: cpu`` all of it lives in host memory and the step
is the native CPU Adam; otherwise it lives on the compute device (and on a CPU
device it is still the native kernel).

How gradients reach the shards (the D2H stream, the landing worker, landing buffers, device
accumulators, norms taken as they land) is offload/optim/landing.py's, with its notes: [Note:
gradients land], [Note: landings handed over in batches], [Note: gradients read where they land],
[Note: gradients accumulated on the device].

The speculative step is offload/optim/speculation.py's ([Note: speculative step]); the early step
and the delayed update, offload/optim/early_step.py's ([Note: early step], [Note: the early step on
NVMe], [Note: delayed update]); one shard's Adam, offload/optim/update.py's.

[Note: overlapped step] When nothing global gates the update (no clipping, no fp16
overflow check) the last micro-batch's backward runs each host-resident shard's Adam on
the landing worker right after its gradient lands, while backward goes on with earlier
units; its new shard is copied back at once (the parameter store keeps the copy's event,
which the unit's next gather waits for). An NVMe sub-group steps there too, once all of
its units' gradients are in (see the store's [Note: NVMe sub-groups stepped during
backward]); engine.step() then only steps what is left (units without a gradient) and
makes the new NVMe slots current. The arithmetic is the same kernel on the
same values, so the result is bitwise the same as stepping after backward.

[Note: a partial offload] With offload_optimizer.ratio below 1 (or auto), the first
units' sub-groups stay on the compute device (offload/store/placement.py chooses them:
the ones the next forward needs first). Those units are treated as without an offload:
their gradients add up in an fp32 accumulator on the device, their norm is taken there,
and Adam steps them there (torch's fused kernel on a GPU, the native kernel on a CPU device:
see [Note: Adam on a discrete device] in offload/optim/adam.py),
writing the new shard straight into the device home; the rest take the offloaded paths
above. With the early step the device units step on the training thread before it
returns (in stream order, so the next forward needs no wait for them). Beside offloaded
parameters those units' shards are homed on the device too (offload/store/placement.py:
[Note: a split beside offloaded parameters]).

[Note: a device gradient kept as it landed] With one micro-batch a step in a 16-bit dtype, a unit stepped on the
device needs no fp32 accumulator: its one gradient is kept as the reduction left it (2 bytes an element, as plain
PyTorch keeps ``.grad``, instead of 4), with its factor, until the step. The norm and the device Adam read it
widened to fp32 and scaled one unit at a time, the values an accumulator would have held (so bitwise the same
step), and it is dropped when the step is done. A unit whose gradient is reduced twice in one backward has the two
added up in fp32 then, as an accumulator would. The placement counts these gradients where it counted the
accumulators (offload/store/placement.py: ``device_grads``).

[Note: parameter return] The step writes each new compute-dtype shard where the
parameter store says (offload/store/param_store.py: [Note: the step's target]); a shard
homed on the device is then copied back by the store, whose event the next gather of
that unit waits for. The optimizer knows shards by unit index only, never the units.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from offload.aio.base import IOEngine
from offload.machine import native
from offload.machine.accelerator import Accelerator
from offload.observe.telemetry import Telemetry
from offload.optim.adam import AdamHyper
from offload.optim.early_step import EarlyLanes, EarlyStep, EarlyStepLost
from offload.optim.generic import GenericStep
from offload.optim.hyper import Hyper
from offload.optim.landing import GradientLanding, LandingPolicy, OnLanding
from offload.optim.loss_scale import LossScaler
from offload.optim.muon import MuonHyper
from offload.optim.muon_pass import MuonPass
from offload.optim.overlapped_step import OverlappedStep
from offload.optim.shard_state import Overlap, Segment, ShardPhase, ShardState, StateSplit, gaps, unstep, widened
from offload.optim.speculation import Speculation
from offload.optim.speculation_lane import SpeculationLane
from offload.optim.streamed_step import StreamedStep
from offload.optim.update import ShardUpdate, UpdateMeans
from offload.store.budget import TierBudget
from offload.store.optimizer_state import OptimizerStateStore
from offload.store.param_store import ParamStore
from offload.store.placement import device_grads
from offload.store.state_format import StateFormat
from offload.store.sub_groups import STREAMED_HANDED, STREAMED_SLOTS, SubGroup
from offload.store.swapdir import SwapDir, TierRoom
from offload.store.tier import Tier

logger = logging.getLogger("offload.optim")

@dataclass(kw_only=True)
class StatePlan:
    """Where the optimizer state goes: ``device`` is offload_optimizer.device ("none", "cpu" or "nvme");
    ``groups`` the sub-groups with their tiers and ``step_buffers`` the host bytes of accumulators, parameter
    copies and gradient landing buffers, by part (both from offload/store/placement.py)."""

    device: str
    groups: list[SubGroup]
    step_buffers: dict[str, int] = field(default_factory=dict)
    buffer_count: int = 4
    host: TierBudget = field(default_factory=lambda: TierBudget(Tier.HOST, None))
    nvme: TierBudget = field(default_factory=lambda: TierBudget(Tier.NVME, None))
    swap: tuple[SwapDir, IOEngine] | None = None
    rank: int = 0
    landing: LandingPolicy = field(default_factory=LandingPolicy)  # how gradients land (the placement's)
    second_slots: bool = False  # host sub-groups have a second slot, to speculate into (speculation.py)
    delayed: bool = False  # the delayed update runs (see [Note: delayed update] in early_step.py)
    staged: frozenset[int] = frozenset()  # ... and these units' new shards wait in staging buffers (the placement's)
    stochastic: int | None = None  # this rank's stream, where a bf16 master rounds stochastically (state_format.py)
    muon: MuonPass | None = None  # the Muon matrices' first pass, where the optimizer is Muon (muon_pass.py)
    generic: GenericStep | None = None  # a torch optimizer's own step, where the script passed one (generic.py)


@dataclass(frozen=True)
class AdamRule:
    """Which Adam the script asked for, and the host threads its kernel runs on."""

    adamw_mode: bool  # decoupled weight decay (AdamW), else L2 (Adam)
    bias_correction: bool
    threads: int | None = None  # offload.cpu_threads (None: the physical cores this process may use)
    update: str = "adam"  # or lion, adagrad (AdamHyper.rule), muon (a Muon group's MuonHyper; its others Adam's)


@dataclass(frozen=True, kw_only=True)
class LastBackward:
    """What the step's schedule chose for the backward that completes the accumulation (offload/engine/
    step_schedule.py), handed to the optimizer whole."""

    # The step's only micro-batch: where the state is all on the host its gradients are read where they land (see
    # [Note: gradients read where they land] in landing.py).
    only: bool
    steps: bool  # each shard's Adam runs as its gradient lands (see [Note: overlapped step])
    guess: float | None = None  # with ``steps``: speculate that the factor is this (see [Note: speculative step])
    # The step will return early: the NVMe reads go in the forward's order (see [Note: the early step on NVMe]).
    forward_order: bool = False


class StepVote(Protocol):
    """Every rank's agreement at the step's commit point (offload/zero/collectives.py's ``Vote``)."""

    def commit(self) -> None: ...

    def fail(self) -> None: ...


class OptimizerFace(torch.optim.Optimizer):
    """What LR schedulers and Trainers need of an optimizer: its ``param_groups``, whose hyperparameters each step
    reads. The step is ``engine.step()`` and the state lives in the shards, per rank, so the rest refuses."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        # An engine without an optimizer (forward only) still has the face, with one empty group: torch's refuses none.
        super().__init__(param_groups or [{"params": []}],
                         {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
        # DeepSpeed's: the last step was skipped for an fp16 overflow (accelerate's scheduler then does not step)
        self.overflow = False
        self.parameter_offload: Any = None  # ZeRO-3: what TRL reaches into around generate (zero/parameter_offload.py)

    # torch's own, without the dynamo guard torch wraps them in: the guard imports torch._dynamo on first use (800
    # modules, sympy among them: over a second of every run's start-up), and nothing compiles the face.
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _unguarded(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _unguarded(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def stepped(self) -> None:
        """engine.step() ran: a torch LR scheduler built on this optimizer checks that it stepped before the
        scheduler's own first step (else it warns that the order is wrong)."""
        self._opt_called = True

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the sharded optimizer steps through engine.step(), which also reduces, clips and "
                           "writes the new parameters back; call engine.step()")

    def state_dict(self) -> dict[str, Any]:
        """torch's would be empty: the state lives in the shards and their stores, per rank."""
        raise RuntimeError("the sharded optimizer's state is in this rank's shards (host memory, NVMe), not in a "
                           "state_dict; save and load it with engine.save_checkpoint / engine.load_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("the sharded optimizer's state is loaded by engine.load_checkpoint (a checkpoint "
                           "engine.save_checkpoint wrote), not from a state_dict")


def _unguarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without torch's dynamo guard (``torch._disable_dynamo`` keeps it as ``__wrapped__``), or as it
    is where a torch release wraps it otherwise."""
    return getattr(method, "__wrapped__", method)


class ShardedAdam(OptimizerFace):
    """Adam/AdamW over the shards of a ZeRO-3 model. Hyperparameters live in ``param_groups``; the step is
    ``engine.step()``. It is a torch optimizer by its face, so a torch LR scheduler a script builds on the
    optimizer initialize returned (``LambdaLR(optimizer, fn)``) drives the rate each step reads."""

    def __init__(self, param_groups: list[dict[str, Any]], accel: Accelerator, sizes: list[tuple[int, int]], *,
                 plan: StatePlan, params: ParamStore, rule: AdamRule, telemetry: Telemetry | None = None) -> None:
        """``sizes``: (unit index, shard elements) of every unit with trained parameters, in unit order;
        ``params`` holds their compute-dtype shards, which the step writes."""
        super().__init__(param_groups)
        self.accel = accel
        self.offload = plan.device != "none"
        self.device_grads_kept = plan.landing.keeps_device_grads
        self.compute_dtype = params.dtype  # the shards' (the step writes them in it)
        self.adamw_mode, self.bias_correction, self.update_rule = rule.adamw_mode, rule.bias_correction, rule.update
        self.threads = threads = rule.threads
        self.telemetry = telemetry or Telemetry()
        self.host = plan.host
        self.params = params
        # A partial offload's units stepped on the device (see [Note: a partial offload]).
        self.split = StateSplit.planned(self.offload, plan.groups)
        self.adam_steps = 0
        self.shards: dict[int, ShardState] = {}
        self.loss_scaler: LossScaler | None = None  # the engine's, for cur_scale
        # The delayed update's Adam runs on a thread of its own, so the next backward's gradients land beside it
        # (see [Note: delayed update] in offload/optim/early_step.py).
        adam = accel.host_queue("delayed-adam") if self.offload and plan.delayed else None
        # The speculative Adam of host shards runs on a thread of its own, so the landings (and the step's factor)
        # never wait for it (see [Note: speculation on a lane of its own] in offload/optim/speculation_lane.py).
        lane = SpeculationLane(accel) if self.offload and plan.second_slots else None
        nvme_units = frozenset(i for i, _ in sizes if params.home(i) is Tier.NVME)
        self.update = ShardUpdate(accel, self.shards, params, self.split, nvme_units,
                                  UpdateMeans(threads, plan.stochastic, plan.muon, plan.generic))
        if self.offload and sizes:
            self._reserve_host(plan.step_buffers)
        self._host_accumulators = "gradient accumulators" in plan.step_buffers  # the plan counted them
        self.store = OptimizerStateStore(plan.groups, TierRoom(plan.host, plan.nvme, plan.swap, plan.rank,
                                                               plan.buffer_count),
                                         accel=accel, telemetry=self.telemetry, spare=plan.second_slots)
        streamed = [g for g in plan.groups if g.streamed]
        self.streamed = (StreamedStep(accel, self.update, params, self.shards, streamed, self.telemetry)
                         if streamed else None)  # the third lane (see [Note: the streamed lane] in streamed_step.py)
        self.speculation = Speculation(self.shards, self.store, self.update, self.telemetry, lane)
        self.overlapped = OverlappedStep(self.shards, self.store, self.update, params, self.speculation,
                                         self.telemetry)
        self.landing = GradientLanding(accel, self.shards, self.split,
                                       OnLanding(self.speculation, self.overlapped, self.streamed), plan.landing,
                                       threads=threads, telemetry=self.telemetry)
        self.early = EarlyStep(self.update, self.store, self.speculation, self.telemetry,
                               EarlyLanes(self.landing.worker, adam, self.streamed), plan.staged)

    def _reserve_host(self, parts: dict[str, int]) -> None:
        """Account the host bytes of accumulators, copies and landing buffers (the plan sized them and checked
        they fit)."""
        for what, nbytes in parts.items():
            self.host.take(nbytes, what)

    @property
    def cur_scale(self) -> float:
        """The loss scale now, under the name DeepSpeed's fp16 optimizers give it (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    loss_scale = cur_scale

    @property
    def partial(self) -> bool:
        """Part of the optimizer state stays on the device (see [Note: a partial offload])."""
        return self.split.partial

    def steps_on_host(self, index: int) -> bool:
        """Whether unit ``index``'s optimizer state is offloaded (its step writes a host copy of the shard)."""
        return self.split.steps_on_host(index)

    def device_gradients(self) -> list[torch.Tensor]:
        """The gradient buffers on the device (a device-stepped unit's accumulator and kept gradient, a
        device-accumulated sum), for lending the device back (offload/engine/lending.py)."""
        out = []
        for index, shard in self.shards.items():
            on_device = not self.steps_on_host(index)  # else its accumulator and landing are host memory
            out += [t for t in (shard.grad if on_device else None, shard.on_device, shard.landed if on_device else None)
                    if t is not None]
        return out

    # ----------------------------------------------------------------- state

    def add_shard(self, index: int, name: str, master: torch.Tensor, segments: list[Segment]) -> None:
        """Own unit ``index``'s optimizer state; ``master`` is its fp32 shard (host). Units arrive in order."""
        n = master.numel()
        landing, grad = None, None  # an offloaded shard's accumulator: made on first use
        on_device = None
        if self.steps_on_host(index):
            if index in self.landing.device_accumulated:  # the sum comes down once, in fp32
                landing = self.accel.host_buffer(n, torch.float32)[0]
                on_device = torch.empty(n, dtype=torch.float32, device=self.accel.device)
            elif self.landing.d2h is not None:
                landing = self.accel.host_buffer(n, self.compute_dtype)[0]
        elif not self.device_grads_kept:
            grad = torch.zeros(n, dtype=torch.float32, device=self.accel.device)
        self.early.add_staging(index, n, self.compute_dtype)
        self.shards[index] = ShardState(index, name, grad, segments, gaps(segments, n), numel=n, landing=landing,
                                        on_device=on_device)
        if self.store.keeps_high_elsewhere(index):
            self.store.lend_high(index, self.params.step_target(index))
        self.store.init_member(index, master)

    def move_to_device(self, choice: list[tuple[SubGroup, int]]) -> int:
        """The first units of host sub-groups (each with how many: all of a sub-group, or the first ones split
        off it) become stepped on the compute device from the next step on, their shards homed there (moved from
        the host where they were homed there: see [Note: the split refitted] in offload/engine/refit.py); called
        between steps, drained. Each part moves whole or not at all: its device memory is taken before anything
        changes, so the device running out of it leaves the part on the host. Returns the host bytes given back."""
        self.params.wait_copies_back()
        before = self.host.used
        for whole, count in choice:
            members, streamed = whole.members[:count], whole.streamed  # streamed: its gradients are there already
            states = [self.shards[m.unit] for m in members]
            for state in states:
                assert self.params.can_home_on_device(state.index), f"unit {state.name!r} cannot move its shard"
                assert state.phase is ShardPhase.EMPTY, f"unit {state.name!r} holds a gradient"
            device = self.accel.device
            numel = sum(m.numel for m in members)
            # the state's memory in its format, every part its own (a lent high half taken back), taken here with
            # the rest (all of it, or none)
            fmt = whole.fmt.high_in_state()
            taken = fmt.slot(torch.empty(fmt.slot_bytes(numel), dtype=torch.uint8, device=device), numel)
            grads = [state.grad if streamed else state.on_device if state.on_device is not None
                     else None if self.device_grads_kept
                     else torch.empty(state.numel, dtype=torch.float32, device=device) for state in states]
            shards = [torch.empty(state.numel, dtype=self.compute_dtype, device=device)
                      if self.params.home(state.index) is Tier.HOST else None for state in states]
            # Nothing has changed above; nothing below allocates device memory.
            g = whole if count == len(whole.members) else self.store.split(whole, count)
            self.store.move_to_device(g, taken)
            if streamed:
                assert self.streamed is not None
                self.streamed.drop(g)
            for state, grad, shard in zip(states, grads, shards, strict=True):
                if state.landing is not None:
                    self.host.give(state.landing.numel() * state.landing.element_size(), "gradient landing")
                    self.accel.forget_host_buffer(state.landing)
                if self._host_accumulators and state.on_device is None and not streamed:
                    self.host.give(4 * state.numel, "gradient accumulators")
                if shard is not None:  # its shard is what the host step wrote
                    self.host.give(self.params.home_on_device(state.index, shard), "parameter copies")
                else:
                    self.host.give(self.params.drop_host_copy(state.index), "parameter copies")
                state.moved_to_device(grad.zero_() if grad is not None else None)
            moved = frozenset(m.unit for m in g.members)
            self.split.move_to_device(moved)
            self.landing.moved_to_device(moved)
        return before - self.host.used

    def device_bytes(self) -> dict[str, int]:
        """Bytes this optimizer keeps on the compute device, by part: its state (all of it, or a partial offload's
        share); fp32 gradient accumulators (of the units stepped there, and an offloaded optimizer's kept there);
        or, where the units stepped there keep their 16-bit gradients (see [Note: a device gradient kept as it
        landed]), what those take from backward to the step."""
        parts = {"optimizer state": sum(g.nbytes for g in self.store.groups if g.tier is Tier.DEVICE)}
        stepped_there = [st for i, st in self.shards.items() if not self.steps_on_host(i)]
        part, per_element = device_grads(self.device_grads_kept, self.compute_dtype.itemsize)
        parts[part] = per_element * sum(st.numel for st in stepped_there)
        on_device = sum(st.on_device.numel() * 4 for st in self.shards.values() if st.on_device is not None)
        parts["gradient accumulators"] = parts.get("gradient accumulators", 0) + on_device
        if self.streamed is not None:
            parts[STREAMED_SLOTS] = self.streamed.device_bytes
            parts[STREAMED_HANDED] = self.params.handed_bytes()
        return {k: v for k, v in parts.items() if v}

    def shard_bytes_to_move(self, index: int) -> int | None:
        """Device bytes unit ``index``'s shard would add were its step moved there; None: it cannot move."""
        if not self.params.can_home_on_device(index):
            return None
        return 0 if self.params.home(index) is Tier.DEVICE else self.params.numel(index) * self.compute_dtype.itemsize

    @property
    def device_accumulated(self) -> frozenset[int]:  # units whose fp32 gradient sum is on the device already
        return self.landing.device_accumulated

    @property
    def host_used(self) -> int:  # host bytes the optimizer's budget holds now
        return self.host.used

    @property
    def device_grad_bytes(self) -> int:
        """Device bytes an element of a unit stepped there takes for its gradient (an accumulator or one kept)."""
        return device_grads(self.device_grads_kept, self.compute_dtype.itemsize)[1]

    def trains(self, index: int) -> bool:
        """Whether unit ``index`` has optimizer state (trained parameters)."""
        return index in self.shards

    # What the engine asks of the state (the store below stays this room's own).

    @property
    def state_format(self) -> StateFormat:
        """How the optimizer state is held (every sub-group's)."""
        return self.store.fmt

    @property
    def sub_groups(self) -> tuple[SubGroup, ...]:
        """The sub-groups, each with its tier and members, in the store's order (read-only: ``move_to_device``
        changes them)."""
        return tuple(self.store.groups)

    def saved_bytes(self) -> int:
        """Bytes this rank's state takes in a checkpoint (a lent 16+16 high half saved too, its master as one
        float32)."""
        return sum(g.numel * g.fmt.stepped_bytes for g in self.store.groups)

    def lends_weights(self, index: int) -> bool:
        """Whether unit ``index``'s weights are its 16+16 master's high half (see [Note: the weights are the high
        half] in offload/store/optimizer_state.py): a write to them writes the master."""
        return self.trains(index) and self.store.keeps_high_elsewhere(index)

    def one_at_a_time(self, *, read: bool, write: bool) -> Iterator[SubGroup]:
        """Every sub-group's state resident in turn, read from its current slot (``read``) and written back
        (``write``): for checkpoints and whole weights (see ``OptimizerStateStore.one_at_a_time``)."""
        return self.store.one_at_a_time(read=read, write=write)

    def restore_counters(self, adam_steps: int, groups: list[dict[str, Any]]) -> None:
        """A checkpoint's Adam step count and hyperparameters (each group's keys but ``params``)."""
        self.adam_steps = adam_steps
        for g, saved in zip(self.param_groups, groups, strict=True):  # as many: checked by the load
            g.update(saved)

    def master_of(self, index: int) -> torch.Tensor:
        """A copy of unit ``index``'s fp32 master shard, wherever it lives."""
        self._settle()
        return self.store.read_master(index)

    def repair_stale(self) -> None:
        """Rewrite NVMe parameter shards a failed write left behind their master weights (see [Note: parameter
        slots] in offload/store/param_swap.py): the runtime asks for it before a gather reads such a shard (its
        ``StaleRepair``), the engine before it reads the weights."""
        stale = self.params.stale()
        if stale:  # an early step may still be writing other units through the same buffers: let it finish
            self.drain()
            stale = self.params.stale()
        for index in sorted(stale):
            self.params.overwrite(index, self.store.fmt.weights_of(self.master_of(index)))
            logger.info("rewrote unit %s's parameter shard on NVMe from its master weights", self.shards[index].name)

    def _settle(self) -> None:
        """Before the NVMe buffers are used for anything but the step: what this step's pass already stepped
        keeps its new state (like a host shard stepped during backward); a sub-group whose write failed is
        stepped again by the next step."""
        self.drain_quietly()
        self.speculation.unspeculate_nvme()  # a speculated sub-group's new state is not this step's yet
        unstep(self.shards, self.store.drop_read_ahead())

    # ----------------------------------------------------------------- gradients in

    def last_backward_begins(self, chosen: LastBackward) -> None:
        """The coming backward is the last micro-batch's, run as the schedule ``chosen``: its gradients are final
        as they land, so their norm is taken then; the step's first NVMe reads start (see the store's [Note: reads
        ahead of the step])."""
        self.landing.last_begins(chosen.only, self._overlap_plan(chosen.guess) if chosen.steps else None)
        if self.streamed is not None:  # the streamed lane's first reads need no gradient: they go up under backward
            self.streamed.read_ahead(self.adam_steps + 1)
        forward = chosen.forward_order and not chosen.steps
        worker = self.landing.worker
        if chosen.forward_order and self.can_return_early_with_nvme and worker is not None:
            # Queued behind the last step's pass, which may still hold the buffers (the queue orders the two).
            worker.run(lambda: self._read_ahead_quietly(forward))
        else:
            self.store.read_ahead(forward)

    def _read_ahead_quietly(self, forward: bool) -> None:
        """On the landing worker: the step's first reads; one that fails is dropped here (the worker goes on) and
        read again by the step, which says so."""
        try:
            self.store.read_ahead(forward)
        except Exception:  # noqa: BLE001
            self.store.drop_read_ahead()

    def drain(self, speculation: bool = True, copies_back: bool = True) -> None:
        """Wait until every gradient sent so far is in its accumulator and every step handed to a host thread has
        run (re-raises a failed copy or step); ``speculation`` False: not the speculative Adam, which the step
        claims shard by shard (see [Note: speculation on a lane of its own] in speculation_lane.py);
        ``copies_back`` False: not the streamed lane's copies back, which the step's own reads wait for on the copy
        stream (see [Note: the streamed lane] in streamed_step.py)."""
        waits: list[Callable[[], None]] = []
        land, lane, adam = self.landing.worker, self.speculation.lane, self.early.adam
        if land is not None:
            waits.append(lambda: self.accel.drain(land, "gradients drained"))
        if speculation and lane is not None:
            waits.append(lane.drain)
        if adam is not None:
            waits.append(lambda: self.accel.drain(adam, "the delayed update drained"))
        first: Exception | None = None
        for wait in waits:  # every thread, even after one failed: whoever goes on after a failure finds them idle
            try:
                wait()
            except Exception as e:  # noqa: BLE001 - the first is raised below
                first = first or e
        if first is not None:
            raise first
        if self.early.lost is not None:
            raise self.early.lost
        if copies_back and self.streamed is not None:
            self.streamed.settle()

    def clear_grads(self) -> None:
        self.drain()
        self._settle()
        self.overlapped.take_error()
        self.landing.clear()
        self.speculation.drop()
        for state in self.shards.values():
            if state.phase is ShardPhase.HOLDING:
                state.empty()

    # ----------------------------------------------------------------- the step

    def grad_sq_norm(self) -> tuple[float, int]:
        """This rank's sum of squared accumulated gradients and count of non-finite ones: the parts taken as the
        gradients landed, else one native pass per segment, combined in unit and segment order either way."""
        total, nonfinite = 0.0, 0
        for state in self.shards.values():
            if state.phase is ShardPhase.EMPTY:
                continue
            parts = state.norm
            values, factor = state.gradient()
            if parts is None and not self.update.on_discrete_device(state.index):
                self.accel.graph.work("norm", state.index, nbytes=values.numel() * values.element_size())
                parts = [native.grad_sq_norm(values[seg.start:seg.end], threads=self.threads, scale=factor)
                         for seg in state.segments]
            if parts is not None:
                for part in parts:
                    total, nonfinite = total + part.sum_sq, nonfinite + part.nonfinite
        return total, nonfinite

    def device_grad_sq_norm(self) -> torch.Tensor | None:
        """With state on a discrete device: [sum of squares, count of non-finite segments] as a float64 tensor there,
        so the step reads it once (None when no gradient is there). Each segment's norm as plain PyTorch's
        ``clip_grad_norm_`` takes it (float32, a multi-tensor kernel a unit), then the norm of those; the host's
        parts are float64 sums."""
        norms: list[torch.Tensor] = []
        for state in self.shards.values():
            if state.phase is ShardPhase.EMPTY or not self.update.on_discrete_device(state.index):
                continue
            values = widened(*state.gradient())  # a kept gradient as an accumulator holds it, one unit at a time
            segments = [values[seg.start:seg.end] for seg in state.segments]
            # each segment's norm as get_total_norm takes it (a multi-tensor kernel where there is one), then theirs
            norms.extend(torch._foreach_norm(segments, 2.0) if values.is_cuda
                         else [torch.linalg.vector_norm(t, 2.0) for t in segments])
            del values, segments  # one unit's widened copy at a time
        if not norms:
            return None
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0).double()
        return torch.stack([norm.square(), (~norm.isfinite()).double()])

    def hyper(self, group: int) -> Hyper:
        g = self.param_groups[group]
        if g.get("use_muon"):  # a Muon group ([Note: Muon over shards] in offload/optim/muon_pass.py)
            return MuonHyper.of(g)
        if self.update.generic is not None:  # a torch optimizer's own ([Note: a torch optimizer's own step])
            return self.update.generic.hyper(group, g)
        return AdamHyper(lr=float(g["lr"]), betas=tuple(g["betas"]), eps=float(g["eps"]),
                         weight_decay=float(g["weight_decay"]), adamw_mode=self.adamw_mode,
                         bias_correction=self.bias_correction,
                         rule="adam" if self.update_rule == "muon" else self.update_rule)  # Muon's others: AdamW

    def _hypers(self) -> list[Hyper]:
        """Every param group's hyperparameters as the step reads them now (an LR schedule changes them)."""
        return [self.hyper(i) for i in range(len(self.param_groups))]

    def apply(self, grad_scale: float, vote: StepVote | None = None) -> None:
        """One Adam step on every shard with gradients scaled by ``grad_scale``; new params go back to the device
        only after every sub-group's step succeeded (a failed NVMe transfer leaves the last step intact).
        Shards already stepped during backward (see ``last_backward_begins``) are skipped. ``vote``: the ranks'
        agreement at the commit point (see [Note: one rank's failed step] in offload/engine/agreement.py)."""
        self.params.wait_copies_back()  # last step's copies read the host copies, which this step rewrites
        hypers = self._hypers()
        step = self.adam_steps + 1
        try:
            error = self.overlapped.take_error()
            if error is not None:  # an NVMe transfer failed during backward
                raise error
            self.speculation.settle_nvme(step, hypers, grad_scale)
            self.update.prepare_muon(self.store.groups, hypers, grad_scale)
            for group in self.store.step_pass(vote):
                if group.streamed:  # the third lane (see [Note: the streamed lane] in streamed_step.py)
                    assert self.streamed is not None
                    self.streamed.step(group, step, hypers, grad_scale)
                    continue
                for member in group.members:
                    self.speculation.claim(self.shards[member.unit])
                    phase = self.shards[member.unit].phase
                    if phase is ShardPhase.SPECULATED:
                        self.speculation.settle(group, member, step, hypers, grad_scale)
                    elif phase is not ShardPhase.STEPPED:
                        self.update.step_shard(member.unit, group.views(member), step, hypers, grad_scale)
        except BaseException:
            if vote is not None:
                vote.fail()  # before anything slow: the other ranks wait in their vote
            # NVMe sub-groups stepped during backward are stepped again.
            unstep(self.shards, self.store.abort_pass())
            self.params.abort()
            raise
        self.adam_steps = step
        self.landing.end_accumulation()
        for index, state in self.shards.items():
            self.accel.graph.work("hook_step", index)
            if self.split.writes_host_copy(index) and state.phase is not ShardPhase.STEPPED:
                self.params.copy_back(index, after=self.update.after_compute())
            state.empty()
        self.params.commit()  # a failure here leaves units stale, never the step half applied

    @property
    def can_return_early(self) -> bool:
        """Whether ``apply_early`` may run this optimizer's step with nothing in it able to fail after engine.step()
        returned: all its state is host memory and no parameter shard is homed on NVMe."""
        return self.offload and not self.update.nvme_units and all(g.tier is not Tier.NVME
                                                                   for g in self.store.groups)

    @property
    def can_return_early_with_nvme(self) -> bool:
        """Whether ``apply_early`` may run this step with the optimizer state (partly) or parameter shards on NVMe
        (see [Note: the early step on NVMe] in early_step.py, and [Note: an early step's parameter writes] in
        offload/store/param_swap.py); never with NVMe state streamed ([Note: NVMe state streamed])."""
        return self.offload and not self.can_return_early and not self.split.through_host

    # ----------------------------------------------------------------- the step overlapped with backward

    def apply_early(self, grad_scale: float, delayed: bool = False) -> None:
        """``apply``, handed to a host thread: returns at once (see [Note: early step] in early_step.py);
        ``delayed``: the new shards are staged until the next ``publish`` (see [Note: delayed update] there)."""
        assert self.landing.worker is not None
        assert self.can_return_early or (self.can_return_early_with_nvme and not delayed)
        step = self.adam_steps + 1
        self.early.run(grad_scale, self._hypers(), step, delayed)
        self.adam_steps = step
        self.landing.end_accumulation()

    def publish(self) -> None:
        """The last delayed step's new shards reach the parameters (see [Note: delayed update] in early_step.py)."""
        if self.early.pending:
            self.drain()
            self.early.publish()

    def drop_pending(self) -> None:
        """What the delayed update staged will never be published (a checkpoint was loaded over it)."""
        self.drain_quietly()
        self.early.pending.clear()

    def overlap_ready_units(self, speculative: bool = False) -> frozenset[int]:
        """Units whose step can run inside backward: their state is offloaded (on the host, or on NVMe and
        stepped a whole sub-group at a time); ``speculative``: on the host, with their parameters off NVMe."""
        if not self.offload:
            return frozenset()
        if speculative:  # a host sub-group with its second slot, or an NVMe one (its file has two)
            return self.store.units(lambda g: g.spare is not None or g.tier is Tier.NVME) - self.update.nvme_units
        return self.store.units(lambda g: g.tier is not Tier.DEVICE and not g.streamed)

    def _overlap_plan(self, guess: float | None) -> Overlap:
        """The coming backward is the last of the accumulation and nothing global gates the update (or
        ``guess`` is the factor to speculate with): each shard's Adam runs on the host thread as soon as its
        gradient is accumulated (see [Note: overlapped step], and [Note: speculative step] in speculation.py)."""
        return Overlap(self.overlap_ready_units(guess is not None), self._hypers(), self.adam_steps + 1, guess)

    def abandon_overlap(self) -> int:
        """The overlapped backward failed: stop stepping shards; returns how many were already stepped."""
        self._settle()
        self.landing.stop_overlap()
        self.overlapped.take_error()
        self.speculation.drop(ShardPhase.HOLDING)  # its gradients are kept, as those of a failed backward are
        try:  # stepped shards' masters moved on: their new 16-bit copies go with them
            self.params.commit()
        except Exception:  # noqa: BLE001 - they are stale now and rewritten before the next forward
            pass
        return sum(state.phase is ShardPhase.STEPPED for state in self.shards.values())

    def drain_quietly(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the caller is already raising the first failure
            pass

    # ----------------------------------------------------------------- the speculative step

    def close(self) -> None:
        error: BaseException | None = None
        try:
            self.drain()
        except EarlyStepLost as e:  # said at every drain since; closing still releases what the engine holds
            logger.error("closing after a lost step: %s", e)
        except Exception as e:  # noqa: BLE001 - raised once everything is released
            error = e
        self.early.abort()
        try:
            if self.landing.d2h is not None:
                self.landing.d2h.synchronize()
            self.params.wait_copies_back()
        finally:
            self.store.close()
            self.shards.clear()
        if error is not None:
            raise error
