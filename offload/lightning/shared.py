"""What the Trainer's strategy and Fabric's share: DeepSpeedStrategy's arguments taken as Lightning's class takes
them, its registry names with ``offload`` for ``deepspeed``, activation checkpointing from the config, and the
live engine of a module.

Both of Lightning's ``DeepSpeedStrategy`` classes (``lightning.pytorch`` and ``lightning.fabric``) take the same
arguments but one (``precision_plugin`` against ``precision``) and build the same config; their ``__init__`` stops
where DeepSpeed is not installed, so the offload strategies bind the arguments against its signature here (its
defaults stay Lightning's) and set what it sets.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from offload import checkpointing
from offload.zero.plan import engine_of

# DeepSpeedStrategy's arguments that go into the zero_optimization section of the config it builds by default
ZERO_ARGUMENTS = ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
                  "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")
# the arguments DeepSpeedStrategy.__init__ keeps as attributes, read later by the methods it shares with ours
KEPT_ARGUMENTS = ("remote_device", "load_full_weights", "exclude_frozen_parameters", "loss_scale",
                  "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def bind_arguments(deepspeed_class: Any, strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> dict[str, Any]:
    """``deepspeed_class.__init__``'s arguments as given, its defaults filled in; what offload cannot honour
    refused by name."""
    bound = inspect.signature(deepspeed_class.__init__).bind(strategy, *args, **kwargs)
    explicit = set(bound.arguments)
    bound.apply_defaults()
    given = bound.arguments
    if "sub_group_size" not in explicit:
        # Lightning's default (1e12: the whole state one sub-group) would make the NVMe step's buffers as large as
        # the state; offload's auto keeps them a few units' ([Note: the sub-group's default size])
        given["sub_group_size"] = "auto"
    if given["exclude_frozen_parameters"]:
        raise ValueError("exclude_frozen_parameters=True: offload's checkpoint holds every parameter, frozen "
                         "ones too, and loads every key; leave it False")
    return given


def adopt_arguments(deepspeed_class: Any, strategy: Any, given: dict[str, Any]) -> None:
    """What ``deepspeed_class.__init__`` sets after its parent's ``__init__``: the config (``config=``, the
    environment variable, or the default one the keyword arguments build) and the kept arguments."""
    strategy._timeout = given["timeout"]
    strategy.config = strategy._load_config(given["config"])
    if strategy.config is None:
        builder = inspect.signature(deepspeed_class._create_default_config).parameters.items()
        names = [name for name, p in builder if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
        strategy.config = strategy._create_default_config(**{k: given[k] for k in names},
                                                          **{k: given[k] for k in ZERO_ARGUMENTS})
    strategy._config_initialized = False
    for name in KEPT_ARGUMENTS:
        setattr(strategy, name, given[name])


def register_twins(registry: _StrategyRegistry, deepspeed_class: type, offload_class: type) -> None:
    """Every name ``registry`` gives ``deepspeed_class`` (``deepspeed``, ``deepspeed_stage_3_offload`` ...) again
    with ``offload`` for ``deepspeed``, the same arguments, for ``offload_class``."""
    for name, entry in list(registry.items()):
        if entry["strategy"] is deepspeed_class and name.startswith("deepspeed"):
            registry.register("offload" + name[len("deepspeed"):], offload_class,
                              description=entry["description"].replace("DeepSpeed", "offload (as DeepSpeed's)", 1),
                              override=True, **entry["init_params"])


def configure_activation_checkpointing(config: dict[str, Any]) -> None:
    """The config's ``activation_checkpointing`` section, as Lightning's strategies hand it to DeepSpeed's."""
    section = config.get("activation_checkpointing")
    if section:
        checkpointing.configure(mpu_=None, partition_activations=section.get("partition_activations"),
                                contiguous_checkpointing=section.get("contiguous_memory_optimization"),
                                checkpoint_in_cpu=section.get("cpu_checkpointing"), profile=section.get("profile"))


def engine_of_module(model: nn.Module) -> Any:
    """The live offload engine whose shards ``model``'s parameters are (None: none)."""
    return next((e for e in map(engine_of, model.parameters()) if e is not None), None)


def refuse_a_second_engine(model: nn.Module, what: str) -> None:
    if engine_of_module(model) is not None:
        raise MisconfigurationException(
            f"this module is already trained by an offload engine (a second {what} of it): its parameters are that "
            "engine's shards. Set it up once per process (resume a later run from a checkpoint), or build a new "
            "module")


def plain_dicts(value: Any) -> Any:
    """``value`` with dict subclasses (Lightning's AttributeDict of hyperparameters) as plain dicts, so that the
    checkpoint keeps them as data, not as pickled objects."""
    if isinstance(value, dict):
        return {k: plain_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_dicts(v) for v in value]
    return value
