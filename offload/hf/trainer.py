"""``offload.hf.Trainer``: Hugging Face's ``Trainer`` with the model and optimizer run by offload's engine.

[Note: the Trainer's loop around the engine] transformers' training loop stays as it is
(data, accumulation boundaries, logging, evaluation, callbacks, checkpoint rotation);
what DeepSpeed's engine does under it, offload's does here:
- the engine is built when training starts (``_prepare_for_training``), once the number
  of steps is known, from the config with its ``"auto"`` values filled from
  TrainingArguments (offload/hf/ds_config.py);
- ``training_step`` runs the forward through the model (the engine's hooks gather each
  unit), scales the loss for accumulation as the Trainer does, and calls
  ``engine.backward`` (not scaling it again) and ``engine.step`` (a no-op between
  micro-batches). The loop's own ``optimizer.step()``, ``lr_scheduler.step()`` and
  gradient clipping become no-ops: the engine clipped, stepped and scheduled already,
  and the loop reads back its gradient norm and the learning rate the step used;
- ``save_model`` writes Hugging Face's format (``config.json`` plus the gathered
  weights as ``model.safetensors``, streamed unit by unit by ``engine.write_weights`` on
  every rank, a collective, whatever ``stage3_gather_16bit_weights_on_model_save`` says:
  the whole model is never in memory); a checkpoint (``checkpoint-N``) holds that plus the engine's own
  checkpoint, and ``resume_from_checkpoint`` loads the engine's state from it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from accelerate.utils.memory import clear_device_cache
from torch import nn

from offload.config import Config
from offload.engine.initialize import initialize
from offload.files.pretrained import PretrainedWeights
from offload.hf.ds_config import resolve
from offload.optim.lr_schedules import build_lr_schedule

logger = logging.getLogger("offload.hf")


class _WholeParameterCount(logging.Filter):
    """transformers' Trainer logs its trainable parameters counted with ``numel()``, which is 0 for a released ZeRO-3
    parameter (it counts ``ds_numel`` only under its own DeepSpeed integration): the line gets the whole count."""

    LINE = "  Number of trainable parameters = "

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = weakref.ref(model)

    def filter(self, record: logging.LogRecord) -> bool:
        model = self.model()
        if model is not None and isinstance(record.msg, str) and record.msg.startswith(self.LINE):
            count = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
            record.msg, record.args = f"{self.LINE}{count:,}", None
        return True

ENGINE_CHECKPOINT = "offload"  # the engine's checkpoint directory inside checkpoint-N
# The TrainingArguments the engine is built for (with the config keys they fill): a later train() keeps them.
_FIXED_AT_BUILD = {"per_device_train_batch_size": "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps": "gradient_accumulation_steps", "max_grad_norm": "gradient_clipping"}


class _EngineOptimizer:
    """What the Trainer's loop steps and zeroes: the engine did both in ``training_step``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}


class _EngineLRSchedule:
    """What the Trainer's loop steps and reads: the engine steps its schedule itself; the loop reads the learning
    rate of the step just applied (as it reads it before stepping a schedule of its own)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.trainer.step_lr or self.trainer.engine.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {}


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose model and optimizer run through an offload engine, configured by
    ``offload_config`` (a DeepSpeed-format config: a path, a dict or a Config; ``"auto"`` values resolved from
    ``args`` as Hugging Face resolves them for DeepSpeed). ``weights``: a local checkpoint directory the model
    starts from, read into the shards (build ``model`` with ``offload.hf.meta_model`` so it is never whole).
    During ``train()`` SIGTERM and SIGINT stop it after the step under way, every rank at the same step, with a
    checkpoint of that step (``save_on_stop``, as save_strategy would write one), and the process exits 143 / 130
    (see [Note: stopping at an agreed step] in offload/engine/stopping.py)."""

    model: nn.Module  # never None: without model_init (refused here) transformers' __init__ requires a model

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None, *,
                 offload_config: str | os.PathLike[str] | dict[str, Any] | Config,
                 weights: str | os.PathLike[str] | PretrainedWeights | None = None, save_on_stop: bool = True,
                 **kwargs: Any) -> None:
        if int(transformers.__version__.split(".")[0]) < 5:
            raise ImportError(f"offload.hf.Trainer needs transformers 5 or newer (it drives the Trainer's v5 loop); "
                              f"this is {transformers.__version__}: pip install -U 'offload[hf]'")
        if args is not None and getattr(args, "deepspeed", None):
            raise ValueError("TrainingArguments.deepspeed is set: offload.hf.Trainer takes the config as "
                             "offload_config=...; drop deepspeed= from the arguments")
        if args is not None and getattr(args, "auto_find_batch_size", False):
            raise ValueError("TrainingArguments.auto_find_batch_size is not supported by offload.hf.Trainer: the "
                             "engine is built once, for one micro-batch, and a step that ran out of memory stops "
                             "it; set per_device_train_batch_size (`offload estimate` says what fits) and drop "
                             "auto_find_batch_size")
        for unsupported in ("optimizers", "optimizer_cls_and_kwargs"):
            if kwargs.get(unsupported) not in (None, (None, None)):
                raise ValueError(f"offload.hf.Trainer: {unsupported}= is not supported; the engine runs Adam/AdamW "
                                 "from the config's optimizer section (or TrainingArguments' AdamW settings)")
        if kwargs.get("model_init") is not None:
            raise ValueError("offload.hf.Trainer: model_init= is not supported: the engine is built once around the "
                             "model it is given (hyperparameter_search would need a new engine per trial); pass "
                             "model= and build a new Trainer per trial")
        self.offload_config = _raw_config(offload_config)
        if args is not None:
            _check_arguments(args, self.offload_config)
        self.weights = weights if weights is None or isinstance(weights, PretrainedWeights) \
            else PretrainedWeights(weights)
        self.engine: Any = None
        self.step_lr: list[float] | None = None  # the learning rate of the step last applied
        self._built_for: dict[str, Any] = {}  # the arguments of _FIXED_AT_BUILD the engine was built with
        super().__init__(model=model, args=args, **kwargs)
        self._stop = _StopOnSignals(self, save_on_stop)
        self.add_callback(self._stop)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' train(); a run stopped by a signal ends the process after its checkpoint (see the class
        docstring)."""
        try:
            out = super().train(*args, **kwargs)
        finally:
            self._stop.uninstall()
        if self.engine is not None and self.engine.should_stop:
            stop, step = self.engine.stop, self.state.global_step
            saved = self._stop.saved_to
            if self.args.should_log:
                print(f"offload.hf.Trainer: stopped by {stop.reason} after step {step}; "
                      + (f"saved checkpoint {saved}" if saved else "no checkpoint saved (save_on_stop=False)")
                      + "; resume: trainer.train(resume_from_checkpoint=True) in the same script", flush=True)
            self.engine.close()
            raise SystemExit(stop.exit_status)
        return out

    # ----------------------------------------------------------------- the engine

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """The engine places the model (its parameters may be on the meta device until then)."""
        return None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self.model  # never DDP or anything else: the engine shards it

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
                              ) -> tuple[nn.Module, Any]:
        if self.engine is None:
            self._build_engine(max_steps)
        else:
            self._renew_lr_schedule(max_steps)
        if resume_from_checkpoint is not None:
            self._load_engine_checkpoint(Path(resume_from_checkpoint))
        self.model_wrapped = self.model
        return self.model, train_dataloader

    def _build_engine(self, num_training_steps: int) -> None:
        config = resolve(self.offload_config, self.args, self.model, num_training_steps)
        self._built_for = {arg: getattr(self.args, arg) for arg in _FIXED_AT_BUILD}
        kwargs: dict[str, Any] = {}
        if "optimizer" not in config:  # the Trainer's AdamW, with its decay / no-decay groups
            kwargs["optimizer"] = self.create_optimizer()
        else:
            kwargs["model_parameters"] = [p for p in self.model.parameters() if p.requires_grad]
        if "scheduler" not in config:  # the Trainer's schedule (lr_scheduler_type), over the engine's optimizer
            kwargs["lr_scheduler"] = lambda optimizer: self._trainer_lr_schedule(num_training_steps, optimizer)
        self.optimizer = None
        self.lr_scheduler = None
        self.engine, *_ = initialize(model=self.model, config=config, weights=self.weights,
                                     device=self.args.device, **kwargs)
        if self.args.torch_compile:  # each unit's blocks, as accelerate's regional compile under DeepSpeed does
            mode = self.args.torch_compile_mode
            self.engine.compile(backend=self.args.torch_compile_backend or "inductor",
                                compile_kwargs={"mode": mode} if mode else {})
        trainer_log = logging.getLogger(transformers.Trainer.__module__)
        for old in [f for f in trainer_log.filters if isinstance(f, _WholeParameterCount) and f.model() is None]:
            trainer_log.removeFilter(old)
        trainer_log.addFilter(_WholeParameterCount(self.model))
        # accelerate's prepare_model (evaluation runs it on a model it has not seen) leaves the model as it is: no
        # device move of the engine's parameters, no autocast wrapper left on its forward for training.
        self.model._is_accelerate_prepared = True  # type: ignore[assignment]  # a flag, not a tensor or module
        self.optimizer = _EngineOptimizer(self.engine)  # type: ignore[assignment]
        self.lr_scheduler = _EngineLRSchedule(self)  # type: ignore[assignment]

    def _trainer_lr_schedule(self, num_training_steps: int, optimizer: Any) -> Any:
        """The Trainer's own schedule (``lr_scheduler_type``, its warm-up) over the engine's optimizer."""
        maker = copy.copy(self)  # create_scheduler keeps what it builds on the trainer it is called on
        maker.lr_scheduler = None
        return maker.create_scheduler(num_training_steps, optimizer)

    def _renew_lr_schedule(self, num_training_steps: int) -> None:
        """A later ``train()`` runs a schedule of its own over its steps, as the plain Trainer's does (which
        rebuilds the schedule it created); Adam's state and the step count go on. What the engine was built for
        (micro-batch, accumulation, clipping) must not have changed in the arguments since."""
        changed = [f"{arg} ({key}) {self._built_for[arg]} -> {getattr(self.args, arg)}"
                   for arg, key in _FIXED_AT_BUILD.items() if getattr(self.args, arg) != self._built_for[arg]]
        if changed:
            raise ValueError(f"offload.hf.Trainer: the engine was built by the first train() and these arguments "
                             f"changed since: {'; '.join(changed)}; keep them, or build a new Trainer")
        config = Config.load(resolve(self.offload_config, self.args, self.model, num_training_steps))
        self.step_lr = None  # the last run's, until this run's first step
        optimizer, old = self.engine.optimizer, self.engine.lr_scheduler
        for group, lr in zip(optimizer.param_groups, getattr(old, "base_lrs", ()), strict=False):
            group["lr"] = lr  # schedules that scale the rate they find (cosine, Hugging Face's) start from the base
        self.engine.lr_scheduler = build_lr_schedule(optimizer, config.scheduler) if config.scheduler is not None \
            else self._trainer_lr_schedule(num_training_steps, optimizer)

    def _ensure_engine(self) -> None:
        """Evaluating, predicting or saving before train(): the engine is built now (the model may be on the meta
        device until then), its schedule over the steps train() would take (train() renews it anyway)."""
        if self.engine is not None:
            return
        steps = max(1, self.args.max_steps)
        if self.train_dataset is not None:
            steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        self._build_engine(steps)
        self.model_wrapped = self.model

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._ensure_engine()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_engine()
        return super().predict(*args, **kwargs)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's engine state, as DeepSpeed's integration loads its whole
        checkpoint (the weights alone would leave the engine's fp32 masters at the last step)."""
        assert self.state.best_model_checkpoint is not None  # transformers calls this only when there is one
        self._load_engine_checkpoint(Path(self.state.best_model_checkpoint))

    def _load_engine_checkpoint(self, checkpoint: Path) -> None:
        """The engine's state saved in a Trainer checkpoint; one without it is refused, as Hugging Face's DeepSpeed
        integration refuses it (the engine's own load would warn and go on from where it is)."""
        path, _ = self.engine.load_checkpoint(checkpoint / ENGINE_CHECKPOINT)
        if path is None:
            raise ValueError(f"offload.hf.Trainer: {checkpoint} holds no engine checkpoint ({ENGINE_CHECKPOINT}/latest "
                             "is missing): resume from a checkpoint this Trainer saved")

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.engine is not None and optimizer is None:
            return self.lr_scheduler  # the engine's, built with it
        return super().create_scheduler(num_training_steps, optimizer)

    # ----------------------------------------------------------------- a step

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            # the loss alone: a tuple only with return_outputs=True
            loss = cast(torch.Tensor, self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch))
        del inputs
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            clear_device_cache()
        scaled = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else (
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None)
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # The loop's own boundary: the end of an epoch ends an accumulation however many batches are in.
        if self.accelerator.gradient_state.sync_gradients:
            self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(loss, scale_wrt_gas=False)  # scaled for accumulation above, as the Trainer does
        if self.engine.is_gradient_accumulation_boundary():
            self.step_lr = self.engine.get_lr()
        self.engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return self.engine.last_grad_norm  # the engine clipped in step()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self.engine.last_grad_norm if grad_norm is None else grad_norm

    # ----------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face's format: config.json and the gathered weights as model.safetensors (every rank takes part:
        the weights are gathered unit by unit)."""
        output_dir = output_dir or self.args.output_dir
        assert output_dir is not None  # TrainingArguments fills its output_dir in
        self._ensure_engine()
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if _is_peft(self.model):  # the adapter alone, as the plain Trainer (and DeepSpeed's) saves it
            self._save_adapter(output_dir)
        else:
            self.engine.write_weights(output_dir, "model.safetensors")
        if self.args.should_save:
            unwrapped: Any = self.model  # a Hugging Face model: what it has is looked up by name
            if not _is_peft(unwrapped):  # PEFT writes its adapter_config.json (and the base's stays the base's)
                if hasattr(unwrapped, "config"):
                    unwrapped.config.save_pretrained(output_dir)
                if getattr(unwrapped, "generation_config", None) is not None \
                        and hasattr(unwrapped, "can_generate") and unwrapped.can_generate():
                    unwrapped.generation_config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif (tokenizer := getattr(self.data_collator, "tokenizer", None)) is not None:
                tokenizer.save_pretrained(output_dir)  # as the plain Trainer falls back
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:  # a user's save_model, as the plain Trainer's
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_adapter(self, output_dir: str) -> None:
        """A PEFT model's trained parameters (its adapters), gathered from the shards (a collective: every rank
        calls it), saved by PEFT itself on the rank that saves: adapter_config.json and adapter_model.safetensors,
        which ``PeftModel.from_pretrained`` loads onto the base model."""
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        with self.engine.gathered_parameters(params=list(trained.values())):
            state = {name: p.detach().to("cpu", copy=True) for name, p in trained.items()}
        if self.args.should_save:
            # PEFT's save_pretrained (see _is_peft), which nn.Module's __getattr__ types as a tensor or module
            self.model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)  # type: ignore[operator]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(Path(output_dir) / ENGINE_CHECKPOINT)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        return None  # the engine's checkpoint holds both; loaded in _prepare_for_training

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not (Path(resume_from_checkpoint) / ENGINE_CHECKPOINT).is_dir():
            raise ValueError(f"{resume_from_checkpoint} holds no offload engine checkpoint ({ENGINE_CHECKPOINT}/): "
                             "was it written by offload.hf.Trainer?")


def _is_peft(model: nn.Module) -> bool:
    """A PEFT model (LoRA and its kin): saved as its adapters, as PEFT and the plain Trainer save it."""
    return hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None))


class _StopOnSignals(transformers.TrainerCallback):
    """The Trainer's side of a stop: signals become the engine's stop request while train() runs; after the step
    every rank agreed to stop at, the Trainer saves (``save_on_stop``) and ends its loop."""

    def __init__(self, trainer: Trainer, save_on_stop: bool) -> None:
        self.trainer, self.save_on_stop = trainer, save_on_stop
        self.signals: Any = None
        self.saved_to: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.saved_to = None
        self.signals = self.trainer.engine.stop_on_signals().install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.engine.should_stop:
            control.should_save = control.should_save or self.save_on_stop
            control.should_training_stop = True
            if control.should_save:
                self.saved_to = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    def uninstall(self) -> None:
        if self.signals is not None:
            self.signals.uninstall()
            self.signals = None


# The Trainer's own optimizers the engine's Adam/AdamW reproduces (the rest are refused by name).
_ADAMW = ("adamw_torch", "adamw_torch_fused")
# Schedules that step on an evaluation metric, which the engine's step never sees.
_METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


def _check_arguments(args: transformers.TrainingArguments, config: dict[str, Any]) -> None:
    """TrainingArguments that would act where the engine has taken over: refused by name with what to do, never
    ignored. Those a config section overrides, as in DeepSpeed's integration, are named in a warning."""
    problems = []
    if args.fsdp:
        problems.append("fsdp: offload shards the model itself (ZeRO stage 3 in the config); drop fsdp and "
                        "fsdp_config")
    if args.bf16_full_eval or args.fp16_full_eval:
        problems.append("bf16_full_eval/fp16_full_eval: casting the model for evaluation would cut its parameters "
                        "loose from the engine's shards; evaluation runs in the training precision (bf16 or fp16)")
    if args.n_gpu > 1:  # one process seeing several GPUs: the plain Trainer's DataParallel, n_gpu x the batch
        problems.append(f"{args.n_gpu} GPUs visible to one process: offload runs one GPU per process; launch with "
                        f"torchrun --nproc-per-node {args.n_gpu} (or set CUDA_VISIBLE_DEVICES to one GPU)")
    optim = str(getattr(args.optim, "value", args.optim))
    if "optimizer" not in config and optim not in _ADAMW:
        problems.append(f"optim={optim!r}: the engine runs Adam/AdamW only (its own CPU Adam); set optim to one of "
                        f"{', '.join(_ADAMW)}, or give the config an optimizer section")
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if "scheduler" not in config and schedule in _METRIC_SCHEDULES:
        problems.append(f"lr_scheduler_type={schedule!r} steps on an evaluation metric, which the engine's step "
                        "does not see; choose a schedule over steps (linear, cosine, ...)")
    if problems:
        raise ValueError("offload.hf.Trainer cannot honour these TrainingArguments:\n- " + "\n- ".join(problems))
    overridden = []
    if "optimizer" in config and (optim not in _ADAMW or args.optim_args):
        overridden.append(f"optim={optim!r}" + (f", optim_args={args.optim_args!r}" if args.optim_args else ""))
    if "scheduler" in config and (schedule != "linear" or args.lr_scheduler_kwargs):
        overridden.append(f"lr_scheduler_type={schedule!r}"
                          + (f", lr_scheduler_kwargs={args.lr_scheduler_kwargs!r}" if args.lr_scheduler_kwargs else ""))
    if overridden:
        logger.warning("offload config: its optimizer/scheduler sections are used, as in DeepSpeed's integration; "
                       "these arguments have no effect: %s", "; ".join(overridden))


def _raw_config(config: str | os.PathLike[str] | dict[str, Any] | Config) -> dict[str, Any]:
    """The config as a plain dict with its "auto" values still in place (they are resolved per run)."""
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"offload_config {path}: no such file")
    return json.loads(path.read_text())
