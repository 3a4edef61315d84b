"""A Hugging Face accelerate loop with the DeepSpeed plugin, on offload's engine, by one changed import.

    from offload.accelerate import Accelerator    # was: from accelerate import Accelerator

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model(x), y))
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

accelerate's own DeepSpeed path imports the ``deepspeed`` package (and checks its version) the moment a plugin is
given, and starts the process group through it: it cannot run without DeepSpeed, and with it installed it would
run DeepSpeed. So this Accelerator is accelerate's with no DeepSpeed of its own (its type is NO, MULTI_CPU or
MULTI_GPU, as the launcher set it up), and ``prepare`` builds offload's engine from the plugin's config, filled as
accelerate fills it (``"auto"`` values from the loader and the accelerator). The prepared objects are the ones
accelerate's DeepSpeed path hands out: the engine as the model, an optimizer and a scheduler whose ``step`` the
engine does (inside ``backward`` at the accumulation boundary), the data loaders as accelerate prepares them.

What differs, on purpose: ``accelerator.distributed_type`` is not ``DEEPSPEED`` and ``state.deepspeed_plugin`` is
None (a script that branches on them takes the other branch); ``get_state_dict`` gives every rank the whole fp32
master weights (``engine.full_state_dict()``). Refused, with what to do: ``ACCELERATE_USE_DEEPSPEED`` (accelerate
would import DeepSpeed before this class runs), several DeepSpeed plugins, no plugin, a second model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.deepspeed import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
    DummyOptim,
    DummyScheduler,
)

import offload
from offload.engine.core import Engine

__all__ = ["Accelerator", "DummyOptim", "DummyScheduler"]  # accelerate.utils exports the two only with DeepSpeed

CHECKPOINT_TAG = "pytorch_model"  # the engine's checkpoint inside save_state's folder (accelerate's DeepSpeed name)


class Accelerator(accelerate.Accelerator):  # type: ignore[misc]  # accelerate has no types: its Accelerator is Any
    """accelerate's Accelerator whose ``prepare`` runs the model on offload's engine (see the module's docstring)."""

    def __init__(self, *args: Any, deepspeed_plugin: DeepSpeedPlugin | None = None,
                 mixed_precision: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("deepspeed_plugins"):
            raise ValueError("offload.accelerate.Accelerator takes one DeepSpeed plugin (deepspeed_plugin=...), not "
                             "several: offload runs one engine per accelerator")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise ValueError("ACCELERATE_USE_DEEPSPEED is set (accelerate launch --use_deepspeed, or a config with "
                             "distributed_type DEEPSPEED): accelerate then imports DeepSpeed itself. Launch without it "
                             "(accelerate launch --num_processes N, or torchrun) and pass "
                             "deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...) here")
        if deepspeed_plugin is None:
            raise ValueError("offload.accelerate.Accelerator needs deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...): "
                             "the DeepSpeed config the engine reads (offload's keys go in its \"offload\" section)")
        super().__init__(*args, mixed_precision="no", **kwargs)
        deepspeed_plugin.set_mixed_precision(mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
        self.offload_plugin = deepspeed_plugin
        self._engine: Engine | None = None
        self._wrapped: DeepSpeedEngineWrapper | None = None

    # ----------------------------------------------------------------- prepare

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """The data loaders as accelerate prepares them; the model, its optimizer and scheduler as the engine and
        the wrappers accelerate's DeepSpeed path hands out."""
        out = [self.prepare_data_loader(a) if isinstance(a, torch.utils.data.DataLoader) else a for a in args]
        models = [a for a in out if isinstance(a, torch.nn.Module)]
        if not models:
            return out[0] if len(out) == 1 else tuple(out)
        if len(models) > 1 or self._engine is not None:
            raise ValueError("offload.accelerate.Accelerator prepares one model (one engine); prepare the others "
                             "with a second Accelerator, or as plain modules")
        model = models[0]
        optimizer = next((a for a in out if isinstance(a, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next((a for a in out if isinstance(a, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))),
                         None)
        loader = next((a for a in args if isinstance(a, torch.utils.data.DataLoader)), None)
        kwargs: dict[str, Any] = dict(model=model, config=self._engine_config(loader), dist_init_required=False,
                                      device=self.device)
        if isinstance(optimizer, DummyOptim):  # the config's optimizer over the script's parameters
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        engine, engine_optimizer, _, engine_scheduler = offload.initialize(**kwargs)
        options = self.state.dynamo_plugin.to_kwargs()  # dynamo_backend: what accelerate's DeepSpeed path compiles
        if options.get("backend", "no") != "no":
            engine.compile(backend=options.pop("backend"), compile_kwargs=options)
        wrapped_optimizer = DeepSpeedOptimizerWrapper(engine_optimizer) if engine_optimizer is not None else None
        wrapped_scheduler: Any = None
        if scheduler is not None:
            if engine_scheduler is not None:  # the config's, stepped by the engine
                wrapped_scheduler = DeepSpeedSchedulerWrapper(engine_scheduler, wrapped_optimizer)
            else:  # the script's, over the engine's param groups (its optimizer's, which the engine took)
                wrapped_scheduler = AcceleratedScheduler(scheduler, wrapped_optimizer,
                                                         step_with_optimizer=self.step_scheduler_with_optimizer,
                                                         split_batches=self.split_batches)
            self._schedulers.append(wrapped_scheduler)
        self._engine, self._wrapped = engine, DeepSpeedEngineWrapper(engine)
        swap = {id(model): engine, id(optimizer): wrapped_optimizer, id(scheduler): wrapped_scheduler}
        prepared = [swap.get(id(a), a) if a is not None else a for a in out]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _engine_config(self, loader: torch.utils.data.DataLoader[Any] | None) -> dict[str, Any]:
        """The plugin's config with its ``"auto"`` values filled as accelerate fills them for DeepSpeed."""
        plugin = self.offload_plugin
        plugin.fill_match("gradient_accumulation_steps", must_match=False,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        self.gradient_accumulation_steps: int = plugin.get_value("gradient_accumulation_steps")
        fill: dict[str, Any] = {"gradient_clipping": 1.0}
        if plugin.is_auto("train_micro_batch_size_per_gpu"):
            if loader is None or loader.batch_size is None:
                raise ValueError("train_micro_batch_size_per_gpu is \"auto\" and no data loader with a batch size "
                                 "was prepared with the model: prepare them together, or set it in the config")
            fill["train_micro_batch_size_per_gpu"] = loader.batch_size
            fill["train_batch_size"] = loader.batch_size * self.gradient_accumulation_steps * self.num_processes
        plugin.deepspeed_config_process(must_match=False, **fill)
        config = dict(plugin.deepspeed_config)
        if config.get("steps_per_print") == float("inf"):  # accelerate's way of saying never; offload's is no key
            del config["steps_per_print"]
        return config

    # ----------------------------------------------------------------- the loop

    def _engine_of(self, model: Any) -> Engine | None:
        return model if isinstance(model, Engine) else None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward, and its step at the accumulation boundary (the optimizer's and scheduler's
        ``step`` do nothing), as accelerate's DeepSpeed path runs them."""
        if self._wrapped is None:
            super().backward(loss, **kwargs)
            return
        self._wrapped.backward(loss, sync_gradients=self.sync_gradients, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The engine clips at its step (``gradient_clipping`` in the config); this returns the norm it measured
        (None before the first boundary), as accelerate's DeepSpeed path does."""
        if self._wrapped is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return self._wrapped.get_global_grad_norm()

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        engine = self._engine_of(model)
        if engine is not None:
            return engine.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The whole fp32 weights on every rank (a collective: call it on every rank)."""
        engine = self._engine_of(model)
        if engine is not None:
            return engine.full_state_dict()
        return super().get_state_dict(model, unwrap)

    # ----------------------------------------------------------------- state

    def save_state(self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """accelerate's state (RNG, schedulers, samplers, registered objects) and the engine's checkpoint beside it,
        in one folder (every rank)."""
        location = super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        if self._engine is not None:
            self._engine.save_checkpoint(location, CHECKPOINT_TAG)
        return location

    def load_state(self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> None:
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if self._engine is not None:
            folder = Path(input_dir) if input_dir is not None else self._latest_state()
            self._engine.load_checkpoint(str(folder), CHECKPOINT_TAG)

    def _latest_state(self) -> Path:
        """The folder ``load_state()`` with no argument reads (accelerate's automatic checkpoint naming)."""
        folder = Path(self.project_dir) / "checkpoints"
        states = sorted(folder.glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[-1]))
        if not states:
            raise FileNotFoundError(f"no saved state in {folder} to load")
        return states[-1]
