"""Wiring an engine together: units, the parameter store, the optimizer, swap files, the runtime's hooks.

Every choice made here is made once, at start-up, from the config: where each shard
lives, which swap directory and I/O engine serve a path, how far gathers may run ahead,
and whether the step can overlap backward. A failed start-up releases what it took
(swap directory locks, threads) before it raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload import checkpointing
from offload.aio.base import IOEngine
from offload.aio.choose import engine_from_config
from offload.config import Config
from offload.config.fields import AUTO, resolved
from offload.config.leaf_module import LeafModuleConfig
from offload.engine import rates, step_schedule
from offload.engine.errors import EngineError
from offload.engine.memory import MemoryAccount
from offload.engine.refit import Refit
from offload.engine.step_schedule import StepSchedule
from offload.files.pretrained import PretrainedWeights
from offload.machine import prefetch
from offload.machine.accelerator import Accelerator
from offload.machine.cpus import default_threads, host_threads
from offload.observe.telemetry import Telemetry
from offload.optim.generic import GenericStep
from offload.optim.hyper import held_moments
from offload.optim.landing import GradientLanding, LandingPolicy
from offload.optim.lr_schedules import build_lr_schedule
from offload.optim.muon_pass import MuonPass
from offload.optim.shard_state import shard_segments
from offload.optim.sharded import AdamRule, ShardedAdam, StatePlan
from offload.store.budget import TierBudget
from offload.store.param_homes import describe_placement
from offload.store.param_store import ParamStore
from offload.store.param_swap import ParamSwap
from offload.store.placement import MachineOffer, Shards, StageLayout, StepAsks, describe_split, traffic
from offload.store.placement import plan as plan_placement
from offload.store.state_format import Master, from_config, mix_seed
from offload.store.step_cost import predict
from offload.store.sub_groups import sub_group_elements, unpipelined_note
from offload.store.swapdir import PREFIX, SwapDir, TierRoom
from offload.store.tier import Tier
from offload.zero.collectives import Group, broadcast
from offload.zero.init import give_memory, materialize_unit
from offload.zero.plan import plan_units
from offload.zero.runtime import Downstream, RuntimeSettings, ZeroRuntime
from offload.zero.stage import Stage
from offload.zero.unit import Unit

logger = logging.getLogger("offload.engine")


class SwapFiles:
    """This rank's locked swap directory and I/O engine per NVMe path (one per path, shared by the parameters
    and the optimizer state)."""

    def __init__(self, config: Config, rank: int) -> None:
        self.config = config
        self.rank = rank
        self._open: dict[str, tuple[SwapDir, IOEngine]] = {}

    def at(self, path: str | None) -> tuple[SwapDir, IOEngine]:
        assert path is not None  # the config check requires it for device nvme
        key = os.path.realpath(os.path.expanduser(path))
        if key not in self._open:
            swap_dir = SwapDir(path, name=f"{PREFIX}rank{self.rank}-{os.getpid()}-{time.time_ns()}")
            self._open[key] = swap_dir, engine_from_config(self.config, directory=str(path))  # one probe per path
        return self._open[key]

    def close(self) -> None:
        for swap_dir, io in self._open.values():
            io.close()
            swap_dir.close()
        self._open.clear()



def leaf_modules(leaf: LeafModuleConfig) -> tuple[str, ...]:
    """DeepSpeed's leaf modules as plan_units' atomic names: classes and module names as they are, suffixes marked."""
    return (*leaf.classes, *leaf.names, *(f"*{suffix}" for suffix in leaf.name_suffixes))

@dataclass
class Parts:
    """What an Engine is made of (see ``build``)."""

    units: list[Unit]
    params: ParamStore
    optimizer: ShardedAdam
    landing: GradientLanding  # the optimizer's: how gradients reach its shards
    runtime: ZeroRuntime
    activations: checkpointing.ActivationStore
    memory: MemoryAccount
    swaps: SwapFiles
    telemetry: Telemetry
    trained_names: dict[int, str]  # id(param) -> name, of every parameter an optimizer group holds
    schedule: StepSchedule  # how the step is scheduled against backward and the next forward
    lr_scheduler: Any
    refit: Refit  # auto's split, corrected once by the first step's measured peak


@dataclass
class OptimizerChoice:
    """What the script asked of the optimizer (offload/engine/initialize.py works it out): param groups with Adam's
    hyperparameters (none: the engine runs forward only), the Adam variant, and the LR scheduler or what builds
    one."""

    param_groups: list[dict[str, Any]]
    adamw_mode: bool = True
    bias_correction: bool = True
    lr_scheduler: Any = None
    update: str = "adam"  # or lion, adagrad (AdamHyper.rule), muon: the config's optimizer type; torch: ``generic``
    generic: GenericStep | None = None  # a script's torch optimizer, stepped by its own code (optim/generic.py)


def build(model: nn.Module, config: Config, choice: OptimizerChoice, *, group: Group, stage: Stage,
          accel: Accelerator, compute_dtype: torch.dtype, pretrained: PretrainedWeights | None = None) -> Parts:
    """Shard ``model`` over ``group`` and build everything the engine drives; ``pretrained``: its starting values
    come from a checkpoint (bound to ``model`` already) instead of the model's own."""
    zero = config.zero_optimization
    param_groups, lr_scheduler = choice.param_groups, choice.lr_scheduler
    partition = stage.partition(group)  # what a unit's flat buffer is split over
    group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
    if not group_of and param_groups:
        raise EngineError("the optimizer has no parameters: model_parameters (or the optimizer's param groups) "
                          "must include at least one parameter that requires grad")
    trained_names = {id(p): n for n, p in model.named_parameters() if id(p) in group_of}
    untracked = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if not param_groups:
        logger.info("no optimizer: the engine runs forward only, its %d parameters sharded and frozen "
                    "(ZeRO-Inference)", sum(1 for _ in model.parameters()))
    elif untracked:
        logger.warning("%d parameters require grad but are in no optimizer group and will not be updated: %s",
                       len(untracked), ", ".join(untracked[:5]) + (" ..." if len(untracked) > 5 else ""))

    plans = plan_units(model, config.offload.unit_bytes, compute_dtype.itemsize,
                       atomic=(*(config.offload.atomic_modules or ()),
                               *leaf_modules(config.zero_optimization.leaf_module)),
                       fold_below=int(resolved(config.zero_optimization.stage3_param_persistence_threshold)))
    telemetry = Telemetry()
    trained = {plan.index for plan in plans if any(id(s.param) in group_of for s in plan.slots)}
    parts = partition.world
    shard_sizes = [(p.index, Unit.padded_numel(p, parts) // parts) for p in plans]
    host_budget = TierBudget(Tier.HOST, config.offload.budgets.host)
    nvme_budget = TierBudget(Tier.NVME, config.offload.budgets.nvme)
    swaps = SwapFiles(config, group.rank)
    with contextlib.ExitStack() as undo:
        undo.callback(accel.close)
        undo.callback(swaps.close)
        whole_grads = 0 if stage.reduce_every_micro_batch else sum(
            s.numel for p in plans for s in p.slots if s.param.requires_grad)
        want = step_schedule.wanted(config, compute_dtype, choice.update)
        device_free = accel.free_bytes()
        ratio, stream = zero.offload_optimizer.ratio, config.offload.stream_state
        # auto's split by this machine's rates, where it has a split to choose (see [Note: rates measured at
        # start-up]): the state on the host (on NVMe the disk's rate is not measured: state first), on a device with
        # memory of its own, bounded by a budget or its size
        threads = host_threads(config)  # the host step's (offload.cpu_threads, or DeepSpeed's share of the cores)
        measured = (rates.measure(accel, threads, group)
                    if (ratio is AUTO or (stream is AUTO and not want.delayed))
                    and zero.offload_optimizer.device == "cpu" and not accel.host_is_device
                    and (config.offload.budgets.device is not None or device_free is not None) else None)
        placement = plan_placement(
            Shards(shard_sizes, trained, compute_dtype.itemsize, held_moments(choice.update, choice.generic)), config,
            StageLayout(parts=parts, resident_params=stage.resident_params, whole_grads=whole_grads),
            MachineOffer(discrete=not accel.host_is_device, device_free=device_free, rates=measured),
            StepAsks(speculation=want.speculation, delayed=want.delayed, not_streamed=want.not_streamed))
        nvme_params = placement.nvme_params
        if zero.offload_optimizer.device != "none" and placement.state_fits_device and ratio == 1.0:
            logger.info("rank %d: the whole optimizer state would fit on the device beside the rest, where it steps "
                        "faster than on the host: offload_optimizer.ratio \"auto\" keeps it there", group.rank)
        if placement.state_on_device or measured:
            priced = ""
            if measured:
                step = predict(traffic(placement, shard_sizes, compute_dtype.itemsize, config), measured)
                priced = (f"; at this machine's rates ({rates.describe(measured)}) offload's terms of a step: "
                          f"{step.terms_text(skip=('compute',))}")
            logger.info("rank %d: offload_optimizer.ratio %s keeps the optimizer state of %d of %d units on the "
                        "device; %s%s", group.rank, ratio, len(placement.state_on_device), len(trained),
                        describe_split(placement, shard_sizes), priced)
        if zero.offload_param.device == "nvme":
            logger.info("rank %d: %s", group.rank, describe_placement(shard_sizes, nvme_params, zero.offload_param))
        if stream is not AUTO and stream and accel.host_is_device:
            logger.warning("offload.stream_state %s has no effect on a CPU compute device, whose memory is the "
                           "host's: the host steps the offloaded state where it lies", stream)
        elif placement.streamed:
            logger.info("rank %d: offload.stream_state %s: the device steps the state of %d of %d units, streamed "
                        "over the bus (%s elements), beside the host's Adam on the rest", group.rank, stream,
                        len(placement.streamed), len(trained),
                        f"{sum(n for i, n in shard_sizes if i in placement.streamed):,}")
        placement.check()  # every budget, before anything is allocated
        unpipelined = unpipelined_note(placement.groups, sub_group_elements(zero))
        if unpipelined:
            logger.warning("rank %d: %s", group.rank, unpipelined)
        param_swap = ParamSwap(nvme_params, compute_dtype,
                               TierRoom(host_budget, nvme_budget, swaps.at(zero.offload_param.nvme_path),
                                        group.rank, zero.offload_param.buffer_count),
                               pin=accel.is_cuda, telemetry=telemetry, ledger=accel.ledger) if nvme_params else None
        params = ParamStore(accel, compute_dtype, placement.homes, swap=param_swap, host=host_budget,
                            telemetry=telemetry, keep_host_copies=any(g.tier is Tier.NVME for g in placement.groups))
        undo.callback(params.close)
        if zero.offload_optimizer.device != "none":  # the host steps state: its Adam tuned for this CPU
            tuned = prefetch.choose(config.offload.host_prefetch, threads or default_threads())
            logger.info("rank %d: %s", group.rank, tuned.describe())
        optimizer = ShardedAdam(
            param_groups, accel, [(i, n) for i, n in shard_sizes if i in trained], params=params,
            rule=AdamRule(choice.adamw_mode, choice.bias_correction, threads, choice.update),
            telemetry=telemetry,
            plan=StatePlan(device=zero.offload_optimizer.device, groups=placement.groups,
                           step_buffers=placement.step_buffers,
                           buffer_count=zero.offload_optimizer.buffer_count, host=host_budget, nvme=nvme_budget,
                           landing=LandingPolicy(placement.device_accumulated, placement.grads_read_where_they_land,
                                                 placement.device_grads_kept),
                           second_slots=step_schedule.second_slots(want, placement), delayed=want.delayed,
                           staged=placement.staged, stochastic=_stochastic_stream(config, group.rank),
                           muon=MuonPass(accel, partition.world, partition.pg, frozenset(
                               i for i, g in enumerate(param_groups) if g.get("use_muon")))
                           if choice.update == "muon" else None,
                           generic=choice.generic,
                           rank=group.rank, swap=(swaps.at(zero.offload_optimizer.nvme_path)
                                                  if zero.offload_optimizer.device == "nvme" else None)))
        started = time.perf_counter()
        units = [_shard_unit(model, plan, partition, group, stage, accel, compute_dtype, params, optimizer,
                             group_of if plan.index in trained else None, pretrained) for plan in plans]
        logger.info("rank %d: %d units (%s parameters) built, sharded and placed in %.1f s", group.rank, len(units),
                    f"{sum(p.numel for p in plans):,}", time.perf_counter() - started)
        if pretrained is not None:
            pretrained.load_buffers(model)
        _place_buffers(model, group, accel)
        memory = MemoryAccount(config, stage, compute_dtype, units, params, optimizer, host_budget, nvme_budget,
                               placement.gather_room)
        pre = float(group.world if config.prescale_gradients else config.gradient_predivide_factor)
        below = Downstream(params, optimizer.landing, optimizer)
        runtime = ZeroRuntime(model, units, group, accel, below, RuntimeSettings(
            limit=memory.live_limit(), persistence_threshold=int(resolved(zero.stage3_param_persistence_threshold)),
            persistence_cap=zero.stage3_model_persistence_threshold, grad_predivide=pre,
            prefetch_elements=int(resolved(zero.stage3_prefetch_bucket_size)), stage=stage,
            overlap_comm=zero.overlap_comm_effective), telemetry)
        undo.callback(runtime.close)
        activations = _activation_store(model, config, accel, host_budget, telemetry)
        undo.callback(checkpointing.reset)
        schedule = step_schedule.choose(config, compute_dtype, stage, optimizer, accel, want, placement)
        logger.info("ZeRO %s; optimizer step: %s", stage.describe(), schedule.describe())
        if config.scheduler is not None:
            if lr_scheduler is not None:
                raise EngineError("the config has a scheduler section and initialize() was given lr_scheduler; "
                                  "keep one of them")
            lr_scheduler = build_lr_schedule(optimizer, config.scheduler)
        elif callable(lr_scheduler):  # DeepSpeed's rule: a callable (a factory, or a scheduler class) gets the
            lr_scheduler = lr_scheduler(optimizer)  # optimizer; a scheduler object is not callable
        undo.pop_all()
    return Parts(units, params, optimizer, optimizer.landing, runtime, activations, memory, swaps, telemetry,
                 trained_names, schedule, lr_scheduler, Refit(config, accel, optimizer, group, want.delayed))


def _shard_unit(model: nn.Module, plan: Any, partition: Group, group: Group, stage: Stage, accel: Accelerator,
                dtype: torch.dtype, params: ParamStore, optimizer: ShardedAdam,
                group_of: dict[int, int] | None, pretrained: PretrainedWeights | None) -> Unit:
    """One unit from rank 0's values, or (``pretrained``) from a checkpoint that every rank reads its own part of: its
    shard into the parameter store, its master into the optimizer (``group_of`` given: the unit trains)."""
    fresh = pretrained is None or pretrained.needs_init(plan)
    if fresh:
        materialize_unit(model, plan)  # meta parameters (offload.zero.Init) get memory one unit at a time
        values = Unit.initial_values(plan, partition.world)
        broadcast_values = values.to(accel.device) if accel.is_cuda else values
        broadcast(broadcast_values, group)  # every rank starts from rank 0's weights, as DeepSpeed does
        values = broadcast_values.cpu() if accel.is_cuda else broadcast_values
        if pretrained is not None:  # a new head beside pretrained weights: those come from the checkpoint
            pretrained.fill_bound(plan, values)
    else:
        give_memory(plan)  # the checkpoint fills them: no initialiser runs
    unit = Unit(plan, partition, dtype, accel.device, params, resident=stage.resident_params,
                in_place=not stage.resident_params and partition.world == 1 and params.compute_reads_home(plan.index))
    start = 0
    if not fresh:  # see [Note: reading a checkpoint into shards]
        assert pretrained is not None  # fresh, without one
        start, stop = (0, unit.padded) if unit.keeps_full else (unit.shard_start, unit.shard_start + unit.shard_numel)
        values = pretrained.read_flat(plan, unit.padded, start, stop)
    # a 16+16 master's weights are its high halves, on every rank's copy of every part (see [Note: the weights are
    # the high half] in offload/store/optimizer_state.py); the master itself starts from ``values``
    weights = optimizer.state_format.weights_of(values) if group_of is not None else values
    host_copy = group_of is not None and optimizer.split.writes_host_copy(plan.index)
    unit.load_initial(weights, host_copy=host_copy, start=start)
    if group_of is not None:
        optimizer.add_shard(unit.index, unit.name, unit.shard_of(values, start),
                            shard_segments(unit.slots, unit.shard_start, unit.shard_numel, group_of))
        if optimizer.update.generic is not None:  # its parameters, one piece each for a torch optimizer's own step
            optimizer.update.generic.pieces[unit.index] = shard_segments(
                unit.slots, unit.shard_start, unit.shard_numel, group_of, per_param=True)
        if optimizer.update.muon is not None:  # its matrices, for Muon's first pass
            optimizer.update.muon.add(unit.index, unit.slots, unit.shard_start, unit.shard_numel, group_of)
    return unit


def _place_buffers(model: nn.Module, group: Group, accel: Accelerator) -> None:
    """Module buffers go to the compute device with rank 0's values (one copy per tensor, however many modules
    share it)."""
    moved: dict[int, torch.Tensor] = {}
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


def _activation_store(model: nn.Module, config: Config, accel: Accelerator, host_budget: TierBudget,
                      telemetry: Telemetry) -> checkpointing.ActivationStore:
    """Where checkpointed block inputs live (the activation_checkpointing section); wraps the model's blocks
    when offload.checkpoint_blocks is on."""
    ac = config.activation_checkpointing
    settings = checkpointing.CheckpointSettings(
        cpu_checkpointing=ac.cpu_checkpointing, partition_activations=ac.partition_activations,
        synchronize_checkpoint_boundary=ac.synchronize_checkpoint_boundary, profile=ac.profile)
    store = checkpointing.ActivationStore(accel, settings, host_budget=host_budget, telemetry=telemetry)
    checkpointing.configure(store=store)
    if ac.partition_activations and store.group is None:
        logger.warning("activation_checkpointing.partition_activations: no model-parallel group to partition "
                       "over (data-parallel ranks hold different activations), so each rank keeps its inputs "
                       "whole; offload.checkpointing.configure(mpu_) names one")
    if config.offload.checkpoint_blocks:
        count = checkpointing.wrap_blocks(model, store)
        logger.info("activation checkpointing: %d blocks%s", count,
                    ", saved inputs in host memory" if ac.cpu_checkpointing else "")
    return store


def _stochastic_stream(config: Config, rank: int) -> int | None:
    """This rank's stream of stochastic rounding, where the master is bf16 rounded so (state_format.py)."""
    if from_config(config).master is not Master.BF16_STOCHASTIC:
        return None
    return mix_seed(config.offload.optimizer_state.seed, rank)
