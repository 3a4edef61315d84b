"""How the optimizer step is scheduled against backward and the next forward, decided once at start-up.

Three independent choices, each exact (the same values as stepping after backward):
- overlapped: when nothing global gates the update, each shard's Adam runs during the
  last backward as its gradient lands (offload/optim/sharded.py, [Note: overlapped step]);
- speculative: when clipping or fp16 does gate it, the same, with the factor guessed
  (clipping does not fire) into a second slot, kept or recomputed once the norm is known
  ([Note: speculative step] there);
- early: engine.step() returns before Adam and the next forward waits per unit
  ([Note: early step] there);
- delayed (opt-in, not exact): after warm-up, Adam runs while the next forward and backward
  use the parameters from before it ([Note: delayed update] there).
``StepMode.describe`` is what ``engine.step_mode`` says, reasons included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.accelerator import Accelerator
from offload.config import Config, ConfigError
from offload.optim.sharded import ShardedAdam
from offload.zero.stage import Stage


@dataclass(frozen=True)
class StepMode:
    overlap: bool  # the exact overlapped step
    speculative: bool  # the speculative step (never with ``overlap``: it is for the updates something gates)
    early: bool
    early_nvme: bool = False  # ... with the optimizer state's NVMe pass (see [Note: the early step on NVMe])
    adaptive: bool = False  # speculate (on NVMe sub-groups) only while the last step's clipping did not fire
    after_why: str = ""  # why Adam does not overlap backward (neither mode)
    early_why: str = ""
    delayed_after: int | None = None  # exact steps before the delayed update begins (None: never)

    def describe(self) -> str:
        if self.delayed_after is not None:
            return (f"delayed update after {self.delayed_after} exact steps: each step's Adam runs while the next "
                    "forward and backward use the parameters from before it, which change one step late (results "
                    "differ from an exact step by design)")
        if self.speculative:
            during = ("speculative: Adam runs during the last micro-batch's backward with clip factor 1 into a "
                      "second slot, kept when clipping does not fire, recomputed when it does")
            if self.adaptive:
                during += (" (on the NVMe sub-groups, while the last step's clipping did not fire: their I/O hides "
                           "under backward)")
            else:
                during += (" (host shards' on a thread of their own; the step steps a shard whose speculation has "
                           "not begun)")
        elif self.overlap:
            during = "overlapped with the last micro-batch's backward"
        else:
            during = f"after backward ({self.after_why})"
        early = "step() returns before Adam, the next forward waits per unit"
        if self.early_nvme:
            early += (" (NVMe reads, Adam and writes run beside the next forward and backward, on steps whose "
                      "backward did not step them; an optimizer state transfer that fails then loses the step, a "
                      "parameter write that fails is redone from the master by the forward that needs it)")
        return during + "; " + (early if self.early else f"step() returns after Adam ({self.early_why})")


def gated(config: Config, compute_dtype: torch.dtype) -> list[str]:
    """What makes the update wait for the global gradient norm (empty: nothing)."""
    reasons = []
    if float(config.gradient_clipping or 0.0) > 0:
        reasons.append("gradient clipping needs the global norm first")
    if compute_dtype == torch.float16:
        reasons.append("fp16 needs the overflow check first")
    return reasons


def speculation_scope(config: Config, compute_dtype: torch.dtype) -> tuple[str, str]:
    """Which sub-groups the speculative step would run on before any budget is looked at ("all": host ones with
    their second slot and NVMe ones; "nvme": NVMe ones only, while the last step's clipping did not fire; "":
    none), and if none, why."""
    why = _speculation_unwanted(config, compute_dtype)
    if why is not None:
        return "", why
    return ("nvme" if config.offload.speculative_step == "auto" else "all"), ""


def _speculation_unwanted(config: Config, compute_dtype: torch.dtype) -> str | None:
    mode = config.offload.speculative_step
    if mode == "off":
        return "offload.speculative_step is off"
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
        # Measured on a 2-core Xeon (GPT-2-small, fp32, W = 1, 2026-11-25): host sub-groups speculated made the
        # step 1.05x (kept) and 1.08x (recomputed) the step after backward, Adam and backward sharing the cores.
        # On an H100 (156M GPT, bf16, 2026-11-25): 1.30x and 2.15x, Adam into the second slot outlasting backward.
        # On an H200 with the second slot streamed (2026-11-26): 1.02x kept, the landing worker's norms and
        # speculative Adam (50 ms a step) outlasting a 21 ms backward. With the Adam on a lane of its own (H200,
        # 2026-11-26, third loan): 0.93-0.94x kept but 1.37x recomputed; adaptively (as NVMe sub-groups do) each
        # clipping onset costs about seven kept steps' gain, so it loses wherever more than one step in eight clips.
        return ("'auto' speculates only on NVMe sub-groups (host ones measured slower on a CPU, where Adam and "
                "backward share the cores; on a GPU 6% faster when clipping does not fire, 37% slower when it "
                "does); set offload.speculative_step to \"on\" to speculate on the host's too")
    return None


def decide(config: Config, compute_dtype: torch.dtype, stage: Stage, optimizer: ShardedAdam, accel: Accelerator,
           speculative: bool, speculative_why: str, adaptive: bool = False) -> StepMode:
    """The step's schedule; ``speculative`` and ``speculative_why`` are the placement's verdict (the second
    slot needs host memory)."""
    reasons = gated(config, compute_dtype)
    if not optimizer.offload:
        reasons.append("the optimizer state is on the compute device")
    if not config.zero_optimization.ignore_unused_parameters:
        reasons.append("ignore_unused_parameters false checks every gradient first")
    mode = config.offload.overlap_step
    if mode == "off":
        reasons.append("offload.overlap_step is off")
    elif mode == "auto" and accel.is_cuda:
        # Measured on an H100 (W=1, 156M-parameter bf16 GPT): the per-unit Adam on the host thread delays
        # the gradient drain that backward's end waits for, 0.72x the step after backward. "on" forces it.
        reasons.append("on a GPU 'auto' steps after backward, which measured faster there; set "
                       "offload.overlap_step to \"on\" to overlap anyway")
    if speculative:
        reasons = []
    elif gated(config, compute_dtype) and speculative_why:
        reasons.append(f"not speculative: {speculative_why}")
    early, early_why = _early_step(config, stage, optimizer, accel)
    delayed = config.offload.delayed_update.warmup_steps
    if delayed is not None:
        if stage.resident_params or not optimizer.can_return_early or optimizer.partial:
            raise ConfigError("offload.delayed_update.warmup_steps", "the delayed update needs ZeRO stage 3 with "
                              "all of the optimizer state on the host and no parameters on NVMe (its "
                              f"Adam runs on a worker beside the next forward); this config has stage "
                              f"{stage.number}, optimizer {config.zero_optimization.offload_optimizer.device} "
                              f"(ratio {config.zero_optimization.offload_optimizer.ratio}), parameters "
                              f"{config.zero_optimization.offload_param.device}: remove the section, or offload "
                              "all of the optimizer state to the host")
        return StepMode(overlap=False, speculative=False, early=early, after_why="the delayed update",
                        early_why=early_why, delayed_after=delayed)
    return StepMode(overlap=not reasons and not speculative, speculative=speculative, adaptive=adaptive,
                    early=early, early_nvme=early and not optimizer.can_return_early,
                    after_why="; ".join(reasons), early_why=early_why)


def _early_step(config: Config, stage: Stage, optimizer: ShardedAdam, accel: Accelerator) -> tuple[bool, str]:
    """Whether engine.step() may return before Adam has run, and if not, why."""
    mode = config.offload.early_step
    if mode == "off":
        return False, "offload.early_step is off"
    if stage.resident_params:
        return False, f"ZeRO stage {stage.number} spreads the new partitions right after the step"
    if not optimizer.can_return_early and not optimizer.can_return_early_with_nvme:
        return False, "the optimizer state or some parameter shards are on NVMe or the device"
    if not optimizer.can_return_early and mode == "auto":
        return False, ("'auto' keeps a step whose optimizer state or parameters are on NVMe whole, so that a failed "
                       "transfer leaves the last step intact and the step can be retried; set offload.early_step to "
                       "\"on\" to return early anyway (NVMe reads, Adam and writes then run beside the next forward)")
    if mode == "auto" and not accel.is_cuda:
        return False, "'auto' keeps the step whole on a CPU, where Adam and the forward share the cores; set " \
                      "offload.early_step to \"on\" to return early anyway"
    return True, ""
