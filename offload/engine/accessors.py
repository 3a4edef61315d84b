"""What DeepSpeed's engine answers that training scripts read: the batch, clipping, the stage, the dtype, the rank,
the learning rate. A mixin of ``Engine`` (offload/engine/core.py), so that the engine's own room holds only what
drives a step; it reads the engine's fields and changes none of them."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from offload.machine.accelerator import Accelerator
from offload.config import Config
from offload.engine.accumulation import Accumulation
from offload.optim.loss_scale import LossScaler
from offload.optim.sharded import ShardedAdam
from offload.zero.collectives import Group
from offload.zero.runtime import ZeroRuntime
from offload.zero.stage import Stage

E = TypeVar("E", bound="DeepSpeedAccessors")


class DeepSpeedAccessors:
    """The accessors of DeepSpeed's engine, with its names and call shapes (methods where it has methods)."""

    # The engine's fields these read (set by Engine.__init__).
    config: Config
    accumulation: Accumulation
    stage: Stage
    compute_dtype: torch.dtype
    group: Group
    accel: Accelerator
    module: nn.Module
    optimizer: ShardedAdam
    loss_scaler: LossScaler
    runtime: ZeroRuntime
    last_grad_norm: float | None
    _clip: float

    # The batch as DeepSpeed's engine answers it: methods, as there.
    def gradient_accumulation_steps(self) -> int:
        return self.accumulation.steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu  # type: ignore[return-value]  # resolved: a number

    def train_batch_size(self) -> int:
        return self.config.train_batch_size  # type: ignore[return-value]  # resolved: a number

    def gradient_clipping(self) -> float:
        return self._clip

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm, before clipping (inf after an fp16 overflow)."""
        return self.last_grad_norm

    def zero_optimization_stage(self) -> int:
        return self.stage.number

    def bf16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    @property
    def global_rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world

    @property
    def device(self) -> torch.device:
        return self.accel.device

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends the accumulation (DeepSpeed's meaning): the one whose backward ran
        until step() is called, the coming one before its forward."""
        return self.accumulation.current_ends()

    @property
    def micro_steps(self) -> int:
        return self.accumulation.micro_steps

    def train(self: E, mode: bool = True) -> E:
        self.module.train(mode)
        return self

    def eval(self: E) -> E:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def peak_live_parameters(self) -> int:
        """The most parameter elements this rank held gathered at once (the engine's own accounting)."""
        return self.runtime.peak_live
