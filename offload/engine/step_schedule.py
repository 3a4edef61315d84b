"""How the optimizer step is scheduled against backward and the next forward: one object, chosen at start-up.

A schedule is two choices, each a small class that owns its own state:

- what the last micro-batch's backward does besides landing gradients: nothing (``AfterBackward``),
  step each shard as it lands when nothing gates the update (``Overlapped``), or step each with a
  guessed clip factor into a second slot (``Speculative``);
- where ``engine.step()`` returns: after Adam (``Whole``), before it with the next forward waiting
  per unit (``Early``; ``EarlyNvme`` with the NVMe pass beside the forward), or, after warm-up,
  one step late (``Delayed``).

Every combination but ``Delayed``'s is exact: the same values as stepping after backward.
The optimizer's notes say how each runs: [Note: overlapped step] in offload/optim/sharded.py,
[Note: speculative step] in offload/optim/speculation.py, and [Note: early step], [Note: the early
step on NVMe] and [Note: delayed update] in offload/optim/early_step.py. ``wanted`` and ``choose``
are the only readers of the config keys that pick them (``offload.overlap_step``,
``speculative_step``, ``early_step``, ``delayed_update``): ``wanted`` says what the placement must
plan for (a second slot, staging buffers), ``choose`` decides once the placement and the optimizer
exist. ``StepSchedule.describe`` is ``engine.step_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.config import Config, ConfigError
from offload.config.fields import resolved
from offload.config.sections import RULE_NAMES
from offload.machine.accelerator import Accelerator
from offload.optim.loss_scale import unclipped_factor
from offload.optim.sharded import LastBackward, ShardedAdam, StepVote
from offload.store.placement import Placement, Speculation
from offload.zero.stage import Stage

# ----------------------------------------------------------------- during the last backward

class DuringBackward:
    """What the last micro-batch's backward does besides landing gradients."""

    def begins(self, loss_scale: float) -> tuple[bool, float | None]:
        """The last backward begins: whether it steps shards as they land, and the factor it guesses (None: the
        exact one, nothing gates the update)."""
        return False, None

    def norm_known(self, clipped: bool) -> None:
        """The step's norm is known; ``clipped``: its clipping fired (or fp16 overflowed)."""

    def describe(self) -> str:
        raise NotImplementedError

    def brief(self) -> str:
        """A few words for the first lines a person reads; ``describe`` adds why."""
        raise NotImplementedError


@dataclass
class AfterBackward(DuringBackward):
    why: str  # why nothing steps during backward

    def describe(self) -> str:
        return f"after backward ({self.why})"

    def brief(self) -> str:
        return "after backward"


class Overlapped(DuringBackward):
    def begins(self, loss_scale: float) -> tuple[bool, float | None]:
        return True, None

    def describe(self) -> str:
        return "overlapped with the last micro-batch's backward"

    def brief(self) -> str:
        return "overlapped with backward"


@dataclass
class Speculative(DuringBackward):
    """Guesses that clipping does not fire; ``adaptive``: only after a step whose clipping did not (the norm
    changes slowly), as the NVMe sub-groups do, whose I/O hides under backward."""

    adaptive: bool
    clipped_last: bool = False

    def begins(self, loss_scale: float) -> tuple[bool, float | None]:
        if self.adaptive and self.clipped_last:
            return False, None
        return True, unclipped_factor(loss_scale)

    def norm_known(self, clipped: bool) -> None:
        self.clipped_last = clipped

    def brief(self) -> str:
        return "speculative during backward" + (" (NVMe sub-groups)" if self.adaptive else "")

    def describe(self) -> str:
        text = ("speculative: Adam runs during the last micro-batch's backward with clip factor 1 into a second "
                "slot, kept when clipping does not fire, recomputed when it does")
        if self.adaptive:
            return text + (" (on the NVMe sub-groups, while the last step's clipping did not fire: their I/O hides "
                           "under backward)")
        return text + (" (host shards' on a thread of their own; the step steps a shard whose speculation has not "
                       "begun)")


# ----------------------------------------------------------------- where step() returns



class StepReturn:
    """How ``engine.step()`` runs Adam once the factor is known, and whether it waits for it."""

    @property
    def forward_order(self) -> bool:
        """Whether the step's NVMe reads go in the next forward's order (it returns before them)."""
        return False

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, stepped_in_backward: bool,
              vote: StepVote | None) -> bool:
        """Runs (or starts) the step's Adam; returns whether it has finished."""
        raise NotImplementedError

    def describe(self, during: str) -> str:
        raise NotImplementedError

    def brief(self, during: str) -> str:
        raise NotImplementedError


@dataclass
class Whole(StepReturn):
    why: str  # why step() does not return early

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, stepped_in_backward: bool,
              vote: StepVote | None) -> bool:
        optimizer.apply(grad_scale, vote)
        return True

    def describe(self, during: str) -> str:
        return f"{during}; step() returns after Adam ({self.why})"

    def brief(self, during: str) -> str:
        return f"{during}, step() returns after Adam"


class Early(StepReturn):
    @property
    def forward_order(self) -> bool:
        return True

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, stepped_in_backward: bool,
              vote: StepVote | None) -> bool:
        optimizer.apply_early(grad_scale)
        return False

    def describe(self, during: str) -> str:
        return f"{during}; step() returns before Adam, the next forward waits per unit"

    def brief(self, during: str) -> str:
        return f"{during}, step() returns before Adam"


class EarlyNvme(Early):
    """The early step with the NVMe pass beside the next forward; a pass that began in backward (backward's
    order: it stepped the sub-groups there) finishes in the step instead."""

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, stepped_in_backward: bool,
              vote: StepVote | None) -> bool:
        if stepped_in_backward:
            optimizer.apply(grad_scale, vote)
        else:
            optimizer.apply_early(grad_scale)
        return stepped_in_backward

    def describe(self, during: str) -> str:
        return super().describe(during) + (
            " (NVMe reads, Adam and writes run beside the next forward and backward, on steps whose backward did "
            "not step them; an optimizer state transfer that fails then loses the step, a parameter write that "
            "fails is redone from the master by the forward that needs it)")


@dataclass
class Delayed(StepReturn):
    """After ``after`` exact steps (each as ``exact`` runs it), each step's Adam runs beside the next forward and
    backward, which use the parameters from before it."""

    after: int
    exact: Whole | Early

    @property
    def forward_order(self) -> bool:  # as the exact steps' schedule
        return self.exact.forward_order

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, stepped_in_backward: bool,
              vote: StepVote | None) -> bool:
        if step > self.after:
            optimizer.apply_early(grad_scale, delayed=True)
            return False
        return self.exact.apply(optimizer, grad_scale, step, stepped_in_backward, vote)

    def brief(self, during: str) -> str:
        return f"delayed one step after {self.after} exact ones"

    def describe(self, during: str) -> str:
        return (f"delayed update after {self.after} exact steps: each step's Adam runs while the next forward and "
                "backward use the parameters from before it, which change one step late (results differ from an "
                "exact step by design)")


# ----------------------------------------------------------------- the schedule

@dataclass
class StepSchedule:
    during: DuringBackward
    returns: StepReturn
    stepped_in_backward: bool = False  # the last backward stepped shards as they landed
    could_step: bool = False  # the last backward was surely the step's last (it could step shards as they landed)

    def last_backward_begins(self, optimizer: ShardedAdam, loss_scale: float, only: bool, sure: bool = True) -> bool:
        """The coming backward completes the accumulation (``only``: its only one; ``sure``: no other call can
        follow it before step(), see [Note: more backward calls than micro-batches] in accumulation.py); returns
        whether it steps shards as they land (never when not ``sure``)."""
        steps, guess = self.during.begins(loss_scale) if sure else (False, None)
        optimizer.last_backward_begins(LastBackward(only=only, steps=steps, guess=guess,
                                                    forward_order=self.returns.forward_order))
        self.stepped_in_backward, self.could_step = steps, sure
        return steps

    def norm_known(self, clipped: bool) -> None:
        """The step's norm is known. A step that could not step during backward (the first: it shows how many
        backward calls make a step) teaches the adaptive speculation nothing: the first step that can, does."""
        if self.could_step:
            self.during.norm_known(clipped)

    def apply(self, optimizer: ShardedAdam, grad_scale: float, step: int, vote: StepVote | None) -> bool:
        """Step ``step``'s Adam with the known factor; returns whether it has finished."""
        return self.returns.apply(optimizer, grad_scale, step, self.stepped_in_backward, vote)

    def describe(self) -> str:
        return self.returns.describe(self.during.describe())

    def brief(self) -> str:
        """The schedule in a few words (``describe``: with why each choice was made)."""
        return self.returns.brief(self.during.brief())


# ----------------------------------------------------------------- choosing it

@dataclass(frozen=True)
class Wanted:
    """What the schedule asks of the placement before any budget is looked at."""

    speculation: Speculation
    speculation_why: str  # why none, when none
    delayed: bool  # the delayed update stages new shards
    not_streamed: str = ""  # why the update cannot run in the streamed lane (empty: it can)


def gated(config: Config, compute_dtype: torch.dtype) -> list[str]:
    """What makes the update wait for the global gradient norm (empty: nothing)."""
    reasons = []
    if float(resolved(config.gradient_clipping) or 0.0) > 0:
        reasons.append("gradient clipping needs the global norm first")
    if compute_dtype == torch.float16:
        reasons.append("fp16 needs the overflow check first")
    return reasons


def wanted(config: Config, compute_dtype: torch.dtype, rule: str) -> Wanted:
    """``rule``: the update the optimizer runs (AdamHyper.rule: the config's type, or a client object's)."""
    delayed = config.offload.delayed_update.warmup_steps is not None
    not_streamed = WHOLE.get(rule, "")
    why = _speculation_unwanted(config, compute_dtype, rule)
    if why is not None:
        return Wanted(Speculation.NONE, why, delayed, not_streamed)
    auto = config.offload.speculative_step == "auto"
    return Wanted(Speculation.NVME if auto else Speculation.ALL, "", delayed, not_streamed)


def _speculation_unwanted(config: Config, compute_dtype: torch.dtype, rule: str) -> str | None:
    mode = config.offload.speculative_step
    if mode == "off":
        return "offload.speculative_step is off"
    if rule != "adam":
        why = f"{RULE_NAMES[rule]} is not speculated (its step is not written into a second slot)"
        if mode == "on":
            raise ConfigError("offload.speculative_step", f"{why}: set it to \"auto\" or \"off\"")
        return why
    if config.offload.delayed_update.warmup_steps is not None:
        return "the delayed update steps after backward"
    if config.offload.overlap_step == "off":
        return "offload.overlap_step is off"
    if not gated(config, compute_dtype):
        return "nothing gates the update, so there is nothing to speculate on"
    if config.zero_optimization.offload_optimizer.device == "none":
        return "the optimizer state is on the compute device"
    if not config.zero_optimization.ignore_unused_parameters:
        return "ignore_unused_parameters false checks every gradient first"
    if mode == "auto" and config.zero_optimization.offload_optimizer.device != "nvme":
        # Host sub-groups speculated measured slower on a CPU (Adam and backward share the cores) and, on a GPU, 6%
        # faster when clipping does not fire but 37% slower when it does (docs/performance.md, "speculative").
        return ("'auto' speculates only on NVMe sub-groups (host ones measured slower on a CPU, where Adam and "
                "backward share the cores; on a GPU 6% faster when clipping does not fire, 37% slower when it "
                "does); set offload.speculative_step to \"on\" to speculate on the host's too")
    return None


def second_slots(want: Wanted, placement: Placement) -> bool:
    """Whether host sub-groups get the speculative step's second slot of their state."""
    return want.speculation is Speculation.ALL and placement.speculative


def choose(config: Config, compute_dtype: torch.dtype, stage: Stage, optimizer: ShardedAdam, accel: Accelerator,
           want: Wanted, placement: Placement) -> StepSchedule:
    """The run's schedule, from the config, what the placement could hold (the speculative slot needs host
    memory) and what the optimizer's state allows."""
    _refuse_beside_whole(config, optimizer.update_rule)
    returns = _returns(config, stage, optimizer, accel)
    delayed = config.offload.delayed_update.warmup_steps
    if delayed is not None:
        if stage.resident_params or not optimizer.can_return_early or optimizer.partial or optimizer.streamed:
            raise ConfigError("offload.delayed_update.warmup_steps", "the delayed update needs ZeRO stage 3 with "
                              "all of the optimizer state on the host, stepped there, and no parameters on NVMe "
                              "(its Adam runs on a worker beside the next forward); this config has stage "
                              f"{stage.number}, optimizer {config.zero_optimization.offload_optimizer.device} "
                              f"(ratio {config.zero_optimization.offload_optimizer.ratio}, stream_state "
                              f"{config.offload.stream_state}), parameters "
                              f"{config.zero_optimization.offload_param.device}: remove the section, or offload "
                              "all of the optimizer state to the host")
        assert isinstance(returns, (Whole, Early))  # all the state on the host: never EarlyNvme
        return StepSchedule(AfterBackward("the delayed update"), Delayed(delayed, returns))
    if placement.speculative:
        return StepSchedule(Speculative(adaptive=want.speculation is Speculation.NVME), returns)
    reasons = _not_overlapped(config, compute_dtype, optimizer)
    why_not = want.speculation_why or placement.speculative_why
    if gated(config, compute_dtype) and why_not:
        reasons.append(f"not speculative: {why_not}")
    return StepSchedule(AfterBackward("; ".join(reasons)) if reasons else Overlapped(), returns)


# why these updates run whole after backward ([Note: Muon over shards] in offload/optim/muon_pass.py, [Note: a torch
# optimizer's own step] in offload/optim/generic.py)
WHOLE = {"muon": "Muon's step gathers each matrix from every rank once every gradient is in"}


def _refuse_beside_whole(config: Config, rule: str) -> None:
    """An update that runs whole after backward (``WHOLE``) refuses every key that asks to step elsewhere."""
    if rule not in WHOLE:
        return
    off = config.offload
    for key, asked, fix in (("overlap_step", off.overlap_step == "on", "set it to auto or off"),
                            ("early_step", off.early_step == "on", "set it to auto or off"),
                            ("delayed_update.warmup_steps", off.delayed_update.warmup_steps is not None,
                             "remove the section")):
        if asked:
            raise ConfigError(f"offload.{key}", f"{WHOLE[rule]}, so it runs whole after backward: {fix}")


def _not_overlapped(config: Config, compute_dtype: torch.dtype, optimizer: ShardedAdam) -> list[str]:
    """Why the exact overlapped step cannot (or should not) run (empty: it runs)."""
    reasons = gated(config, compute_dtype)
    if not optimizer.offload:
        reasons.append("the optimizer state is on the compute device")
    if not config.zero_optimization.ignore_unused_parameters:
        reasons.append("ignore_unused_parameters false checks every gradient first")
    mode = config.offload.overlap_step
    if mode == "off":
        reasons.append("offload.overlap_step is off")
    if optimizer.update_rule in WHOLE:  # what asked for more is refused in ``choose``
        reasons.append(WHOLE[optimizer.update_rule])
    # 'auto' overlaps on a GPU too. It stepped after backward there once: on an H100 (2026-11-22) the overlapped
    # step measured 0.72x, when the host thread ran each shard's Adam and held up the gradient drain backward's end
    # waits for. The Adam runs on the landing worker now, and the replay on the h100 preset (docs/performance.md,
    # "the step overlapped on a GPU") puts the overlapped step at 0.77x the step after backward for the 0.91B GPT
    # homed on the host and 0.89x for the 156M one; the GPU rows (tools/gpu_session.sh) measure both.
    return reasons


def _returns(config: Config, stage: Stage, optimizer: ShardedAdam, accel: Accelerator) -> StepReturn:
    """Whether engine.step() may return before Adam has run, and if not, why."""
    mode = config.offload.early_step
    if mode == "off":
        return Whole("offload.early_step is off")
    if optimizer.update_rule in WHOLE:  # what asked for more is refused in ``choose``
        return Whole(WHOLE[optimizer.update_rule])
    if stage.resident_params:
        return Whole(f"ZeRO stage {stage.number} spreads the new partitions right after the step")
    if optimizer.split.through_host:
        return Whole("the streamed lane steps NVMe state inside the step's pass (offload.stream_state), which does "
                     "not run beside the next forward")
    if not optimizer.can_return_early and not optimizer.can_return_early_with_nvme:
        return Whole("the optimizer state or some parameter shards are on NVMe or the device")
    if not optimizer.can_return_early and mode == "auto":
        return Whole("'auto' keeps a step whose optimizer state or parameters are on NVMe whole, so that a failed "
                     "transfer leaves the last step intact and the step can be retried; set offload.early_step to "
                     "\"on\" to return early anyway (NVMe reads, Adam and writes then run beside the next forward)")
    if mode == "auto" and not accel.is_cuda:
        return Whole("'auto' keeps the step whole on a CPU, where Adam and the forward share the cores; set "
                     "offload.early_step to \"on\" to return early anyway")
    return Early() if optimizer.can_return_early else EarlyNvme()
