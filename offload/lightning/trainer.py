"""Lightning's Trainer on offload's engine: ``OffloadStrategy``, DeepSpeed's strategy with the engine under it.

    import offload.lightning                                     # registers the offload_* strategy names
    trainer = Trainer(strategy="offload_stage_3_offload", precision="bf16-mixed")   # was "deepspeed_stage_3_offload"

It *is* a ``DeepSpeedStrategy`` (a subclass), because Lightning gates on that class: the precision plugin it picks
(``DeepSpeedPrecision``, which calls the engine's ``backward`` and ``step``), the model summary of a sharded model,
the callbacks that refuse or adapt to DeepSpeed. It takes the same arguments and builds the same config; what
differs is every place Lightning's class calls the ``deepspeed`` package: the process group is Lightning's own
(DDP's), the model is built under ``offload.zero.Init`` and handed to ``offload.initialize``, checkpoints are the
engine's (a folder, as DeepSpeed's), and it runs on CPUs too (gloo), where DeepSpeed's needs CUDA.

Refused, by name: ``exclude_frozen_parameters`` (offload's checkpoint holds every parameter and loads strictly),
non-strict loading (``strict_loading = False``), a second ``fit`` of a module an engine already trains.

[Note: the loss is divided once]
Lightning's automatic optimization divides each micro-batch's loss by ``accumulate_grad_batches`` before backward,
whatever the strategy; DeepSpeed's engine divides it again by ``gradient_accumulation_steps`` (the same number, set
from the Trainer), so under Lightning's DeepSpeed strategy the gradients are 1/N of plain Lightning's, its clipping
threshold means N times as much and the grad norms it logs are 1/N. Adam barely notices (it is scale-free but for
eps), which is why this goes unseen. Offload's strategy passes ``scale_wrt_gas=False`` to the engine's backward in
automatic optimization, so that its gradients, clipping and norms are plain Lightning's (DDP's) at every
``accumulate_grad_batches``: a difference from DeepSpeed's strategy, on purpose (docs/lightning.md).

[Note: manual optimization runs beside the forward]
Lightning runs ``training_step`` as the forward of the model it wrapped (the engine's module), so under manual
optimization ``optimizer.step()``, called inside ``training_step``, is the engine's step inside the engine's
forward, while that forward holds the unit anchored at the root (the embeddings, the head, or a small model
whole): the engine refuses to step parameters a running forward holds. So under manual optimization the strategy
calls ``training_step`` as a method of its own, as Lightning does for an unwrapped module: each module it calls
gathers its parameters itself (see [Note: a method other than forward] in offload/zero/runtime.py), and nothing is
held between the calls, where ``manual_backward`` and the step run. Automatic optimization steps after the forward
has returned and keeps Lightning's path.
"""

from __future__ import annotations

import argparse
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.deepspeed import _validate_checkpoint_directory
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from offload.engine.initialize import initialize
from offload.lightning.shared import (
    adopt_arguments,
    bind_arguments,
    configure_activation_checkpointing,
    engine_of_module,
    plain_dicts,
    refuse_a_second_engine,
    register_twins,
)
from offload.zero.init import Init


class OffloadStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy``'s arguments and config (``config=`` a ds_config dict or path, or the keyword
    arguments that build one), trained on offload's engine. Offload's own keys go in the config's ``"offload"``
    section."""

    strategy_name = "offload"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # DeepSpeedStrategy.__init__ stops where DeepSpeed is not installed (see offload/lightning/shared.py)
        given = bind_arguments(DeepSpeedStrategy, self, args, kwargs)
        DDPStrategy.__init__(self, accelerator=given["accelerator"], parallel_devices=given["parallel_devices"],
                             cluster_environment=given["cluster_environment"],
                             precision_plugin=given["precision_plugin"],
                             process_group_backend=given["process_group_backend"])
        adopt_arguments(DeepSpeedStrategy, self, given)
        self._engine: Any = None  # the fit's engine, kept for validate/test/predict after it (it owns the shards)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """DeepSpeed's names, with ``offload`` for ``deepspeed``: ``offload``, ``offload_stage_1`` ...
        ``offload_stage_3_offload_nvme``, with the arguments DeepSpeed's name gives."""
        register_twins(strategy_registry, DeepSpeedStrategy, cls)

    # ----------------------------------------------------------------- process group and device

    def setup_environment(self) -> None:
        """DDP's: a CPU or a CUDA device (DeepSpeed's strategy refuses all but CUDA)."""
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """Lightning's own process group (DDP's), which the engine joins."""
        DDPStrategy.setup_distributed(self)

    # ----------------------------------------------------------------- the engine

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """The engine's backward, without its division by the accumulation steps where Lightning's loop has divided
        the loss already (automatic optimization): the gradients are plain Lightning's, where DeepSpeed's strategy
        divides twice (see [Note: the loss is divided once])."""
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, but under manual optimization the LightningModule's training_step runs as a method of its
        own rather than inside the engine's forward (see [Note: manual optimization runs beside the forward])."""
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Optimizer | None,
                                   lr_scheduler: Any = None) -> tuple[Any, Any]:
        refuse_a_second_engine(model, "Trainer.fit")
        assert self.config is not None
        engine, engine_optimizer, _, _ = initialize(
            args=argparse.Namespace(device_rank=self.root_device.index), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False, device=self.root_device)
        self._engine = engine
        return engine, engine_optimizer

    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        """Validation, test and predict without a fit in this process: an engine that runs forward only (the engine
        of an earlier fit, where the module has one)."""
        engine = engine_of_module(model)
        if engine is not None:
            self.model = engine
            return
        assert isinstance(self.config, dict)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16", "zero_optimization", "offload"):
            if key in self.config:
                config[key] = self.config[key]
        self._engine, _, _, _ = initialize(model=model, config=config, dist_init_required=False,
                                           device=self.root_device)
        self.model = self._engine

    def _initialize_deepspeed_train(self, model: nn.Module) -> None:
        super()._initialize_deepspeed_train(model)
        for config in self.lr_scheduler_configs:
            # the script's scheduler is over its optimizer, whose step the engine does (it shares its param
            # groups): told so, torch does not warn that the scheduler stepped before the optimizer
            setattr(config.scheduler.optimizer, "_opt_called", True)

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds its layers here: on the meta device at stage 3, sharded by the engine."""
        self._init_config_if_needed()
        with Init(enabled=self.zero_stage_3, remote_device=self.remote_device, config_dict_or_path=self.config):
            yield

    def _set_deepspeed_activation_checkpointing(self) -> None:
        assert isinstance(self.config, dict)
        configure_activation_checkpointing(self.config)

    def teardown(self) -> None:
        """Lightning's, but its optimizer's state is not Lightning's to move to the CPU: the engine keeps it in
        shards on their tiers."""
        optimizers, self.optimizers = self.optimizers, []
        super().teardown()
        self.optimizers = optimizers

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Nothing: the engine's checkpoint holds the optimizer's state (Lightning leaves this key out of it)."""
        return {}

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """The engine's checkpoint in the folder ``filepath`` (every rank), Lightning's state as its client
        state."""
        filepath = self.broadcast(filepath)
        if storage_options is not None:
            raise TypeError(f"Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                            f"{type(self).__name__}: the engine writes its own files, no CheckpointIO is used")
        client_state = {k: plain_dicts(v) for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.deepspeed_engine.save_checkpoint(filepath, tag="checkpoint", client_state=client_state)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The engine's checkpoint (optimizer state only when fitting), and Lightning's state from it. Values
        saved as objects are unpickled only with ``weights_only=False``, as Lightning's own loading."""
        if self.load_full_weights and self.zero_stage_3:
            return super(DeepSpeedStrategy, self).load_checkpoint(self.broadcast(checkpoint_path), weights_only)
        _validate_checkpoint_directory(checkpoint_path)
        assert self.lightning_module is not None
        if not self.lightning_module.strict_loading:
            raise MisconfigurationException("strict_loading = False: offload's checkpoint loads every key of the "
                                            "module; set the LightningModule's strict_loading to True")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.deepspeed_engine.load_checkpoint(
            checkpoint_path, load_optimizer_states=fitting, load_lr_scheduler_states=False,
            trust_client_state=weights_only is False)
        if client_state is None:
            raise MisconfigurationException(
                f"{checkpoint_path} holds no offload checkpoint (no 'latest' file): pass the folder "
                "Trainer.save_checkpoint wrote, or a single-file checkpoint with OffloadStrategy(load_full_weights="
                "True)")
        return client_state

    def _restore_zero_state(self, ckpt: Mapping[str, Any], strict: bool) -> None:
        """A single-file checkpoint's whole weights into the shards (``load_full_weights=True``): the engine's
        ``load_full_state_dict``, every rank cutting its shards out of the same dict, the fp32 masters taking its
        values and each rank's buffers too; keys (with ``strict``) and shapes checked before anything is written."""
        self.deepspeed_engine.load_full_state_dict(dict(ckpt["state_dict"]), strict=strict)
