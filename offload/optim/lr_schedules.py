"""The config's learning-rate schedules, with DeepSpeed's curves, stepped once per optimizer step.

Like DeepSpeed's, they set each param group's ``lr`` directly (the warmup schedules
ignore the optimizer's own lr; the cosine one scales it), they start at iteration
-1 (the first step runs at the warmup's starting rate) and their state is one counter.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch

from offload.config.fields import Auto
from offload.config.sections import SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams


class _LRSchedule:
    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def lr_at(self, iteration: int, group_index: int) -> float:
        raise NotImplementedError

    def _apply(self) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = self.lr_at(self.last_batch_iteration, i)

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


_Number = TypeVar("_Number", int, float)


def _resolved(value: _Number | Auto | None) -> _Number:
    """A key the schedule reads: Config.resolve has filled its "auto", and check() refused null where read."""
    assert value is not None and not isinstance(value, Auto), f"an unresolved schedule parameter: {value}"
    return value


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """0 -> 1 over ``steps`` iterations, logarithmically or linearly (1 after)."""
    steps = max(2, steps)
    if iteration >= steps:
        return 1.0
    if iteration < 0:
        return 0.0
    if kind == "linear":
        return iteration / steps
    return math.log(iteration + 1) / math.log(steps)


class WarmupLR(_LRSchedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: WarmupLRParams) -> None:
        self.params = params
        super().__init__(optimizer, params.last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        return _warmup_fraction(iteration, _resolved(self.params.warmup_num_steps), self.params.warmup_type)

    def lr_at(self, iteration: int, group_index: int) -> float:
        low, high = _resolved(self.params.warmup_min_lr), _resolved(self.params.warmup_max_lr)
        return low + (high - low) * self._gamma(iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    params: WarmupDecayLRParams

    def _gamma(self, iteration: int) -> float:
        warmup = max(2, _resolved(self.params.warmup_num_steps))
        if iteration < warmup:
            return super()._gamma(iteration)
        total = _resolved(self.params.total_num_steps)
        return max(0.0, (total - iteration) / max(1.0, total - warmup))


class WarmupCosineLR(_LRSchedule):
    """A fraction of each group's own lr: warmup from warmup_min_ratio to 1, then a cosine to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: WarmupCosineLRParams) -> None:
        self.params = params
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, params.last_batch_iteration)

    def lr_at(self, iteration: int, group_index: int) -> float:
        p = self.params
        warmup = max(2, _resolved(p.warmup_num_steps))
        if iteration < warmup:
            ratio = p.warmup_min_ratio + (1 - p.warmup_min_ratio) * _warmup_fraction(iteration, warmup, p.warmup_type)
        else:
            progress = (iteration - warmup + 1) / max(1, _resolved(p.total_num_steps) - warmup)
            ratio = max(0.0, p.cos_min_ratio + (1 - p.cos_min_ratio) * (1 + math.cos(math.pi * min(1.0, progress))) / 2)
        return self.base_lrs[group_index] * ratio


LR_SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> _LRSchedule:
    return LR_SCHEDULES[config.type](optimizer, config.params)
