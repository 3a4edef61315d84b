"""``offload.initialize``: DeepSpeed's entry point, from its loose arguments to an Engine.

Everything here is argument handling: which config (a path, JSON, a dict, DeepSpeed's
``config_params`` or ``args.deepspeed_config``), which process group and device, and which
Adam hyperparameters (an optimizer section, or a torch/offload optimizer given by the
caller). What the engine is made of is decided in offload/engine/build.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from offload.config import Config, ConfigError
from offload.config.fields import resolved
from offload.config.sections import RULE_NAMES
from offload.engine.build import OptimizerChoice
from offload.engine.core import Engine
from offload.engine.errors import EngineError
from offload.engine.muon_groups import check_muon, muon_halves
from offload.files.pretrained import PretrainedWeights
from offload.machine.accelerator import Accelerator, finish_streams
from offload.machine.backward_context import hold_on_main_thread
from offload.machine.host_malloc import set_mmap_threshold
from offload.optim import generic
from offload.optim.cpu_adam import CPUAdam
from offload.optim.one_state import ONE_STATE_RULES, CPUAdagrad, CPULion
from offload.optim.sharded import ShardedAdam
from offload.store import state_format
from offload.zero.collectives import Group
from offload.zero.unit import wait_in_flight

logger = logging.getLogger("offload.engine")


def initialize(model: nn.Module, model_parameters: Iterable[Any] | None = None,
               config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
               optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
               training_data: Any = None, device: torch.device | str | None = None, config_params: Any = None,
               args: Any = None, dist_init_required: bool | None = None, collate_fn: Callable[..., Any] | None = None,
               weights: str | os.PathLike[str] | PretrainedWeights | None = None,
               ) -> tuple[Engine, ShardedAdam | None, Any, Any]:
    """``engine, optimizer, dataloader, lr_scheduler``, as ``deepspeed.initialize`` returns them.

    Joins (or starts, under torchrun) the default process group; with no launcher it
    runs as one rank. ``config`` (or DeepSpeed's ``config_params``) is a path, a
    JSON string, a dict or a Config. ``weights``: a local Hugging Face checkpoint
    directory whose values the model starts from, read into the shards unit by unit
    (build the model under ``offload.zero.Init`` so it is never whole in memory;
    ``offload.hf.from_pretrained`` does both).
    """
    if config is None:
        config = config_params if config_params is not None else (getattr(args, "deepspeed_config", None)
                                                                  or getattr(args, "deepscale_config", None))
    if config is None:
        raise ConfigError("", "initialize needs a config (a path, a JSON string, a dict or a Config)")
    if not isinstance(model, nn.Module):
        raise EngineError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if weights is not None and not isinstance(weights, PretrainedWeights):
        weights = PretrainedWeights(weights)
    if weights is not None:
        weights.bind(model)  # every key checked before anything is allocated
    loaded = Config.load(config)
    if loaded.offload.host_malloc.mmap_threshold is not None:
        set_mmap_threshold(loaded.offload.host_malloc.mmap_threshold)  # before the engine allocates
    group = _join_group(dist_init_required)
    accel = Accelerator(device if device is not None else _default_device())
    if accel.is_cuda:
        torch.cuda.set_device(accel.device)  # NCCL and the caching allocator use the current device
    cfg = loaded.resolve(world_size=group.world, hidden_size=hidden_size_of(model))
    inference = optimizer is None and cfg.optimizer is None  # ZeRO-Inference: forward only (see _optimizer_groups)
    _check_supported(cfg, inference)
    if cfg.no_effect and group.rank == 0:
        logger.warning("config: %d key(s) set here have no effect in offload: %s", len(cfg.no_effect),
                       "; ".join(cfg.no_effect))
    choice = _optimizer_choice(model, model_parameters, cfg, optimizer)
    _check_state_format(cfg, choice.update)
    choice.lr_scheduler = lr_scheduler
    engine = Engine(model, cfg, choice, group, accel, weights)
    if isinstance(optimizer, torch.optim.Optimizer):
        _share_groups(optimizer, engine.optimizer)
    loader = None
    if training_data is not None:
        # DeepSpeed's loader: a DistributedSampler over the data-parallel ranks at every world size (shuffled from
        # its seed 0, not the global RNG), so a script's batches come in the order they did under DeepSpeed.
        sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
            training_data, num_replicas=group.world, rank=group.rank)
        loader = torch.utils.data.DataLoader(training_data, batch_size=resolved(cfg.train_micro_batch_size_per_gpu),
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, None if inference else engine.optimizer, loader, engine.lr_scheduler


def hidden_size_of(model: nn.Module) -> int | None:
    """The model width that sizes "auto" buckets, as Hugging Face's integration reads it (None if unknown)."""
    return getattr(getattr(model, "config", None), "hidden_size", None) or getattr(model, "hidden_size", None)


def _join_group(dist_init_required: bool | None) -> Group:
    if dist.is_available() and not dist.is_initialized() and dist_init_required is not False:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 or dist_init_required:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
    group = Group.current()
    if group.world > 1:
        _end_group_at_exit()
    return group


_ENDING: list[bool] = []  # whether this process has registered _end_group once


def _end_group_at_exit() -> None:
    """[Note: the group at exit] A script that ends without ``destroy_process_group()`` (most do: the Trainer and
    accelerate leave the group to the process's end) can have gloo's worker threads release Python objects while
    Python finalizes; that takes the GIL of a finalizing interpreter and the rank aborts ("terminate called without
    an active exception"). The objects are the context each backward stashes in the TLS that its collectives
    capture: the main thread keeps its last one ([Note: the backward's context] in
    offload/machine/backward_context.py), so at exit no gloo worker is the last holder of one. And at exit, while
    Python is whole, our streams finish their work, the all-gathers still in flight (a prefetch the script never
    used) are waited for, and then a gloo group still alive is destroyed (registered after torch's and the
    launcher's handlers, so it runs before them): none of offload's work is left for a gloo thread to finish.
    Destroying the group unregisters it but does not end its threads (gloo's shutdown is a no-op in torch 2.13;
    they end with the C++ group, when its last Python reference dies in module teardown). NCCL's group is left to
    the script: its destroy can block on a peer, and its end at exit is only a warning. Last, the main thread
    sleeps a moment (``_SETTLE_S``) with the GIL released, while Python is still whole: a gloo worker drops a
    finished work a fraction of a millisecond after its wait returns, and whatever Python object that work held
    last (a tensor whose Python side is gone, say) is then released on the worker with a GIL it can still take.
    The backward's context was the one such object seen in a core; the sleep covers the others (an abort was seen
    once more, in the accelerate two-process test, after datasets and pyarrow came into its processes)."""
    hold_on_main_thread()
    if not _ENDING:
        _ENDING.append(True)
        atexit.register(_end_group)


_SETTLE_S = 0.05  # the workers drop finished works within a millisecond; fifty leaves a loaded machine room


def _end_group() -> None:
    finish_streams()
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        wait_in_flight()
        dist.destroy_process_group()
    time.sleep(_SETTLE_S)  # see [Note: the group at exit]


def _default_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    if index >= torch.cuda.device_count():
        raise EngineError(f"LOCAL_RANK={index} but this machine shows {torch.cuda.device_count()} GPU(s): launch one "
                          "process per GPU (torchrun --nproc-per-node), or pass device= to initialize")
    return torch.device("cuda", index)


def _check_supported(cfg: Config, inference: bool) -> None:
    zero = cfg.zero_optimization
    if inference and cfg.scheduler is not None:
        raise ConfigError("scheduler", "there is no optimizer to schedule (no optimizer section, no optimizer=): "
                                       "the engine runs forward only; add an optimizer section to train, or drop "
                                       "the scheduler")
    if zero.offload_param.device != "none" and zero.offload_optimizer.device == "none" and not inference:
        raise ConfigError("zero_optimization.offload_param.device",
                          f"{zero.offload_param.device!r} needs the optimizer offloaded too: the step writes the new "
                          "parameter shards into their host home; set offload_optimizer.device to cpu or nvme")


def _check_state_format(cfg: Config, rule: str) -> None:
    """Adam, Lion and Adagrad take every state format (the native kernels hold each); Muon and a torch optimizer's
    own code step float32 state."""
    if rule not in ("adam", *ONE_STATE_RULES):
        fmt = state_format.from_config(cfg)
        if fmt.master is not state_format.Master.FP32 or fmt.moments != torch.float32:
            raise ConfigError("offload.optimizer_state", f"{RULE_NAMES[rule]}'s state is float32 here (its master "
                                                         "and its buffers): leave the state format fp32")


def _optimizer_choice(model: nn.Module, model_parameters: Iterable[Any] | None, cfg: Config,
                      client: torch.optim.Optimizer | None) -> OptimizerChoice:
    """Param groups with the update's hyperparameters, the Adam variant and the update (the scheduler is the
    caller's)."""
    if client is not None and cfg.optimizer is not None:
        raise EngineError("the config has an optimizer section and initialize() was given optimizer=; keep one")
    if client is not None:
        if callable(client) and not isinstance(client, torch.optim.Optimizer):
            params = list(model_parameters) if model_parameters is not None else list(model.parameters())
            client = client(params)
        if isinstance(client, (CPULion, CPUAdagrad, torch.optim.Adagrad)):
            return _one_state_client(client)
        if isinstance(client, getattr(torch.optim, "Muon", ())):  # torch >= 2.9's
            check_muon(cfg)
            groups = [{**g, "params": list(g["params"]), "use_muon": True} for g in client.param_groups]
            return OptimizerChoice(_trainable(groups), update="muon")
        if isinstance(client, CPUAdam):  # its modes are per group; the engine steps every group alike
            modes = {(bool(g["adamw_mode"]), bool(g["bias_correction"])) for g in client.param_groups}
            if len(modes) > 1:
                raise EngineError("the CPUAdam passed has param groups that differ in adamw_mode or "
                                  "bias_correction; offload steps every group with one of each: give every group "
                                  "the same")
            adamw, bias = modes.pop()
        elif isinstance(client, (torch.optim.AdamW, torch.optim.Adam)):
            if any(g.get("amsgrad") for g in client.param_groups):
                raise EngineError("amsgrad is not supported; use amsgrad=False")
            # torch's Adam with decoupled weight decay is AdamW (DeepSpeed's FusedAdam in its default mode)
            adamw = isinstance(client, torch.optim.AdamW) or any(g.get("decoupled_weight_decay")
                                                                 for g in client.param_groups)
            bias = True
        else:
            return _torch_client(client)
        groups = [{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                  for g in client.param_groups]
        return OptimizerChoice(_trainable(groups), adamw, bias)
    if cfg.optimizer is None:  # DeepSpeed's engine without an optimizer: ZeRO-Inference, forward only
        return OptimizerChoice([])
    source: list[Any] = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if cfg.optimizer.rule == "torch":  # a torch.optim type by name, as DeepSpeed takes it: its own class
        try:
            client = getattr(torch.optim, cfg.optimizer.type)(source, **cfg.optimizer.params)
        except (TypeError, ValueError) as e:
            raise ConfigError("optimizer.params", f"torch.optim.{cfg.optimizer.type} does not take these: {e}; "
                              "give it the keyword arguments its constructor takes") from None
        return _torch_client(client)
    p = cfg.optimizer.params
    hyper = {"lr": p.lr, "betas": tuple(resolved(p.betas)), "eps": p.eps, "weight_decay": p.weight_decay}
    if cfg.optimizer.rule == "muon":
        check_muon(cfg)
        return OptimizerChoice(_trainable(muon_halves(model, source, p)), p.adam_w_mode, p.bias_correction,
                               update="muon")
    if source and isinstance(source[0], dict):
        groups = [{**hyper, **g, "params": list(g["params"])} for g in source]
    else:
        groups = [{**hyper, "params": source}]
    adamw = cfg.optimizer.type == "AdamW" or p.adam_w_mode
    return OptimizerChoice(_trainable(groups), adamw, p.bias_correction, update=cfg.optimizer.rule)


# what a client Lion's or Adagrad's groups must leave at torch's defaults: the engine's update has no such term
_ONE_STATE_DEFAULTS = {"lr_decay": 0.0, "initial_accumulator_value": 0.0, "maximize": False, "differentiable": False}


def _one_state_client(client: torch.optim.Optimizer) -> OptimizerChoice:
    """A client Lion or Adagrad object (offload's, DeepSpeed's names, torch.optim.Adagrad): the engine runs the
    same update as the config's type, from the object's groups; what it has no term for is refused by name."""
    rule = "lion" if isinstance(client, CPULion) else "adagrad"
    name = type(client).__name__
    for i, g in enumerate(client.param_groups):
        for key, default in _ONE_STATE_DEFAULTS.items():
            if g.get(key, default) != default:
                raise EngineError(f"{name}'s param_groups[{i}] sets {key}={g[key]!r}, which offload's {rule} update "
                                  f"does not take (DeepSpeed's has none either): leave it at {default!r}")
    # the fields the update reads; the other rule's (Lion: eps, Adagrad: betas) are unused and left at Adam's
    groups = [{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"],
               "betas": tuple(g.get("betas", (0.9, 0.999))), "eps": g.get("eps", 1e-8)} for g in client.param_groups]
    return OptimizerChoice(_trainable(groups), update=rule)


def _torch_client(client: torch.optim.Optimizer) -> OptimizerChoice:
    """Another torch optimizer: stepped by its own code on each shard's segments where its update is elementwise
    (see [Note: a torch optimizer's own step] in offload/optim/generic.py), refused by name where it is not."""
    cls, names = type(client), tuple(client.defaults)
    layouts = []
    for i, g in enumerate(client.param_groups):
        try:
            layouts.append(generic.probe(cls, generic.hyperparameters(g, names), f"{cls.__name__}'s "
                                                                                  f"param_groups[{i}]"))
        except ValueError as e:
            raise EngineError(f"{e} (offload runs Adam/AdamW, Lion, Adagrad and Muon with its own kernels: pass "
                              "torch.optim.Adam/AdamW/Adagrad, offload.optim.CPUAdam, DeepSpeedCPULion/"
                              "DeepSpeedCPUAdagrad, or an optimizer section; Muon, with AdamW on what it does not "
                              "take, by the section's type \"Muon\")") from None
    logger.warning("offload steps %s through torch's own single-tensor code on each shard: exact, "
                   "and slower than its native Adam, Lion and Adagrad kernels", cls.__name__)
    groups = [{**g, "params": list(g["params"])} for g in client.param_groups]
    return OptimizerChoice(_trainable(groups), update="torch", generic=generic.GenericStep(cls, names, layouts))


def _share_groups(client: torch.optim.Optimizer, ours: ShardedAdam) -> None:
    """The script's optimizer object becomes a view of the engine's param groups. DeepSpeed steps the client's
    optimizer itself, so a schedule built on it, or an lr set in its groups, reaches the step; here the engine
    steps its own groups, which the client's must then be."""
    if len(client.param_groups) != len(ours.param_groups):
        raise EngineError(f"the optimizer passed has {len(client.param_groups)} param groups but the engine made "
                          f"{len(ours.param_groups)}; pass an optimizer whose groups hold only this model's "
                          "parameters")
    for theirs, mine in zip(client.param_groups, ours.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k not in mine})  # a schedule's keys (initial_lr, ...)
    client.param_groups = ours.param_groups


def _trainable(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    if not any(g["params"] for g in out):
        raise EngineError("the model has no trainable parameters (none of model_parameters requires grad); "
                          "unfreeze some or pass the ones to train")
    return out
