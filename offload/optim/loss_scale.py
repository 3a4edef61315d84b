"""fp16 loss scaling: static, or dynamic with DeepSpeed's window and hysteresis rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from offload.config.sections import FP16Config


@dataclass
class LossScaler:
    """The scale the loss is multiplied by before backward; 1.0 when fp16 is off.

    Dynamic: an overflow (a non-finite gradient) skips the step; after ``hysteresis``
    overflows the scale halves (never below ``min_scale``); it doubles, and the hysteresis
    refills, on each step whose run of overflow-free steps since the last overflow, less
    one, is a positive multiple of ``window``: DeepSpeed's count, so the first doubling
    comes on the (window + 1)-th clean step after an overflow (or after the start), the
    next ones every ``window`` steps.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    steps: int = 0  # updates so far (applied or skipped)
    last_overflow: int = -1  # the update that last overflowed (-1: none)
    hysteresis_left: int = 2
    overflows: int = 0

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        if fp16.enabled is not True:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale))
        return cls(scale=float(2 ** fp16.initial_scale_power), dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, min_scale=float(fp16.min_loss_scale),
                   consecutive_hysteresis=fp16.consecutive_hysteresis, hysteresis_left=fp16.hysteresis)

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (applied or skipped)."""
        step, self.steps = self.steps, self.steps + 1
        if overflow:
            self.overflows += 1
            self.last_overflow = step
            if not self.dynamic:
                return
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable = step - self.last_overflow - 1  # clean steps before this one since the last overflow
        if stable > 0 and stable % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "steps": self.steps, "last_overflow": self.last_overflow,
                "hysteresis_left": self.hysteresis_left, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "good_steps" in state and "steps" not in state:  # a checkpoint from before DeepSpeed's count
            state = {**state, "steps": state["good_steps"], "last_overflow": -1}
        for key in ("scale", "steps", "last_overflow", "hysteresis_left", "overflows"):
            setattr(self, key, type(getattr(self, key))(state[key]))


def gradient_factor(sum_sq: float, nonfinite: int, loss_scale: float, clip: float) -> tuple[float, float]:
    """The global gradient norm (unscaled; nan when a gradient is not finite) and the one factor the step applies
    to the accumulated gradients: the unscale and the clip (gradient_clipping, 0 for none) folded together."""
    norm = math.sqrt(sum_sq) / loss_scale if nonfinite == 0 else math.nan
    factor = unclipped_factor(loss_scale)
    if clip > 0 and math.isfinite(norm):
        factor *= clip_coefficient(norm, clip)
    return norm, factor


def clip_coefficient(norm: float, clip: float) -> float:
    """The factor ``clip_grad_norm_`` scales the gradients by, in its own float32 steps from the norm held as a
    float32: ``max_norm / (total_norm + 1e-6)`` is a rounded add, then (Tensor.__rdiv__) a rounded reciprocal times
    the clip, then clamped at 1. So the same norm gives torch's factor to the bit (see [Note: the clip factor])."""
    held = np.float32(norm) + np.float32(1e-6)
    return min(1.0, float((np.float32(1.0) / held) * np.float32(clip)))


# [Note: the clip factor] The global norm is a sum of squares taken in float64 (natively, as the gradients land,
# and over the ranks), so it is the exact norm of the float32 gradients rounded once: the same on every CPU and
# every world size. torch's clip_grad_norm_ sums float32 squares in float32, in an order set by the CPU's vector
# width and torch's threads, so its norm (and, where it crosses a rounding boundary, its factor) moves by an ulp
# from one CPU to another. The factor is computed from the norm as torch computes it (``clip_coefficient``), so
# the engine's step is torch's bit for bit wherever the two norms round alike; the tests take their reference's
# factor from the exact norm the same way (tests/engine_cases.py, ``clip_at_exact_norm_``).


def unclipped_factor(loss_scale: float) -> float:
    """The step's gradient factor when clipping does not fire: what the speculative step guesses, bitwise."""
    return 1.0 / loss_scale
