"""Lightning Fabric on offload's engine: ``OffloadStrategy``, Fabric's DeepSpeed strategy with the engine under it.

    import offload.lightning                                      # registers the offload_* names for Fabric too
    fabric = L.Fabric(strategy="offload_stage_3_offload", precision="bf16-mixed")   # was "deepspeed_stage_3_offload"

A subclass of Fabric's ``DeepSpeedStrategy``, because Fabric gates on that class (the precision plugin, which calls
the engine's ``backward``; the joint set-up of model and optimizer; ``fabric.backward(loss, model=...)`` with
several models), with the same arguments and config. Every call into the ``deepspeed`` package is the engine's: the
process group is Fabric's own (DDP's, so CPUs with gloo run too), ``fabric.init_module()`` builds under
``offload.zero.Init`` at stage 3, ``fabric.setup`` hands model and optimizer to ``offload.initialize``,
``fabric.save``/``fabric.load`` write and read the engine's checkpoint folder.

[Note: Fabric's optimizer step is the engine's step]
Fabric's ``optimizer.step()`` reaches the strategy's ``optimizer_step``; under DeepSpeed's strategy that steps the
ZeRO optimizer directly. Here it is ``engine.step()``: the reduction, clipping (the config's
``gradient_clipping``) and the write-back of the new parameters are the engine's, with the gradients of every
``fabric.backward`` since the last step (gradient accumulation in Fabric is backward N times, then step). The LR
scheduler stays the script's: Fabric scripts step it themselves, so it is not handed to the engine (which would
step it a second time); it is over the script's optimizer, whose param groups the engine reads.
"""

from __future__ import annotations

import argparse
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.deepspeed import (
    DeepSpeedStrategy,
    _validate_checkpoint_directory,
    _validate_state_keys,
)
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.load import _move_state_into
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer

from offload.engine.core import Engine
from offload.engine.initialize import initialize
from offload.lightning.shared import (
    adopt_arguments,
    bind_arguments,
    configure_activation_checkpointing,
    plain_dicts,
    refuse_a_second_engine,
    register_twins,
)
from offload.zero.init import Init


class OffloadStrategy(DeepSpeedStrategy):
    """Fabric's ``DeepSpeedStrategy`` arguments and config (``config=`` a ds_config dict or path, or the keyword
    arguments that build one), trained on offload's engine. Offload's own keys go in the config's ``"offload"``
    section."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = bind_arguments(DeepSpeedStrategy, self, args, kwargs)
        DDPStrategy.__init__(self, accelerator=given["accelerator"], parallel_devices=given["parallel_devices"],
                             cluster_environment=given["cluster_environment"], precision=given["precision"],
                             process_group_backend=given["process_group_backend"])
        self._backward_sync_control = None  # the engine reduces every backward's gradients, as DeepSpeed's
        adopt_arguments(DeepSpeedStrategy, self, given)
        self._deepspeed_engine: Any = None  # the engine fabric.backward uses (Fabric sets it; DeepSpeed's name)
        self._engines: list[Engine] = []  # every engine set up here, to find the one an optimizer's step is

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """DeepSpeed's names with ``offload`` for ``deepspeed``, with the arguments DeepSpeed's name gives."""
        register_twins(strategy_registry, DeepSpeedStrategy, cls)

    # ----------------------------------------------------------------- process group and device

    def setup_environment(self) -> None:
        """DDP's: a CPU or a CUDA device (DeepSpeed's strategy refuses all but CUDA)."""
        DDPStrategy.setup_environment(self)

    def _setup_distributed(self) -> None:
        """Fabric's own process group (DDP's), which the engine joins; then the config takes the precision."""
        DDPStrategy._setup_distributed(self)
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: the engine places the parameters on their tiers (moving the whole model to the GPU first is
        what offload exists to avoid)."""

    def module_sharded_context(self) -> AbstractContextManager[Any]:
        """``fabric.init_module()`` builds here: on the meta device at stage 3, sharded by the engine."""
        assert self._config_initialized, "fabric.launch() sets the strategy up before fabric.init_module()"
        if self.zero_stage_3:
            # Fabric.setup warns of parameters on different devices before the strategy sees the model: here the
            # large ones stay on the meta device until the engine materializes its shards, and nothing is moved
            # (module_to_device), so the warning would say what does not happen
            warnings.filterwarnings("ignore", message=r"The model passed to `Fabric.setup\(\)` has \d+ parameters "
                                    r"on different devices .* on meta")
        return Init(enabled=self.zero_stage_3, remote_device=self.remote_device, config_dict_or_path=self.config)

    # ----------------------------------------------------------------- the engine

    def _initialize_engine(self, model: nn.Module, optimizer: Optimizer | None = None,
                           scheduler: Any = None) -> tuple[Any, Any, Any]:
        """``offload.initialize`` in place of ``deepspeed.initialize``; the scheduler is returned as given (see
        [Note: Fabric's optimizer step is the engine's step])."""
        refuse_a_second_engine(model, "fabric.setup")
        assert self.config is not None
        engine, engine_optimizer, _, _ = initialize(
            args=argparse.Namespace(device_rank=self.root_device.index), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            dist_init_required=False, device=self.root_device)
        if optimizer is not None:
            # the script's scheduler is over this optimizer, whose step the engine does: told so, torch does not
            # warn that the scheduler stepped before the optimizer
            setattr(optimizer, "_opt_called", True)
        self._engines.append(engine)
        return engine, engine_optimizer, scheduler

    def _set_deepspeed_activation_checkpointing(self) -> None:
        assert isinstance(self.config, dict)
        configure_activation_checkpointing(self.config)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``engine.step()`` of the engine whose optimizer this is (see [Note: Fabric's optimizer step is the
        engine's step])."""
        if kwargs.get("closure") is not None:
            raise TypeError("optimizer.step(closure): the engine steps on the gradients of the fabric.backward "
                            "calls before it; call fabric.backward(loss), then optimizer.step()")
        engine = next((e for e in self._engines if e.optimizer is optimizer), None)
        if engine is None:
            raise RuntimeError("this optimizer was not set up by this strategy: pass it to fabric.setup(model, "
                               "optimizer) with its model")
        return engine.step()

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        """The engine's checkpoint in the folder ``path`` (every rank); the rest of ``state`` (a scheduler's
        state, counters) as its client state."""
        if storage_options is not None:
            raise TypeError(f"fabric.save(..., storage_options=...) is not supported by {type(self).__name__}: the "
                            "engine writes its own files, no CheckpointIO is used")
        if filter is not None:
            raise TypeError(f"fabric.save(..., filter=...) is not supported by {type(self).__name__}: the engine's "
                            "checkpoint holds every parameter and loads every key")
        engine = self._engine_in(state, "save")
        path = self.broadcast(path)
        rest = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        _validate_state_keys(rest)
        rest = self._convert_stateful_objects_in_state(rest, filter={})
        engine.save_checkpoint(path, tag="checkpoint", client_state=plain_dicts(rest))

    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The engine's checkpoint into the engine in ``state`` (its optimizer's state where ``state`` holds the
        optimizer), the client state into the other objects; with ``load_full_weights`` (or a module or engine
        alone as ``state``) a single file of whole weights, cut into the shards. Values saved as objects are
        unpickled only with ``weights_only=False``, as Fabric's own loading."""
        if isinstance(state, (nn.Module, Engine)) or self.load_full_weights and self.zero_stage_3:
            return self._load_full_weights(self.broadcast(path), state, strict, weights_only)
        if not state:
            raise ValueError(f"fabric.load(..., state={state!r}): the state must hold the model set up by "
                             "fabric.setup, as state={'model': model, ...}")
        _validate_checkpoint_directory(path)
        engine = self._engine_in(state, "load")
        if not strict:
            raise ValueError("fabric.load(..., strict=False): offload's checkpoint loads every key of the module; "
                             "pass strict=True")
        _, client_state = engine.load_checkpoint(
            path, tag="checkpoint", load_optimizer_states=any(v is engine.optimizer for v in state.values()),
            load_lr_scheduler_states=False, trust_client_state=weights_only is False)
        if client_state is None:
            raise RuntimeError(f"{path} holds no offload checkpoint: pass the folder fabric.save wrote, or a "
                               "single-file checkpoint with OffloadStrategy(load_full_weights=True)")
        _move_state_into(source=client_state, destination=state, keys=set(client_state) & set(state))
        return client_state

    def _load_full_weights(self, path: _PATH, state: Any, strict: bool, weights_only: bool | None
                           ) -> dict[str, Any]:
        """Fabric's loading of a single file, each engine in ``state`` taking its entry through
        ``load_full_state_dict`` (every rank cuts its shards out of the same dict; keys and shapes checked before
        anything is written)."""
        if isinstance(state, Engine):
            state.load_full_state_dict(self.checkpoint_io.load_checkpoint(path, weights_only=weights_only),
                                       strict=strict)
            return {}
        if not isinstance(state, dict):
            return super(DeepSpeedStrategy, self).load_checkpoint(path, state, strict, weights_only)
        seen = {k: FullWeights(v, strict) if isinstance(v, Engine) else v for k, v in state.items()}
        remainder = super(DeepSpeedStrategy, self).load_checkpoint(path, seen, strict, weights_only)
        state.update({k: v for k, v in seen.items() if not isinstance(v, FullWeights)})  # the values read
        return remainder

    def _engine_in(self, state: dict[str, Any], verb: str) -> Engine:
        engines = [v for v in state.values() if isinstance(v, Engine)]
        if len(engines) != 1:
            raise ValueError(f"fabric.{verb}(path, state): the state must hold exactly one model set up by "
                             f"fabric.setup (found {len(engines)}), as state={{'model': model, 'optimizer': "
                             "optimizer, ...}; save each model to a path of its own")
        return engines[0]


@dataclass
class FullWeights:
    """An engine as Fabric's loading sees a module: ``load_state_dict`` of whole weights."""

    engine: Engine
    strict: bool

    def state_dict(self) -> dict[str, Any]:
        return self.engine.full_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_full_state_dict(state_dict, strict=self.strict)
