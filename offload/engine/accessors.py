"""What DeepSpeed's engine answers that training scripts read: the batch, clipping, the stage, the dtype, the rank,
the learning rate. A mixin of ``Engine`` (offload/engine/core.py), so that the engine's own room holds only what
drives a step; it reads the engine's fields and changes none of them."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from offload.comm import get_local_rank
from offload.config import Config
from offload.engine.accumulation import Accumulation
from offload.files.export import DTYPES
from offload.machine.accelerator import Accelerator
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
    step_applied: bool
    _clip: float

    def close(self) -> None: ...  # the engine's

    def __getattr__(self, name: str) -> Any:
        """What the engine does not have, its module's: DeepSpeed's engine hands a script's ``engine.forward_value``
        (a method other than ``forward``) to the model. Reached only where normal lookup found nothing."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__") and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module)")

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

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage 1 and above), as DeepSpeed's engine answers."""
        return self.stage.number > 0

    def get_mom(self) -> list[tuple[float, float]]:
        """Each param group's Adam betas (DeepSpeed's momentum accessor answers betas for Adam)."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last step() changed the weights: false between accumulation boundaries and after an fp16
        overflow skipped the step."""
        return self.step_applied

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks (offload has no model parallelism: every rank)."""
        return self.group.world

    @property
    def local_rank(self) -> int:
        """The device index scripts move batches to (``batch.to(engine.local_rank)``): the GPU this rank computes
        on, or the launcher's LOCAL_RANK (0 without one) on a CPU device."""
        if self.accel.device.type == "cuda" and self.accel.device.index is not None:
            return self.accel.device.index
        return get_local_rank()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the micro-batches a step (the micro-batch stays), as DeepSpeed's;
        at a step boundary, and between one and several micro-batches only as the engine was built for: with one,
        gradients are read where they land and no accumulators exist (ValueError otherwise, saying what to do)."""
        micro, world = self.train_micro_batch_size_per_gpu(), self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % (micro * world):
            raise ValueError(f"train batch size {train_batch_size} is not a multiple of the micro-batch ({micro}) "
                             f"times the data-parallel ranks ({world})")
        steps = train_batch_size // (micro * world)
        if self.accumulation.pending:
            raise ValueError("set_train_batch_size in the middle of an accumulation: call it after step()")
        if (steps == 1) != (self.accumulation.steps == 1):
            raise ValueError(f"set_train_batch_size({train_batch_size}) means {steps} micro-batches a step; this "
                             f"engine was built for {self.accumulation.steps}, and moving between one and several "
                             "changes where gradients are kept: start the engine with gradient_accumulation_steps "
                             "above 1 to vary it later")
        self.accumulation.steps = steps
        self.config.gradient_accumulation_steps = steps
        self.config.train_batch_size = train_batch_size

    def destroy(self) -> None:
        """DeepSpeed's name for releasing the engine: ``close()``."""
        self.close()

    def bf16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def bfloat16_enabled(self) -> bool:
        """DeepSpeed 0.19.8's name for ``bf16_enabled``."""
        return self.bf16_enabled()

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, data_types.grad_accum_dtype or else the model's), as DeepSpeed 0.19.8 answers, so a
        script that sizes its buffers by it does what it does under DeepSpeed; the engine's own accumulators are fp32
        whatever it answers (docs/deepspeed-api.md)."""
        named = self.config.data_types.grad_accum_dtype
        return self.compute_dtype, DTYPES[named] if named is not None else self.compute_dtype

    def steps_per_print(self) -> int | None:
        """The config's (None where it sets none, as DeepSpeed 0.19.8's default)."""
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned over the ranks (ZeRO stage 2 or 3)."""
        return self.stage.number >= 2

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param.device != "none"

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: offload is data-parallel only."""
        return 1

    @property
    def monitor(self) -> Monitor:
        """DeepSpeed's monitor: offload writes no monitor files (the config's monitor sections have no effect;
        engine.telemetry holds the per-phase times), so it is never enabled and takes events without writing."""
        return _MONITOR

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


class Monitor:
    """What DeepSpeed's ``engine.monitor`` answers a script: ``enabled`` and ``write_events``."""

    enabled = False

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Events a script logs through DeepSpeed's monitor: not written, as the config's monitor keys say."""


_MONITOR = Monitor()
