"""The config's learning-rate schedules, with DeepSpeed's curves, stepped once per optimizer step.

Like DeepSpeed 0.19.8's, they set each param group's ``lr`` directly (the warmup schedules
warm up to warmup_max_lr, or WarmupLR without one to the optimizer's lr; the cosine one
scales the optimizer's lr), they start at iteration -1 (the first step runs at the warmup's
starting rate: 0 for the cosine one) and their state is one counter. OneCycle also cycles
Adam's beta1 (and sets beta2 to 0.99, as DeepSpeed's does).
"""

from __future__ import annotations

import logging
import math
from typing import Any, TypeVar

import torch

from offload.config.fields import Auto
from offload.config.sections import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)

logger = logging.getLogger("offload.engine")


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
    """From warmup_min_lr to warmup_max_lr (None: the optimizer's first group's lr) over warmup_num_steps, then
    constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: WarmupLRParams) -> None:
        self.params = params
        peak = params.warmup_max_lr
        self.max_lr: float = _resolved(peak) if peak is not None else float(optimizer.param_groups[0]["lr"])
        super().__init__(optimizer, params.last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        return _warmup_fraction(iteration, _resolved(self.params.warmup_num_steps), self.params.warmup_type)

    def lr_at(self, iteration: int, group_index: int) -> float:
        low = _resolved(self.params.warmup_min_lr)
        return low + (self.max_lr - low) * self._gamma(iteration)


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
        if iteration < 0:  # before the first step: 0, as DeepSpeed's (not the warmup's starting ratio)
            return 0.0
        warmup = max(2, _resolved(p.warmup_num_steps))
        if iteration < warmup:
            ratio = p.warmup_min_ratio + (1 - p.warmup_min_ratio) * _warmup_fraction(iteration, warmup, p.warmup_type)
        else:
            progress = (iteration - warmup + 1) / max(1, _resolved(p.total_num_steps) - warmup)
            ratio = max(0.0, p.cos_min_ratio + (1 - p.cos_min_ratio) * (1 + math.cos(math.pi * min(1.0, progress))) / 2)
        return self.base_lrs[group_index] * ratio


class OneCycle(_LRSchedule):
    """One cycle from cycle_min_lr up to cycle_max_lr and back (beta1 the other way, between cycle_max_mom and
    cycle_min_mom), then an optional decay; each half continuous or in stairs."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: OneCycleParams) -> None:
        self.params = params
        first = float(params.cycle_first_step_size)
        second = float(params.cycle_second_step_size) if params.cycle_second_step_size is not None else first
        self.first, self.second, self.total = first, second, first + second
        self.stairs = (params.cycle_first_stair_count, params.cycle_first_stair_count
                       if params.cycle_second_stair_count is None else params.cycle_second_stair_count)
        self.momentum = params.cycle_momentum
        if params.last_batch_iteration == -1:  # the first step: the lower rate, and (DeepSpeed's) the lower beta1
            for group in optimizer.param_groups:
                group["lr"] = _resolved(params.cycle_min_lr)
                if self.momentum:
                    group["betas"] = (params.cycle_min_mom, 0.99)
        self.optimizer, self.last_batch_iteration = optimizer, params.last_batch_iteration

    def _scale(self, iteration: int) -> float:
        """Where in the cycle the step after ``iteration`` is: 0 at its ends, 1 at its peak."""
        done = iteration + 1
        cycle = math.floor(1 + done / self.total)
        x = 1.0 + done / self.total - cycle
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.stairs[0]
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.stairs[1]
        if stairs > 0:  # held flat over each stair, counted from the whole steps into the cycle
            into = done % self.total
            position = into * stairs / self.first if into <= self.first else (self.total - into) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decaying(self, iteration: int) -> float | None:
        """Decay intervals after the cycle (None: still in it)."""
        if iteration < self.total:
            return None
        return (iteration - self.total + 1) / self.params.decay_step_size if self.params.decay_step_size else 0.0

    def lr_at(self, iteration: int, group_index: int) -> float:
        p = self.params
        low, high = _resolved(p.cycle_min_lr), _resolved(p.cycle_max_lr)
        intervals = self._decaying(iteration)
        if intervals is None:
            return low + (high - low) * self._scale(iteration)
        return low / (1 + p.decay_lr_rate * intervals) if p.decay_step_size and p.decay_lr_rate else low

    def beta1_at(self, iteration: int) -> float:
        p = self.params
        intervals = self._decaying(iteration)
        if intervals is None:
            return p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * self._scale(iteration)
        return p.cycle_max_mom * (1 + p.decay_mom_rate * intervals) if p.decay_step_size and p.decay_mom_rate \
            else p.cycle_max_mom

    def _apply(self) -> None:
        super()._apply()
        if self.momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.beta1_at(self.last_batch_iteration), 0.99)


class LRRangeTest(_LRSchedule):
    """The learning-rate range test: from lr_range_test_min_lr up, by step_rate per step_size steps (continuously,
    or in whole intervals)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: LRRangeTestParams) -> None:
        self.params = params
        super().__init__(optimizer, params.last_batch_iteration)

    def lr_at(self, iteration: int, group_index: int) -> float:
        p = self.params
        intervals = (iteration + 1) / p.lr_range_test_step_size
        if p.lr_range_test_staircase:
            intervals = math.floor(intervals)
        return p.lr_range_test_min_lr * (1 + p.lr_range_test_step_rate * intervals)


LR_SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
                "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_lr_schedule(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> _LRSchedule:
    params = config.params
    total, warmup = getattr(params, "total_num_steps", None), getattr(params, "warmup_num_steps", None)
    if isinstance(total, int) and isinstance(warmup, int) and warmup > total:
        logger.warning("scheduler %s: warmup_num_steps %d is longer than total_num_steps %d; the schedule runs as "
                       "DeepSpeed's does (still warming up at the end)", config.type, warmup, total)
    return LR_SCHEDULES[config.type](optimizer, params)
