"""The optimizer over this rank's shards: fp32 master, Adam moments and gradient accumulator per unit.

With ``offload_optimizer.device: cpu`` all of it lives in host memory and the step
is the native CPU Adam; otherwise it lives on the compute device (and on a CPU
device it is still the native kernel).

How gradients reach the shards (the D2H stream, the landing worker, landing buffers, device
accumulators, norms taken as they land) is offload/optim/landing.py's, with its notes: [Note:
gradients land], [Note: landings handed over in batches], [Note: gradients read where they land],
[Note: gradients accumulated on the device].

[Note: overlapped step] When nothing global gates the update (no clipping, no fp16
overflow check) the last micro-batch's backward runs each host-resident shard's Adam on
the landing worker right after its gradient lands, while backward goes on with earlier
units; its new shard is copied back at once (the parameter store keeps the copy's event,
which the unit's next gather waits for). An NVMe sub-group steps there too, once all of
its units' gradients are in (see the store's [Note: NVMe sub-groups stepped during
backward]); engine.step() then only steps what is left (units without a gradient) and
makes the new NVMe slots current. The arithmetic is the same kernel on the
same values, so the result is bitwise the same as stepping after backward.

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

[Note: early step] With the state on the host (no NVMe transfer can fail half way) and
ZeRO stage 3, ``apply_early`` hands the step to the landing worker and returns: Adam runs
there shard by shard in unit order, the forward's order, each new shard copied back at
once, while the training thread goes on into the next forward. The parameter store keeps
each shard's step event, and the shard's next reader waits for it (its gather, or an
in-place unit's first use): the forward waits per unit, only for the units Adam has not
reached. The next backward's gradients queue behind the step on the same worker, so
none lands in an accumulator Adam still reads; every other reader of the optimizer state
drains the worker first. Same kernel, same values: bitwise the step after backward.

[Note: a partial offload] With offload_optimizer.ratio below 1 (or auto), the first
units' sub-groups stay on the compute device (offload/store/placement.py chooses them:
the ones the next forward needs first). Those units are treated as without an offload:
their gradients add up in an fp32 accumulator on the device, their norm is taken there,
and Adam steps them there (torch's fused kernel on a GPU, the native kernel on a CPU device:
see [Note: Adam on a discrete device] in offload/optim/adam.py),
writing the new shard straight into the device home; the rest take the offloaded paths
above. With the early step the device units step on the training thread before it
returns (in stream order, so the next forward needs no wait for them).

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
At W > 1 the next step says it on every rank (see [Note: one rank's failed step] in offload/engine/core.py). Hence
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

[Note: parameter return] The step writes each new compute-dtype shard where the
parameter store says (offload/store/param_store.py: [Note: the step's target]); a shard
homed on the device is then copied back by the store, whose event the next gather of
that unit waits for. The optimizer knows shards by unit index only, never the units.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from offload import native
from offload.accelerator import Accelerator, Event, WorkerStream
from offload.optim.adam import AdamHyper, adam_step, device_adam_step
from offload.optim.shard_state import (Guess, Overlap, Segment, ShardPhase, ShardState, by_group,
                                        gaps)
from offload.optim.landing import GradientLanding
from offload.optim.speculation_lane import SpeculationLane, TicketPhase
from offload.schedule import COMPUTE
from offload.telemetry import Telemetry
from offload.aio.base import Engine
from offload.store.budget import TierBudget
from offload.store.optimizer_state import Member, NvmePass, OptimizerStateStore, SubGroup
from offload.store.param_store import ParamStore
from offload.store.tier import Tier
from offload.store.swapdir import SwapDir


logger = logging.getLogger("offload.optim")

class EarlyStepLost(RuntimeError):
    """Work of a step that had returned early (an NVMe transfer, Adam) failed (see [Note: the early step on NVMe])."""


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
    swap: tuple[SwapDir, Engine] | None = None
    rank: int = 0
    device_accumulated: frozenset[int] = frozenset()  # units with an fp32 accumulator on the compute device
    grads_read_where_they_land: bool = False  # the placement's (see [Note: gradients read where they land])
    second_slots: bool = False  # host sub-groups have a second slot, to speculate into (see [Note: speculative step])
    delayed: bool = False  # the delayed update runs (see [Note: delayed update])
    staged: frozenset[int] = frozenset()  # ... and these units' new shards wait in staging buffers (the placement's)


class StepVote(Protocol):
    """Every rank's agreement at the step's commit point (offload/zero/collectives.py's ``Vote``)."""

    def commit(self) -> None: ...

    def fail(self) -> None: ...


class ShardedAdam(torch.optim.Optimizer):
    """Adam/AdamW over the shards of a ZeRO-3 model. Hyperparameters live in ``param_groups`` as in
    any torch optimizer (LR schedulers work), but the step is ``engine.step()``."""

    def __init__(self, param_groups: list[dict[str, Any]], accel: Accelerator, sizes: list[tuple[int, int]], *,
                 plan: StatePlan, params: ParamStore, compute_dtype: torch.dtype, adamw_mode: bool,
                 bias_correction: bool, threads: int | None, telemetry: Telemetry | None = None) -> None:
        """``sizes``: (unit index, shard elements) of every unit with trained parameters, in unit order;
        ``params`` holds their compute-dtype shards, which the step writes."""
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        super().__init__(param_groups, defaults)
        self.accel = accel
        self.offload = plan.device != "none"
        self.compute_dtype = compute_dtype
        self.adamw_mode = adamw_mode
        self.bias_correction = bias_correction
        self.threads = threads
        self.telemetry = telemetry or Telemetry()
        self.host = plan.host
        self.params = params
        self._nvme_units = {i for i, _ in sizes if params.home(i) is Tier.NVME}
        # A partial offload's units stepped on the device (see [Note: a partial offload]).
        self._device_state = frozenset(m.unit for g in plan.groups if g.tier is Tier.DEVICE for m in g.members
                                       ) if self.offload else frozenset()
        self.adam_steps = 0
        self.shards: dict[int, ShardState] = {}
        self.landing = GradientLanding(accel, self.shards, offload=self.offload, threads=threads,
                                       telemetry=self.telemetry, device_accumulated=plan.device_accumulated,
                                       reads_in_place=plan.grads_read_where_they_land, offloaded=self.steps_on_host,
                                       claim=self._claim_speculation, after=self._step_during_backward)
        self._land = self.landing.worker  # the landing worker runs the early step too (see [Note: early step])
        # The delayed update's Adam runs on a thread of its own, so the next backward's gradients land beside it
        # (see [Note: delayed update]).
        self._adam = accel.host_queue("delayed-adam") if self.offload and plan.delayed else None
        # The speculative Adam of host shards runs on a thread of its own, so the landings (and the step's factor)
        # never wait for it (see [Note: speculation on a lane of its own] in offload/optim/speculation_lane.py).
        self._spec = SpeculationLane(accel) if self.offload and plan.second_slots else None
        self._compute_done: Event | None = None  # where the step orders copies after compute (re-recorded)
        # The delayed update's staged shards, by unit, and the units whose staged shard is not yet published.
        self._staged: dict[int, torch.Tensor] = {}
        self._delayed = plan.delayed
        self._staged_units = plan.staged
        self._pending: set[int] = set()
        self._nvme_error: BaseException | None = None  # an NVMe transfer of the overlapped step failed
        self._early_lost: EarlyStepLost | None = None  # ... of an early step: sticky (see [Note: the early step ...])
        self._early_run: NvmePass | None = None  # an early step's NVMe pass, until the landing worker finished it
        if self.offload and sizes:
            self._reserve_host(plan.step_buffers)
        self.store = OptimizerStateStore(plan.groups, accel=accel, host=plan.host, nvme=plan.nvme,
                                         buffer_count=plan.buffer_count, swap=plan.swap, rank=plan.rank,
                                         telemetry=self.telemetry, spare=plan.second_slots)

    def _reserve_host(self, parts: dict[str, int]) -> None:
        """Account the host bytes of accumulators, copies and landing buffers (the plan sized them and checked
        they fit)."""
        for what, nbytes in parts.items():
            self.host.take(nbytes, what)

    @property
    def partial(self) -> bool:
        """Part of the optimizer state stays on the device (see [Note: a partial offload])."""
        return bool(self._device_state)

    def steps_on_host(self, index: int) -> bool:
        """Whether unit ``index``'s optimizer state is offloaded (its step writes a host copy of the shard)."""
        return self.offload and index not in self._device_state

    def _host_tensor(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.accel.host_buffer(n, dtype)[0]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the sharded optimizer steps through engine.step(), which also reduces, clips and "
                           "writes the new parameters back; call engine.step()")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's would be empty: the state lives in the shards and their stores, per rank."""
        raise RuntimeError("the sharded optimizer's state is in this rank's shards (host memory, NVMe), not in a "
                           "state_dict; save and load it with engine.save_checkpoint / engine.load_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise RuntimeError("the sharded optimizer's state is loaded by engine.load_checkpoint (a checkpoint "
                           "engine.save_checkpoint wrote), not from a state_dict")

    # ----------------------------------------------------------------- state

    def add_shard(self, index: int, name: str, master: torch.Tensor, segments: list[Segment]) -> None:
        """Own unit ``index``'s optimizer state; ``master`` is its fp32 shard (host). Units arrive in order."""
        n = master.numel()
        landing, grad = None, None  # an offloaded shard's accumulator: made on first use
        on_device = None
        if self.steps_on_host(index):
            if index in self.landing.device_accumulated:  # the sum comes down once, in fp32
                landing = self._host_tensor(n, torch.float32)
                on_device = torch.empty(n, dtype=torch.float32, device=self.accel.device)
            elif self.landing.d2h is not None:
                landing = self._host_tensor(n, self.compute_dtype)
        else:
            grad = torch.zeros(n, dtype=torch.float32, device=self.accel.device)
        if index in self._staged_units:  # the placement stages only for the delayed update
            self._staged[index] = torch.empty(n, dtype=self.compute_dtype)  # written before it is read
        self.shards[index] = ShardState(index, name, grad, segments, gaps(segments, n), numel=n, landing=landing,
                                        on_device=on_device)
        self.store.init_member(index, master)

    def master_of(self, index: int) -> torch.Tensor:
        """A copy of unit ``index``'s fp32 master shard, wherever it lives."""
        self._settle()
        return self.store.read_master(index)

    def _settle(self) -> None:
        """Before the NVMe buffers are used for anything but the step: what this step's pass already stepped
        keeps its new state (like a host shard stepped during backward); a sub-group whose write failed is
        stepped again by the next step."""
        self.drain_quietly()
        self._unspeculate_nvme()  # a speculated sub-group's new state is not this step's yet
        self._unstep(self.store.drop_read_ahead())

    def _unstep(self, groups: list[SubGroup]) -> None:
        for g in groups:
            for m in g.members:
                state = self.shards[m.unit]
                if state.phase in (ShardPhase.STEPPED, ShardPhase.SPECULATED):
                    state.phase, state.guessed = ShardPhase.HOLDING, None

    # ----------------------------------------------------------------- gradients in

    def last_backward_begins(self, overlap: bool, only: bool = False, guess: float | None = None,
                             early: bool = False) -> None:
        """The coming backward is the last micro-batch's: its gradients are final as they land, so their norm is
        taken then; the step's first NVMe reads start (see the store's [Note: reads ahead of the step]); with
        ``overlap``, each shard's Adam runs as its gradient lands (see [Note: overlapped step]). ``only``: it is
        the step's only micro-batch, so its gradients are read where they land where the state is all on the host
        (see [Note: gradients read where they land]). ``guess``: with ``overlap``, speculate that the step's factor
        is this (see [Note: speculative step]). ``early``: the step will return early, so the NVMe reads go in the
        forward's order (see [Note: the early step on NVMe])."""
        self.landing.last_begins(only, overlap=None)
        forward = early and not overlap
        if early and self.can_return_early_with_nvme and self._land is not None:
            # Queued behind the last step's pass, which may still hold the buffers (the queue orders the two).
            self._land.run(lambda: self._read_ahead_quietly(forward))
        else:
            self.store.read_ahead(forward)
        if overlap:
            self.begin_overlap(guess)

    def _read_ahead_quietly(self, forward: bool) -> None:
        """On the landing worker: the step's first reads; one that fails is dropped here (the worker goes on) and
        read again by the step, which says so."""
        try:
            self.store.read_ahead(forward)
        except Exception:  # noqa: BLE001
            self.store.drop_read_ahead()

    def drain(self, speculation: bool = True) -> None:
        """Wait until every gradient sent so far is in its accumulator and every step handed to a host thread has
        run (re-raises a failed copy or step); ``speculation`` False: not the speculative Adam, which the step
        claims shard by shard (see [Note: speculation on a lane of its own])."""
        waits: list[Callable[[], None]] = []
        if self._land is not None:
            waits.append(lambda: self.accel.drain(self._land, "gradients drained"))
        if speculation and self._spec is not None:
            waits.append(self._spec.drain)
        if self._adam is not None:
            waits.append(lambda: self.accel.drain(self._adam, "the delayed update drained"))
        first: Exception | None = None
        for wait in waits:  # every thread, even after one failed: whoever goes on after a failure finds them idle
            try:
                wait()
            except Exception as e:  # noqa: BLE001 - the first is raised below
                first = first or e
        if first is not None:
            raise first
        if self._early_lost is not None:
            raise self._early_lost

    def clear_grads(self) -> None:
        self.drain()
        self._settle()
        self._nvme_error = None
        self.landing.clear()
        self._drop_speculation()
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
            if parts is None and not self._on_discrete_device(state.index):
                self.accel.schedule.work("norm", state.index, nbytes=values.numel() * values.element_size())
                parts = [native.grad_sq_norm(values[seg.start:seg.end], threads=self.threads, scale=factor)
                         for seg in state.segments]
            if parts is not None:
                for part in parts:
                    total, nonfinite = total + part.sum_sq, nonfinite + part.nonfinite
        return total, nonfinite

    def device_grad_sq_norm(self) -> torch.Tensor | None:
        """With state on a discrete device: [sum of squares, count of non-finite segments] as a float64 tensor there,
        so the step reads it once (None when no gradient is there). One multi-tensor norm over the segments, in
        float32 as plain PyTorch's ``clip_grad_norm_`` takes it; the host's parts are float64 sums."""
        grads = [state.gradient()[0][seg.start:seg.end] for state in self.shards.values()
                 if state.phase is not ShardPhase.EMPTY and self._on_discrete_device(state.index)
                 for seg in state.segments]
        if not grads:
            return None
        norm = torch.nn.utils.get_total_norm(grads, 2.0).double()
        return torch.stack([norm.square(), (~norm.isfinite()).double()])

    def _on_discrete_device(self, index: int) -> bool:
        """Whether unit ``index``'s state lives on a device apart from the host (a GPU, or the emulated one): its
        norm and Adam run in torch's kernels there (see [Note: Adam on a discrete device] in optim/adam.py)."""
        return not self.steps_on_host(index) and not self.accel.host_is_device

    def hyper(self, group: int) -> AdamHyper:
        g = self.param_groups[group]
        return AdamHyper(lr=float(g["lr"]), betas=tuple(g["betas"]), eps=float(g["eps"]),
                         weight_decay=float(g["weight_decay"]), adamw_mode=self.adamw_mode,
                         bias_correction=self.bias_correction)

    def apply(self, grad_scale: float, vote: StepVote | None = None) -> None:
        """One Adam step on every shard with gradients scaled by ``grad_scale``; new params go back to the device
        only after every sub-group's step succeeded (a failed NVMe transfer leaves the last step intact).
        Shards already stepped during backward (see ``begin_overlap``) are skipped. ``vote``: the ranks' agreement
        at the commit point (see [Note: one rank's failed step] in offload/engine/core.py)."""
        self.params.wait_copies_back()  # last step's copies read the host copies, which this step rewrites
        hypers = [self.hyper(i) for i in range(len(self.param_groups))]
        step = self.adam_steps + 1
        try:
            if self._nvme_error is not None:  # an NVMe transfer failed during backward
                error, self._nvme_error = self._nvme_error, None
                raise error
            self._settle_nvme_speculation(step, hypers, grad_scale)
            for group in self.store.step_pass(vote.commit if vote is not None else None):
                for member in group.members:
                    self._claim_speculation(self.shards[member.unit])
                    phase = self.shards[member.unit].phase
                    if phase is ShardPhase.SPECULATED:
                        self._settle_speculation(group, member, step, hypers, grad_scale)
                    elif phase is not ShardPhase.STEPPED:
                        self._step_shard(member.unit, group.views(member), step, hypers, grad_scale)
        except BaseException:
            if vote is not None:
                vote.fail()  # before anything slow: the other ranks wait in their vote
            self._unstep(self.store.abort_pass())  # NVMe sub-groups stepped during backward are stepped again
            self.params.abort()
            raise
        self.adam_steps = step
        self.landing.end_accumulation()
        for index, state in self.shards.items():
            self.accel.schedule.work("hook_step", index)
            if self.steps_on_host(index) and state.phase is not ShardPhase.STEPPED:
                self._compute_done = self.accel.compute_event(into=self._compute_done)
                self.params.copy_back(index, after=self._compute_done)
            state.empty()
        self.params.commit()  # a failure here leaves units stale, never the step half applied

    @property
    def can_return_early(self) -> bool:
        """Whether ``apply_early`` may run this optimizer's step with nothing in it able to fail after engine.step()
        returned: all its state is host memory and no parameter shard is homed on NVMe."""
        return self.offload and not self._nvme_units and all(g.tier is not Tier.NVME for g in self.store.groups)

    @property
    def can_return_early_with_nvme(self) -> bool:
        """Whether ``apply_early`` may run this step with the optimizer state (partly) or parameter shards on NVMe
        (see [Note: the early step on NVMe], and [Note: an early step's parameter writes] in
        offload/store/param_swap.py)."""
        return self.offload and not self.can_return_early

    def apply_early(self, grad_scale: float, delayed: bool = False) -> None:
        """``apply``, handed to the landing worker: returns at once (see [Note: early step]); ``delayed``: the new
        shards are staged until the next ``publish`` (see [Note: delayed update])."""
        assert self._land is not None and (not delayed or self._delayed)
        assert self.can_return_early or (self.can_return_early_with_nvme and not delayed)
        hypers = [self.hyper(i) for i in range(len(self.param_groups))]
        step = self.adam_steps + 1
        after = self._compute_done = self.accel.compute_event(into=self._compute_done)  # the shards' last reads
        lane = self._adam if delayed else self._land
        assert lane is not None
        # Last step's copies back read the host copies this step rewrites.
        lane.run(lambda: self.params.wait_copies_back())
        self.params.forget_reads(self._nvme_units)  # what the read buffers hold of them is the step before
        later: list[tuple[SubGroup, Member]] = []  # the delayed update's, handed over in backward's order
        for group in self.store.groups:  # on the compute stream, before step() returns (and before the NVMe pass)
            if group.tier is Tier.DEVICE:
                for member in group.members:
                    self._step_shard(member.unit, group.views(member), step, hypers, grad_scale)
                    self.shards[member.unit].empty()
        # The NVMe pass in the forward's order; from here on only the landing worker touches it, and every task of
        # this step runs guarded by it (see [Note: the early step on NVMe]).
        run = self._early_run = self.store.detach_pass()
        for group in self.store.groups:
            if group.tier is Tier.NVME:
                assert run is not None
                self._hand_over_sub_group(lane, run, group, step, hypers, grad_scale, after)
            elif group.tier is not Tier.DEVICE:
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
        self.adam_steps = step
        self.landing.end_accumulation()

    def _hand_over(self, lane: WorkerStream, group: SubGroup, member: Member, step: int, hypers: list[AdamHyper],
                   grad_scale: float, after: Event, delayed: bool = False, run: NvmePass | None = None) -> None:
        """One shard's early (or delayed) step queued on ``lane``, and the events its next readers wait for;
        ``run``: the step's NVMe pass, which a failure stops (see [Note: the early step on NVMe])."""
        self.accel.schedule.work("hook_step", member.unit)
        if run is None:
            lane.run(lambda: self._step_early(group, member, step, hypers, grad_scale, after, delayed))
        else:
            lane.run(lambda: self._early_task(run, step, lambda: self._step_early(group, member, step, hypers,
                                                                                 grad_scale, after)))
        state = self.shards[member.unit]
        if delayed:  # nothing reads the staged shard before publish() drains the thread
            state.adam_read = lane.record(into=state.adam_read)
            self._pending.add(member.unit)
        else:
            state.free = lane.record(into=state.free)  # a gradient read where it landed is read by now
            state.stepped = lane.record(into=state.stepped)
            self.params.step_pending(member.unit, state.stepped)

    def _hand_over_sub_group(self, lane: WorkerStream, run: NvmePass, group: SubGroup, step: int,
                             hypers: list[AdamHyper], grad_scale: float, after: Event) -> None:
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
        self._early_run = None

    def _early_task(self, run: NvmePass, step: int, work: Callable[[], None]) -> None:
        """On the landing worker: one task of an early step with an NVMe pass (a transfer, a shard's Adam); any
        failure stops the pass and loses the step, and the worker goes on (see [Note: the early step on NVMe])."""
        if self._early_lost is not None:  # the step is lost: the rest of its tasks do nothing
            return
        try:
            work()
        except Exception as e:  # noqa: BLE001 - said by every later drain
            what = "an NVMe transfer" if isinstance(e, OSError) else f"the update ({type(e).__name__})"
            self._early_lost = EarlyStepLost(
                f"{what} of step {step}'s optimizer state failed after step() had returned ({e}): the swap "
                f"file still holds the optimizer state of step {step - 1}, but some parameters had already taken "
                f"step {step}'s values and the rest of that step was dropped, so this engine cannot go on; build a new "
                "one and load the last checkpoint (offload.early_step \"auto\" or \"off\" keeps a step with its "
                "optimizer state on NVMe whole, and a failed transfer then leaves it retryable)")
            self._early_lost.__cause__ = e
            run.abort()
            self._early_run = None
            for state in self.shards.values():  # the rest of the step is dropped with its gradients
                if state.phase is ShardPhase.HOLDING:
                    state.empty()

    def _step_early(self, group: SubGroup, member: Member, step: int, hypers: list[AdamHyper], grad_scale: float,
                    after: Event, delayed: bool = False) -> None:
        index = member.unit
        state = self.shards[index]
        self._claim_speculation(state)
        if state.phase is not ShardPhase.STEPPED:
            with self.telemetry.span("optimizer_delayed" if delayed else "optimizer_early", state.name):
                if state.phase is ShardPhase.SPECULATED:
                    self._settle_speculation(group, member, step, hypers, grad_scale)
                else:
                    self._step_shard(index, group.views(member), step, hypers, grad_scale,
                                     target=self._staged.get(index) if delayed else None)
            if not delayed:
                self.params.copy_back(index, after=after)
                self.params.commit_early(index)  # an NVMe shard becomes current once written
        state.empty()

    def publish(self) -> None:
        """The last delayed step's new shards reach the parameters (see [Note: delayed update])."""
        if not self._pending:
            return
        self.drain()
        self.params.wait_copies_back()  # the last publish's copies back read the targets rewritten here
        after = self._compute_done = self.accel.compute_event(into=self._compute_done)
        with self.telemetry.span("publish"):
            for index in sorted(self._pending):
                if index in self._staged:
                    out, staged = self.params.step_target(index), self._staged[index]
                    for seg in self.shards[index].segments:
                        out[seg.start:seg.end].copy_(staged[seg.start:seg.end])
                self.params.wrote(index)
                self.params.copy_back(index, after=after)
        self._pending.clear()

    def drop_pending(self) -> None:
        """What the delayed update staged will never be published (a checkpoint was loaded over it)."""
        self.drain_quietly()
        self._pending.clear()

    def _step_shard(self, index: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int,
                    hypers: list[AdamHyper], grad_scale: float,
                    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    target: torch.Tensor | None = None) -> None:
        """One shard's Adam, in place or (``into``: host state) into another slot; the new shard goes to the
        parameter store's target, or to ``target`` (the delayed update's staging)."""
        state = self.shards[index]
        master, exp_avg, exp_avg_sq = views
        empty = state.phase is ShardPhase.EMPTY  # no gradient reached this unit since the last step: Adam sees zeros
        out = target if target is not None else (
            self.params.step_target(index) if self.steps_on_host(index) else None)
        if index in self._nvme_units:  # a fresh write buffer: what the step does not write keeps its value
            assert out is not None
            for start, end in state.gaps:
                out[start:end].copy_(master[start:end])
        out16 = out if out is not None and out.dtype != torch.float32 else None
        grad, pre_scale = (torch.zeros_like(master), 1.0) if empty else state.gradient()
        # Master, moments read and written, the gradient read, the new shard written.
        self.accel.schedule.work("adam", index, nbytes=master.numel() * (24 + grad.element_size() + (
            out.element_size() if out is not None else 0)), lane=COMPUTE if self._on_discrete_device(index) else None)
        if out is None and self._on_discrete_device(index):  # torch's fused kernel
            assert into is None and pre_scale == 1.0  # neither speculated nor read where it landed: host state only
            for group, segs in by_group(state.segments).items():
                slices = [slice(seg.start, seg.end) for seg in segs]
                device_adam_step([master[s] for s in slices], [grad[s] for s in slices],
                                 [exp_avg[s] for s in slices], [exp_avg_sq[s] for s in slices], step, hypers[group],
                                 grad_scale)
        else:
            for seg in state.segments:
                s = slice(seg.start, seg.end)
                adam_step(master[s], grad[s], exp_avg[s], exp_avg_sq[s], step, hypers[seg.group],
                          grad_scale, out16=out16[s] if out16 is not None else None, threads=self.threads,
                          pre_scale=pre_scale, into=None if into is None else (into[0][s], into[1][s], into[2][s]))
        if into is not None:
            master = into[0]
        if out is None:  # state on the compute device: the shard is written straight away
            self.params.write_device(index, master)
        else:
            if out16 is None:
                for seg in state.segments:
                    out[seg.start:seg.end].copy_(master[seg.start:seg.end])
            if target is None:
                self.params.wrote(index)

    # ----------------------------------------------------------------- the step overlapped with backward

    def overlap_ready_units(self, speculative: bool = False) -> frozenset[int]:
        """Units whose step can run inside backward: their state is offloaded (on the host, or on NVMe and
        stepped a whole sub-group at a time); ``speculative``: on the host, with their parameters off NVMe."""
        if not self.offload:
            return frozenset()
        if speculative:  # a host sub-group with its second slot, or an NVMe one (its file has two)
            return frozenset(u for u, (g, _) in self.store.by_unit.items()
                             if (g.spare is not None or g.tier is Tier.NVME) and u not in self._nvme_units)
        return frozenset(u for u, (g, _) in self.store.by_unit.items() if g.tier is not Tier.DEVICE)

    def begin_overlap(self, guess: float | None = None) -> None:
        """The coming backward is the last of the accumulation and nothing global gates the update (or
        ``guess`` is the factor to speculate with): each shard's Adam runs on the host thread as soon as its
        gradient is accumulated (see [Note: overlapped step] and [Note: speculative step])."""
        hypers = [self.hyper(i) for i in range(len(self.param_groups))]
        self.landing.overlap = Overlap(self.overlap_ready_units(guess is not None), hypers, self.adam_steps + 1,
                                       guess)

    def abandon_overlap(self) -> int:
        """The overlapped backward failed: stop stepping shards; returns how many were already stepped."""
        self._settle()
        self.landing.stop_overlap()
        self._nvme_error = None
        self._drop_speculation(ShardPhase.HOLDING)  # its gradients are kept, as those of a failed backward are
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

    def _step_during_backward(self, index: int, overlap: Overlap | None) -> None:
        """On the host thread, right after unit ``index``'s gradient was accumulated (``overlap``: the overlapped
        micro-batch's plan when the gradient came from it). A host shard steps at once; an NVMe sub-group once
        all of its units' gradients are in, in the store's pass order."""
        if overlap is None or index not in overlap.units:
            return
        hypers, step = overlap.hypers, overlap.step
        group, member = self.store.by_unit[index]
        if overlap.guess is not None and group.tier is not Tier.NVME:
            assert self._spec is not None  # a host shard speculates only with its second slot (plan.second_slots)
            self._spec.hand_over(index, lambda: self._speculate_or_leave(group, member, overlap))
            return
        if group.tier is not Tier.NVME:
            self._step_overlapped(index, group.views(member), hypers, step)
            return
        if self._nvme_error is not None:
            return
        try:
            for ready in self.store.arrive(index):
                for m in ready.members:
                    if overlap.guess is not None:  # in the read buffer: the file's current slot stays intact
                        self._speculate_in_place(m.unit, ready.views(m), overlap)
                    else:
                        self._step_overlapped(m.unit, ready.views(m), hypers, step)
        except Exception as e:  # noqa: BLE001 - a failed transfer: engine.step() raises it, and can be retried
            self._nvme_error = e

    def _step_overlapped(self, index: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         hypers: list[AdamHyper], step: int) -> None:
        state = self.shards[index]
        if state.phase is ShardPhase.STEPPED:  # a failed backward stepped it ([Note: shard phases], shard_state.py)
            return
        with self.telemetry.span("optimizer_overlapped", state.name):
            self._step_shard(index, views, step, hypers, 1.0)
        state.phase = ShardPhase.STEPPED
        self.params.copy_back(index, after=None)

    # ----------------------------------------------------------------- the speculative step

    def _speculate(self, group: SubGroup, member: Member, overlap: Overlap) -> None:
        """On the speculation lane: Adam with the guessed factor into the other slot (see [Note: speculative
        step])."""
        state = self.shards[member.unit]
        if state.phase is not ShardPhase.HOLDING:
            return
        assert overlap.guess is not None
        current, other = group.views(member), group.views(member, other=True)
        for start, end in state.gaps:  # the other slot becomes current whole
            for src, dst in zip(current, other):
                dst[start:end].copy_(src[start:end])
        with self.telemetry.span("optimizer_speculative", state.name):
            self._step_shard(member.unit, current, overlap.step, overlap.hypers, overlap.guess, into=other)
        state.guessed = Guess(overlap.guess, tuple(overlap.hypers), overlap.step)
        state.phase = ShardPhase.SPECULATED

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
                self._restore_target(member.unit, group.views(member)[0])  # the guess may have written part of it
            state.phase, state.guessed = ShardPhase.HOLDING, None

    def _claim_speculation(self, state: ShardState) -> None:
        """Before this thread touches the shard's gradient or state (see [Note: speculation on a lane of its
        own])."""
        if self._spec is not None and self._spec.claim(state.index) is TicketPhase.CANCELLED:
            with self.telemetry.span("speculation_cancelled", state.name):
                pass

    def _speculate_in_place(self, index: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                            overlap: Overlap) -> None:
        """On the landing worker: an NVMe sub-group's shard stepped with the guess in its read buffer."""
        state = self.shards[index]
        if state.phase is not ShardPhase.HOLDING:
            return
        assert overlap.guess is not None
        with self.telemetry.span("optimizer_speculative", state.name):
            self._step_shard(index, views, overlap.step, overlap.hypers, overlap.guess)
        state.guessed = Guess(overlap.guess, tuple(overlap.hypers), overlap.step)
        state.phase = ShardPhase.SPECULATED

    def _nvme_speculated(self) -> list[ShardState]:
        return [s for i, s in self.shards.items()
                if s.phase is ShardPhase.SPECULATED and self.store.by_unit[i][0].tier is Tier.NVME]

    def _settle_nvme_speculation(self, step: int, hypers: list[AdamHyper], grad_scale: float) -> None:
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
            self._unstep(self.store.abort_pass())

    def _unspeculate_nvme(self) -> None:
        """No step follows (or something else needs the buffers first): the speculated NVMe sub-groups' new
        slots are dropped with the pass, and each of their targets gets the current master's value back."""
        speculated = self._nvme_speculated()
        if not speculated:
            return
        self._unstep(self.store.abort_pass())
        for state in speculated:
            self._restore_target(state.index, self.store.read_master(state.index))

    def _restore_target(self, index: int, master: torch.Tensor) -> None:
        out, segments = self.params.step_target(index), self.shards[index].segments
        for seg in segments:
            out[seg.start:seg.end].copy_(master[seg.start:seg.end])

    def _settle_speculation(self, group: SubGroup, member: Member, step: int, hypers: list[AdamHyper],
                            grad_scale: float) -> None:
        """The step's factor is known: keep the speculated slot, or recompute it with that factor."""
        state = self.shards[member.unit]
        if state.guessed == Guess(grad_scale, tuple(hypers), step):
            with self.telemetry.span("speculation_kept", state.name):
                pass
        else:
            with self.telemetry.span("speculation_recomputed", state.name):
                self._step_shard(member.unit, group.views(member), step, hypers, grad_scale,
                                 into=group.views(member, other=True))
        group.flip(member)
        state.guessed = None

    def _drop_speculation(self, phase: ShardPhase = ShardPhase.EMPTY) -> None:
        """No step follows the speculation: the state stays as it was, and each speculated shard's target gets
        the current master's 16-bit value back (see [Note: speculative step])."""
        for index, state in self.shards.items():
            if state.phase is not ShardPhase.SPECULATED:
                continue
            group, member = self.store.by_unit[index]  # a host one (NVMe ones: ``_unspeculate_nvme``)
            self._restore_target(index, group.views(member)[0])
            state.phase, state.guessed = phase, None
            if phase is ShardPhase.EMPTY:
                state.empty()

    def close(self) -> None:
        error: BaseException | None = None
        try:
            self.drain()
        except EarlyStepLost as e:  # said at every drain since; closing still releases what the engine holds
            logger.error("closing after a lost step: %s", e)
        except Exception as e:  # noqa: BLE001 - raised once everything is released
            error = e
        run, self._early_run = self._early_run, None
        if run is not None:  # a worker that failed outside the pass's guard left it running: its I/O ends first
            run.abort()
        try:
            if self.landing.d2h is not None:
                self.landing.d2h.synchronize()
            self.params.wait_copies_back()
        finally:
            self.store.close()
            self.shards.clear()
        if error is not None:
            raise error
