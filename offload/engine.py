"""The training engine: forward, backward and step of a ZeRO model (stages 0-3), in DeepSpeed's call shape.

``engine.backward(loss)`` scales the loss (by the fp16 loss scale and 1 /
gradient_accumulation_steps, as DeepSpeed does); the units' gradients are
reduce-scattered and streamed into the fp32 accumulators while backward runs.
``engine.step()`` applies the update only at an accumulation boundary: it waits for
the gradient stream, takes the global norm (one native read per shard, one
all-reduce), skips the step on an fp16 overflow, and otherwise runs Adam with the
unscale and the clip folded into one gradient factor. What the stage changes (what is
partitioned, when gradients are reduced, whether parameters stay gathered) is in
offload/zero/stage.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from offload.accelerator import Accelerator
from offload.config import Config, ConfigError
from offload.optim.cpu_adam import CPUAdam
from offload.optim.loss_scale import LossScaler
from offload import checkpoint, checkpointing
from offload.optim.schedules import build_schedule
from offload.aio.base import Engine as AioEngine
from offload.aio.select import engine_from_config
from offload.optim.sharded import ShardedAdam, StatePlan
from offload.store.budget import TierBudget
from offload.store.param_swap import ParamSwap, ParamSwapError, describe_placement, place_params
from offload.store.swapdir import PREFIX, SwapDir
from offload.host_malloc import set_mmap_threshold
from offload.telemetry import PhaseReport, Telemetry
from offload.weights_file import TensorSpec, stream_for
from offload.zero.collectives import Group, all_gather, all_reduce_sum, broadcast
from offload.zero.init import materialize_unit
from offload.zero.plan import plan_units
from offload.zero.runtime import LiveLimit, ZeroRuntime
from offload.zero.stage import Stage
from offload.zero.unit import Unit

logger = logging.getLogger("offload.engine")

class EngineError(RuntimeError):
    """The engine was used in a way it cannot honour; the message says what to do instead."""


class Engine:
    """A model sharded over the data-parallel group with its optimizer; see ``offload.initialize``."""

    def __init__(self, model: nn.Module, config: Config, param_groups: list[dict[str, Any]], adamw_mode: bool,
                 bias_correction: bool, group: Group, accel: Accelerator,
                 lr_scheduler: Any = None) -> None:
        zero = config.zero_optimization
        self.config = config
        self.group = group
        self.stage = Stage(zero.stage)
        self.partition = self.stage.partition(group)  # what a unit's flat buffer is split over
        self.accel = accel
        self.compute_dtype = torch.bfloat16 if config.bf16.enabled is True else (
            torch.float16 if config.fp16.enabled is True else torch.float32)
        self.gradient_accumulation_steps = int(config.gradient_accumulation_steps or 1)
        self.gradient_clipping = float(config.gradient_clipping or 0.0)
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.global_steps = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._pending_micro = 0
        self._closed = False
        self.last_grad_norm: float | None = None

        group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
        if not group_of:
            raise EngineError("the optimizer has no parameters: model_parameters (or the optimizer's param groups) "
                              "must include at least one parameter that requires grad")
        self._trained_names = {id(p): n for n, p in model.named_parameters() if id(p) in group_of}
        untracked = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
        if untracked:
            logger.warning("%d parameters require grad but are in no optimizer group and will not be updated: %s",
                           len(untracked), ", ".join(untracked[:5]) + (" ..." if len(untracked) > 5 else ""))

        plans = plan_units(model, config.offload.unit_bytes, self.compute_dtype.itemsize,
                           atomic=tuple(config.offload.atomic_modules or ()))
        self.telemetry = Telemetry()
        trained = {plan.index for plan in plans if any(id(s.param) in group_of for s in plan.slots)}
        parts = self.partition.world
        sizes = [(plan.index, Unit.padded_numel(plan, parts) // parts) for plan in plans if plan.index in trained]
        self.host_budget = TierBudget("host", config.offload.budgets.host)
        self.nvme_budget = TierBudget("nvme", config.offload.budgets.nvme)
        self._swaps: dict[str, tuple[SwapDir, AioEngine]] = {}
        self.param_swap: ParamSwap | None = None
        with contextlib.ExitStack() as undo:  # a failed start-up releases what it took (swap dir lock, threads)
            undo.callback(self.accel.close)
            undo.callback(self._close_swap)
            nvme_params = []
            if zero.offload_param.device == "nvme":
                shard_sizes = [(p.index, Unit.padded_numel(p, parts) // parts) for p in plans]
                nvme_params = place_params(shard_sizes, zero.offload_param)
                logger.info("rank %d: %s", group.rank, describe_placement(shard_sizes, nvme_params,
                                                                           zero.offload_param))
            if nvme_params:
                self.param_swap = ParamSwap(
                    nvme_params, self.compute_dtype, swap=self._open_swap(zero.offload_param.nvme_path),
                    rank=group.rank, host=self.host_budget, nvme=self.nvme_budget,
                    buffer_count=zero.offload_param.buffer_count, pin=accel.is_cuda, telemetry=self.telemetry)
            self.optimizer = ShardedAdam(
                param_groups, accel, sizes, compute_dtype=self.compute_dtype, adamw_mode=adamw_mode,
                bias_correction=bias_correction, threads=config.offload.cpu_threads, telemetry=self.telemetry,
                plan=StatePlan(device=zero.offload_optimizer.device, sub_group_size=zero.sub_group_size,
                               buffer_count=zero.offload_optimizer.buffer_count, host=self.host_budget,
                               nvme=self.nvme_budget, rank=group.rank,
                               swap=(self._open_swap(zero.offload_optimizer.nvme_path)
                                     if zero.offload_optimizer.device == "nvme" else None),
                               params_on_host=zero.offload_param.device != "none", param_swap=self.param_swap))
            self.units: list[Unit] = []
            for plan in plans:
                materialize_unit(model, plan)  # meta parameters (offload.zero.Init) get memory one unit at a time
                values = Unit.initial_values(plan, parts)
                broadcast_values = values.to(accel.device) if accel.is_cuda else values
                broadcast(broadcast_values, group)  # every rank starts from rank 0's weights, as DeepSpeed does
                values = broadcast_values.cpu() if accel.is_cuda else broadcast_values
                unit = Unit(plan, self.partition, self.compute_dtype, accel.device,
                            resident=self.stage.resident_params)
                master = values[unit.shard_start:unit.shard_start + unit.shard_numel]
                unit.load_initial(values)
                if plan.index in trained:
                    self.optimizer.add_unit(unit, master, group_of)
                if self.param_swap is not None and unit.index in self.param_swap.homes:
                    unit.offload_shard_to_nvme(self.param_swap)
                elif zero.offload_param.device != "none":
                    unit.offload_shard(self._param_home(unit))
                self.units.append(unit)
                del values, broadcast_values
            moved: dict[int, torch.Tensor] = {}  # one copy per buffer tensor, however many modules share it
            for prefix, owner in model.named_modules(remove_duplicate=False):
                for key, buf in list(owner._buffers.items()):
                    if buf is None:
                        continue
                    if buf.is_meta:
                        raise EngineError(f"buffer {prefix + '.' if prefix else ''}{key!r} is on the meta device, "
                                          "so its value is lost; build the model under offload.zero.Init("
                                          f"min_meta_numel=N) with N above its size ({buf.numel()} elements) so "
                                          "buffers are created for real")
                    if id(buf) not in moved:
                        moved[id(buf)] = buf.to(accel.device)
                        broadcast(moved[id(buf)], group)
                    owner._buffers[key] = moved[id(buf)]

            pre = float(group.world if config.prescale_gradients else config.gradient_predivide_factor)
            self._post_scale = pre / group.world  # gradients are averaged over the group, as DeepSpeed does
            self.runtime = ZeroRuntime(model, self.units, group, accel, limit=self._live_limit(),
                                       persistence_threshold=int(zero.stage3_param_persistence_threshold),
                                       grad_sink=lambda unit, shard, ready, keep: self.optimizer.accumulate(
                                           unit, shard, self._post_scale, ready, keep),
                                       grad_predivide=pre, telemetry=self.telemetry,
                                       prefetch_elements=int(zero.stage3_prefetch_bucket_size), stage=self.stage,
                                       overlap_comm=zero.overlap_comm_effective)
            undo.callback(self.runtime.close)
            self.activations = self._activation_store(model)
            undo.callback(checkpointing.reset)
            self.step_mode, self._overlap = self._choose_step_mode()
            logger.info("ZeRO %s; optimizer step: %s", self.stage.describe(), self.step_mode)
            self.module = model
            self._phases = PhaseReport(self.telemetry) if config.wall_clock_breakdown else None
            if config.scheduler is not None:
                if lr_scheduler is not None:
                    raise EngineError("the config has a scheduler section and initialize() was given lr_scheduler; "
                                      "keep one of them")
                lr_scheduler = build_schedule(self.optimizer, config.scheduler)
            elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                lr_scheduler = lr_scheduler(self.optimizer)
            self.lr_scheduler = lr_scheduler
            undo.pop_all()
        if config.dump_state:
            logger.info("engine state at start (dump_state), rank %d:\n%s\nstep mode: %s\nconfig: %s", group.rank,
                        self.memory_report(), self.step_mode, config.to_json(indent=None))

    def _choose_step_mode(self) -> tuple[str, bool]:
        """Overlap the step with backward where that is exact; otherwise say why not."""
        reasons = []
        if self.gradient_clipping > 0:
            reasons.append("gradient clipping needs the global norm first")
        if self.compute_dtype == torch.float16:
            reasons.append("fp16 needs the overflow check first")
        if not self.optimizer.offload:
            reasons.append("the optimizer state is on the compute device")
        if not self.config.zero_optimization.ignore_unused_parameters:
            reasons.append("ignore_unused_parameters false checks every gradient first")
        mode = self.config.offload.overlap_step
        if mode == "off":
            reasons.append("offload.overlap_step is off")
        elif mode == "auto" and self.accel.is_cuda:
            # Measured on an H100 (W=1, 156M-parameter bf16 GPT): the per-unit Adam on the host thread delays
            # the gradient drain that backward's end waits for, 0.72x the step after backward. "on" forces it.
            reasons.append("on a GPU 'auto' steps after backward, which measured faster there; set "
                           "offload.overlap_step to \"on\" to overlap anyway")
        if reasons:
            return "after backward (" + "; ".join(reasons) + ")", False
        return "overlapped with the last micro-batch's backward", True

    def _activation_store(self, model: nn.Module) -> checkpointing.ActivationStore:
        """Where checkpointed block inputs live (the activation_checkpointing section); wraps the model's blocks
        when offload.checkpoint_blocks is on."""
        ac = self.config.activation_checkpointing
        settings = checkpointing.CheckpointSettings(
            cpu_checkpointing=ac.cpu_checkpointing, partition_activations=ac.partition_activations,
            synchronize_checkpoint_boundary=ac.synchronize_checkpoint_boundary, profile=ac.profile)
        store = checkpointing.ActivationStore(self.accel, settings, host_budget=self.host_budget,
                                              telemetry=self.telemetry)
        checkpointing.configure(store=store)
        if ac.partition_activations and store.group is None:
            logger.warning("activation_checkpointing.partition_activations: no model-parallel group to partition "
                           "over (data-parallel ranks hold different activations), so each rank keeps its inputs "
                           "whole; offload.checkpointing.configure(mpu_) names one")
        if self.config.offload.checkpoint_blocks:
            count = checkpointing.wrap_blocks(model, store)
            logger.info("activation checkpointing: %d blocks%s", count,
                        ", saved inputs in host memory" if ac.cpu_checkpointing else "")
        return store

    def _param_home(self, unit: Unit) -> torch.Tensor:
        """Host memory for a unit's compute-dtype shard: the optimizer's copy of the new shard when the unit
        trains (the step writes it in place), else a buffer of its own, accounted in the host budget."""
        state = self.optimizer.shards.get(unit.index)
        if state is not None and state.out is not None:
            return state.out
        home, buf = self.accel.host_buffer(unit.shard_numel, self.compute_dtype)
        self.host_budget.take(buf.capacity, "frozen parameter shards")
        return home

    def _close_swap(self) -> None:
        if self.param_swap is not None:
            self.param_swap.close()
            self.param_swap = None
        for swap_dir, io in self._swaps.values():
            io.close()
            swap_dir.close()
        self._swaps.clear()

    def _open_swap(self, path: str | None) -> tuple[SwapDir, AioEngine]:
        """This rank's locked swap directory under ``path`` (one per path, shared by params and optimizer),
        and the I/O engine."""
        assert path is not None  # the config check requires it for device nvme
        key = os.path.realpath(os.path.expanduser(path))
        if key not in self._swaps:
            swap_dir = SwapDir(path, name=f"{PREFIX}rank{self.group.rank}-{os.getpid()}-{time.time_ns()}")
            self._swaps[key] = swap_dir, engine_from_config(self.config, directory=str(path))  # one probe per path
        return self._swaps[key]

    # ----------------------------------------------------------------- memory

    def _live_limit(self) -> LiveLimit:
        """stage3_max_live_parameters, or less where the device budget leaves less room after the shards."""
        max_live = LiveLimit(self.config.zero_optimization.stage3_max_live_parameters)
        budget = self.config.offload.budgets.device
        if budget is None:
            return max_live
        resident = self.device_resident_bytes()
        if self.stage.resident_params:
            if resident > budget:
                raise ConfigError("offload.budgets.device",
                                  f"{budget:,} bytes cannot hold this rank's resident state ({resident:,} bytes: "
                                  f"every parameter{' and the optimizer state' if not self.optimizer.offload else ''}"
                                  f", which ZeRO stage {self.stage.number} keeps on the device); raise it, offload "
                                  "the optimizer (stages 1-2), or use stage 3, which partitions the parameters")
            return max_live
        item = self.compute_dtype.itemsize
        largest = max(u.padded for u in self.units) * item
        if budget - resident < largest:
            raise ConfigError("offload.budgets.device",
                              f"{budget:,} bytes cannot hold this rank's resident state ({resident:,} bytes: "
                              f"shards{' and optimizer state' if not self.optimizer.offload else ''}) plus the "
                              f"largest unit gathered ({largest:,} bytes); raise it to at least "
                              f"{resident + largest:,}, "
                              "offload the optimizer (offload_optimizer.device: cpu), use more ranks, or lower "
                              "offload.unit_bytes")
        room = (budget - resident) // item
        if room >= max_live.elements:
            return max_live
        return LiveLimit(room, "offload.budgets.device (minus the resident shards, in elements)",
                         "Raise offload.budgets.device or lower offload.unit_bytes")

    def device_resident_bytes(self) -> int:
        """Bytes this rank keeps on the compute device between uses (see ``_device_parts``)."""
        return sum(self._device_parts().values())

    def _shard_bytes(self) -> int:
        """Compute-dtype parameter bytes on the device between uses (a resident unit's shard is part of it)."""
        return sum(u.full.numel() * u.full.element_size() if u.resident else u.shard.numel() * u.shard.element_size()
                   for u in self.units)

    def _device_parts(self) -> dict[str, int]:
        """What stays on the device between uses: parameters (stage 3: this rank's shards), the whole gradients
        stages 0-1 keep in .grad until the last micro-batch, and the optimizer state and fp32 gradient
        accumulators when the optimizer is not offloaded. ``offload estimate`` names the same parts."""
        parts = {"parameters" if self.stage.resident_params else "shards": self._shard_bytes()}
        if not self.stage.reduce_every_micro_batch:
            parts["gradients (whole, in .grad)"] = self.compute_dtype.itemsize * sum(
                s.numel for u in self.units for s in u.slots if s.param.requires_grad)
        if not self.optimizer.offload:
            parts["optimizer state"] = sum(g.nbytes for g in self.optimizer.store.groups)
            parts["gradient accumulators"] = sum(st.grad.numel() * 4 for st in self.optimizer.shards.values())
        return parts

    def memory_summary(self) -> dict[str, dict[str, int]]:
        """Bytes per tier on this rank, by what holds them, from the engine's own accounting."""
        item = self.compute_dtype.itemsize
        device = self._device_parts()
        if not self.stage.resident_params:
            device.update(gathered_now=self.runtime.live * item, gathered_peak=self.runtime.peak_live * item)
        if self.activations.saves:
            device.update(activations_now=self.activations.device_bytes,
                          activations_peak=self.activations.peak_device_bytes)
        budget = self.config.offload.budgets.device
        if budget is not None:
            device["budget"] = budget
        return {"device": device, "host": self.host_budget.summary(), "nvme": self.nvme_budget.summary()}

    def memory_report(self) -> str:
        lines = [f"memory on rank {self.group.rank} ({self.accel.device}):"]
        for tier, parts in self.memory_summary().items():
            if not any(parts.values()):
                continue
            lines.append(f"  {tier:7s}" + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items()))
        return "\n".join(lines)

    # ----------------------------------------------------------------- training loop

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; tensors in the inputs (also inside lists, tuples and dicts) that sit on
        another device are moved to the compute device first, as FSDP does, so a CPU batch just works."""
        self._check_open()
        self._repair_params()
        self.runtime.begin_iteration()
        cast = torch.float16 if self.compute_dtype == torch.float16 and self.config.fp16.auto_cast else None
        args, kwargs = _to_device((args, kwargs), self.accel.device, cast)
        try:
            with self.telemetry.span("forward"):
                return self.module(*args, **kwargs)
        except RuntimeError as e:
            if "storage of size 0" not in str(e) and "data is not allocated" not in str(e):
                raise
            raise EngineError(
                "a parameter was read while its unit was released: some module's forward reads a parameter of "
                "another module without calling that module (e.g. F.linear(x, self.child.weight)), or code reads "
                "parameters outside forward. Name the reading module's class in offload.atomic_modules so it is "
                "never split from its children, or call the child module instead. Units: "
                + ", ".join(u.name for u in self.units)) from e

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss`` scaled by loss_scale / gradient_accumulation_steps; returns ``loss``."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EngineError(f"backward() takes the scalar loss tensor, got "
                              f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise EngineError("the loss does not require grad: was the forward run under torch.no_grad(), or are "
                              "all parameters frozen?")
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps
        last_micro = self._pending_micro + 1 == self.gradient_accumulation_steps
        overlapped = self._overlap and last_micro
        self.runtime.reduce_grads = last_micro or self.stage.reduce_every_micro_batch
        if last_micro:
            self.optimizer.read_state_ahead()
        if overlapped:
            self.optimizer.begin_overlap(self.units)
        try:
            with self.telemetry.span("backward"):
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException as e:
            self.runtime.abort_backward()
            self.activations.discard()
            if not self.stage.reduce_every_micro_batch and self._pending_micro:
                # Stages 0-1 keep the earlier micro-batches' gradients in .grad, which the failed pass mixed with
                # its own: the whole accumulation is dropped, and the next backward starts a new one.
                logger.warning("backward failed: the %d earlier micro-batch(es) of this step are dropped too (ZeRO "
                               "stage %d accumulates them in .grad)", self._pending_micro, self.stage.number)
                self.zero_grad()
            if overlapped and self.optimizer.abandon_overlap():
                raise EngineError("backward failed while the optimizer step ran overlapped with it, and some shards "
                                  "were already updated, so this step is half applied; set offload.overlap_step to "
                                  "\"off\" to keep every step all-or-nothing") from e
            raise
        self._pending_micro += 1
        self.micro_steps += 1
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._pending_micro >= self.gradient_accumulation_steps

    def step(self) -> None:
        """Apply the update at an accumulation boundary (a no-op between micro-batches, as in DeepSpeed)."""
        self._check_open()
        if self._pending_micro == 0:
            raise EngineError("step() was called without a backward() since the last step; call "
                              "engine.backward(loss) first")
        if not self.is_gradient_accumulation_boundary():
            return
        if not self.config.zero_optimization.ignore_unused_parameters:
            self._check_every_parameter_got_a_gradient()
        self.runtime.got_grad.clear()
        self._pending_micro = 0
        self.activations.discard()  # inputs saved by a forward whose backward never ran
        with self.telemetry.span("grad_wait"):
            self.optimizer.drain()
        with self.telemetry.span("optimizer", "norm"):
            sum_sq, nonfinite = self.optimizer.grad_sq_norm()
            totals = torch.tensor([sum_sq, float(nonfinite)], dtype=torch.float64, device=self.accel.device)
            all_reduce_sum(totals, self.partition)  # stage 0: every rank holds the whole gradient already
            sum_sq, nonfinite = float(totals[0]), int(totals[1])
        scale = self.loss_scaler.scale
        overflow = nonfinite > 0 and self.compute_dtype == torch.float16
        self.global_steps += 1
        if overflow:
            self.skipped_steps += 1
            self.last_grad_norm = math.inf
            self.loss_scaler.update(overflow=True)
            logger.info("step %d: fp16 gradients overflowed; step skipped, loss scale now %g", self.global_steps,
                        self.loss_scaler.scale)
            self.optimizer.clear_grads()
            self._report_every_steps_per_print()
            return
        norm = math.sqrt(sum_sq) / scale if nonfinite == 0 else math.nan
        self.last_grad_norm = norm
        grad_scale = 1.0 / scale
        if self.gradient_clipping > 0 and math.isfinite(norm):
            grad_scale *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        self.runtime.reshard_all()
        behind: ParamSwapError | None = None
        try:
            with self.telemetry.span("optimizer", "adam"):
                self.optimizer.apply(self.units, grad_scale)
        except ParamSwapError as e:
            # The optimizer state moved on; only some 16-bit copies on NVMe are behind (stale), and they are
            # rewritten from the master weights before anything reads them: the step counts.
            behind = e
        except BaseException:
            # The state of the last completed step is intact (see the store's notes); so are the accumulated
            # gradients, so fixing the cause (a full disk, say) and calling step() again retries this step.
            self.global_steps -= 1
            self._pending_micro = self.gradient_accumulation_steps
            raise
        if self.stage.resident_params:
            self.runtime.spread_partitions()
        self.loss_scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._report_every_steps_per_print()
        if behind is not None:
            raise EngineError(f"step {self.global_steps} was applied, but writing new parameter shards to NVMe "
                              f"failed: {behind.strerror}. The master weights hold the step; the units left behind "
                              "are rewritten from them before the next forward, so fix the disk and go on (do not "
                              "repeat this step)") from behind
        self.runtime.read_ahead_first()

    def _check_every_parameter_got_a_gradient(self) -> None:
        """zero_optimization.ignore_unused_parameters false: a trainable parameter without a gradient this step is
        an error (before anything is applied), as in DeepSpeed."""
        unused = [name for key, name in self._trained_names.items() if key not in self.runtime.got_grad]
        if unused:
            self.zero_grad()
            raise EngineError(f"rank {self.group.rank}: {len(unused)} trainable parameter(s) received no gradient "
                              f"this step ({', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}), and "
                              "zero_optimization.ignore_unused_parameters is false; the step's gradients were "
                              "dropped. Set it to true (they then keep their values), freeze them "
                              "(requires_grad=False), or use them in the forward")

    def _report_every_steps_per_print(self) -> None:
        """wall_clock_breakdown and memory_breakdown: one log line each every steps_per_print steps."""
        every = self.config.steps_per_print
        if self.global_steps % every:
            return
        if self._phases is not None:
            logger.info("step %d, rank %d: %s", self.global_steps, self.group.rank, self._phases.line(every))
        if self.config.memory_breakdown:
            logger.info("step %d: %s", self.global_steps, self.memory_report())

    def _repair_params(self) -> None:
        """Rewrite NVMe parameter shards a failed write left behind their master weights (see
        [Note: parameter slots] in offload/store/param_swap.py)."""
        swap = self.param_swap
        if swap is None or not swap.stats.stale:
            return
        for unit in self.units:
            if unit.index in swap.stats.stale:
                master = self.optimizer.master_of(unit)
                swap.overwrite(unit.index, master.to(unit.dtype))
                logger.info("rewrote unit %s's parameter shard on NVMe from its master weights", unit.name)

    def zero_grad(self) -> None:
        """Discard gradients accumulated since the last step (a no-op right after one)."""
        self.optimizer.clear_grads()
        self.runtime.clear_param_grads()
        self.runtime.got_grad.clear()
        self._pending_micro = 0

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
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

    # ----------------------------------------------------------------- whole parameters

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Every unit gathered (full compute-dtype parameters readable on the module) inside the block.

        For inspection: it ignores stage3_max_live_parameters. Units start and end sharded, so the
        runtime's count of gathered elements is untouched.
        """
        self._check_open()
        self._repair_params()
        self.runtime.reshard_all()
        for unit in self.units:
            unit.unshard(self.accel, self.runtime.h2d)
        try:
            yield self.module
        finally:
            for unit in self.units:
                unit.reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict on the CPU with fp32 master values for trained parameters (every rank
        calls it: it all-gathers)."""
        self._check_open()
        self.optimizer.drain()
        values: dict[int, torch.Tensor] = {}
        for unit in self.units:
            shard = (self.optimizer.master_of(unit) if unit.index in self.optimizer.shards
                     else unit.authoritative_shard.float())
            full = torch.empty(unit.padded, dtype=torch.float32, device=self.accel.device)
            all_gather(full, shard.to(self.accel.device), unit.group)
            full = full.cpu()
            for s in unit.slots:
                values[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
        # keep_vars: the entries are the Parameter objects themselves (their storage may be empty now).
        return {key: values[id(t)] if id(t) in values else t.detach().cpu().clone()
                for key, t in self.module.state_dict(keep_vars=True).items()}

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True) -> str:
        """Write a checkpoint every rank's state can resume from (every rank calls it); returns its path.

        All or nothing: see offload/checkpoint.py. ``tag`` defaults to ``global_step<N>``.
        """
        self._check_open()
        if self._pending_micro:
            raise EngineError(f"save_checkpoint() between micro-batches ({self._pending_micro} of "
                              f"{self.gradient_accumulation_steps} accumulated) would lose their gradients; call it "
                              "after engine.step() at an accumulation boundary")
        self.optimizer.drain()
        self._repair_params()
        with self.telemetry.span("checkpoint", "save"):
            return str(checkpoint.save(self, save_dir, tag, client_state, save_latest))

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
        """Resume from ``load_dir``'s ``latest`` (or ``tag``): returns ``(path, client_state)``, as DeepSpeed's.

        Every file's checksum is verified on every rank before any state changes.
        """
        self._check_open()
        with self.telemetry.span("checkpoint", "load"):
            path, client_state = checkpoint.load(self, load_dir, tag, load_optimizer_states,
                                                 load_lr_scheduler_states, load_module_only)
        return str(path), client_state

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the gathered compute-dtype weights (a torch.save'd state_dict, or safetensors when the
        name ends in .safetensors); every rank calls it. As in DeepSpeed, only when the config's
        stage3_gather_16bit_weights_on_model_save is true (returns whether it saved)."""
        self._check_open()
        if not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model saved nothing: zero_optimization.stage3_gather_16bit_weights_on_model_"
                           "save is false (as DeepSpeed does); set it to true, or save_checkpoint and then "
                           "`offload export-weights`, which never gathers the whole model")
            return False
        self.optimizer.drain()
        self._repair_params()
        layout, buffers = checkpoint.state_dict_layout(self)
        by_unit: dict[int, list[tuple[str, Any]]] = {}
        for key, index, slot in layout:
            if not (exclude_frozen_parameters and not slot.param.requires_grad):
                by_unit.setdefault(index, []).append((key, slot))
        stream = None
        if self.group.rank == 0:  # streams unit by unit: rank 0 never holds the whole state dict
            specs = [TensorSpec(key, self.compute_dtype, tuple(slot.shape)) for unit in self.units
                     for key, slot in by_unit.get(unit.index, ())]
            specs += [TensorSpec(key, t.dtype, tuple(t.shape)) for key, t in buffers.items()]
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            written = {s.key for s in specs}
            order = [key for key in self.module.state_dict(keep_vars=True) if key in written]
            stream = stream_for(Path(save_dir) / save_filename, specs, metadata={"format": "pt"}, key_order=order)
        with stream if stream is not None else contextlib.nullcontext():
            for unit in self.units:  # one unit gathered at a time
                full = torch.empty(unit.padded, dtype=self.compute_dtype, device=self.accel.device)
                all_gather(full, unit.authoritative_shard.to(self.accel.device), unit.group)
                if stream is not None:
                    full = full.cpu()
                    for key, s in by_unit.get(unit.index, ()):
                        stream.write(key, full[s.offset:s.offset + s.numel].view(s.shape))
                del full
            if stream is not None:
                for key, t in buffers.items():
                    stream.write(key, t)
        if self.group.pg is not None:
            dist.barrier(group=self.group.pg)
        return True

    def set_unit_values(self, unit: Unit, values: torch.Tensor) -> None:
        """Make ``values`` (this rank's shard, any float dtype) the unit's compute-dtype parameters."""
        state = self.optimizer.shards.get(unit.index)
        out = state.out if state is not None else None  # the step's host copy (for trained units, the home too)
        if out is not None:
            out.copy_(values)
        if unit.swap is not None:
            unit.swap.overwrite(unit.index, values.to(unit.dtype))
        elif unit.home is not None:
            if unit.home is not out:
                unit.home.copy_(values)
        else:
            unit.shard.copy_(values.to(unit.shard.device), non_blocking=False)
            unit.ready = None

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Remove every hook and free every buffer; the engine cannot be used after."""
        if self._closed:
            return
        self.runtime.close()
        self.activations.close()
        checkpointing.reset()
        self.optimizer.close()
        self._close_swap()
        for unit in self.units:
            unit.reshard()
            unit.shard = torch.empty(0, dtype=unit.dtype, device=unit.shard.device)
            unit.home = unit.swap = None
        self.accel.close()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("this engine was closed; create a new one with offload.initialize")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- initialize


def initialize(model: nn.Module, model_parameters: Iterable[Any] | None = None,
               config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
               optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
               training_data: Any = None, device: torch.device | str | None = None, config_params: Any = None,
               args: Any = None, dist_init_required: bool | None = None, collate_fn: Callable[..., Any] | None = None,
               ) -> tuple[Engine, ShardedAdam, Any, Any]:
    """``engine, optimizer, dataloader, lr_scheduler``, as ``deepspeed.initialize`` returns them.

    Joins (or starts, under torchrun) the default process group; with no launcher it
    runs as one rank. ``config`` (or DeepSpeed's ``config_params``) is a path, a
    JSON string, a dict or a Config.
    """
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError("", "initialize needs a config (a path, a JSON string, a dict or a Config)")
    if not isinstance(model, nn.Module):
        raise EngineError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loaded = Config.load(config)
    if loaded.offload.host_malloc.mmap_threshold is not None:
        set_mmap_threshold(loaded.offload.host_malloc.mmap_threshold)  # before the engine allocates
    group = _join_group(dist_init_required)
    accel = Accelerator(device if device is not None else _default_device())
    if accel.is_cuda:
        torch.cuda.set_device(accel.device)  # NCCL and the caching allocator use the current device
    cfg = loaded.resolve(world_size=group.world, hidden_size=hidden_size_of(model))
    _check_supported(cfg)
    if cfg.no_effect and group.rank == 0:
        logger.warning("config: %d key(s) set here have no effect in offload: %s", len(cfg.no_effect),
                       "; ".join(cfg.no_effect))
    param_groups, adamw_mode, bias_correction = _optimizer_groups(model, model_parameters, cfg, optimizer)
    engine = Engine(model, cfg, param_groups, adamw_mode, bias_correction, group, accel, lr_scheduler)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=group.world, rank=group.rank) \
            if group.world > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             sampler=sampler, shuffle=sampler is None, collate_fn=collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def hidden_size_of(model: nn.Module) -> int | None:
    """The model width that sizes "auto" buckets, as Hugging Face's integration reads it (None if unknown)."""
    return getattr(getattr(model, "config", None), "hidden_size", None) or getattr(model, "hidden_size", None)


def _to_device(value: Any, device: torch.device, cast: torch.dtype | None = None) -> Any:
    """``value`` with its tensors on ``device``; with ``cast`` (fp16.auto_cast) floating ones also in that dtype."""
    if isinstance(value, torch.Tensor):
        dtype = cast if cast is not None and value.is_floating_point() else value.dtype
        return value if value.device == device and value.dtype == dtype else \
            value.to(device, dtype, non_blocking=True)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device, cast)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_device(v, device, cast) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, cast) for v in value)
    return value


def _join_group(dist_init_required: bool | None) -> Group:
    if dist.is_available() and not dist.is_initialized() and dist_init_required is not False:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 or dist_init_required:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
    return Group.current()


def _default_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    if index >= torch.cuda.device_count():
        raise EngineError(f"LOCAL_RANK={index} but this machine shows {torch.cuda.device_count()} GPU(s): launch one "
                          "process per GPU (torchrun --nproc-per-node), or pass device= to initialize")
    return torch.device("cuda", index)


def _check_supported(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if zero.offload_param.device != "none" and zero.offload_optimizer.device == "none":
        raise ConfigError("zero_optimization.offload_param.device",
                          f"{zero.offload_param.device!r} needs the optimizer offloaded too: the step writes the new "
                          "parameter shards into their host home; set offload_optimizer.device to cpu or nvme")


def _optimizer_groups(model: nn.Module, model_parameters: Iterable[Any] | None, cfg: Config,
                      client: torch.optim.Optimizer | None) -> tuple[list[dict[str, Any]], bool, bool]:
    """Param groups with Adam hyperparameters, and (adamw_mode, bias_correction)."""
    if client is not None and cfg.optimizer is not None:
        raise EngineError("the config has an optimizer section and initialize() was given optimizer=; keep one")
    if client is not None:
        if callable(client) and not isinstance(client, torch.optim.Optimizer):
            params = list(model_parameters) if model_parameters is not None else list(model.parameters())
            client = client(params)
        if isinstance(client, CPUAdam):
            adamw, bias = client.adamw_mode, client.bias_correction
        elif isinstance(client, (torch.optim.AdamW, torch.optim.Adam)):
            if any(g.get("amsgrad") for g in client.param_groups):
                raise EngineError("amsgrad is not supported; use amsgrad=False")
            adamw, bias = isinstance(client, torch.optim.AdamW), True
        else:
            raise EngineError(f"optimizer {type(client).__name__} is not supported: offload runs Adam/AdamW "
                              "(pass torch.optim.Adam/AdamW, offload.optim.CPUAdam, or an optimizer section)")
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                  for g in client.param_groups]
        return _trainable(groups), adamw, bias
    if cfg.optimizer is None:
        raise ConfigError("optimizer", "no optimizer: add an optimizer section (type Adam or AdamW) to the config "
                                       "or pass optimizer= to initialize")
    p = cfg.optimizer.params
    hyper = {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay}
    source = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if source and isinstance(source[0], dict):
        groups = [{**hyper, **g, "params": list(g["params"])} for g in source]
    else:
        groups = [{**hyper, "params": source}]
    adamw = cfg.optimizer.type == "AdamW" or p.adam_w_mode
    return _trainable(groups), adamw, p.bias_correction


def _trainable(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    if not any(g["params"] for g in out):
        raise EngineError("the model has no trainable parameters (none of model_parameters requires grad); "
                          "unfreeze some or pass the ones to train")
    return out
