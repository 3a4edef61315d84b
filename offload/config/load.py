"""The whole config: load from a path, JSON text or dict; resolve "auto"; DeepSpeed's batch rule."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fields import (
    AUTO,
    KEY_HOMES,
    Auto,
    ConfigError,
    FieldInfo,
    NoEffect,
    Support,
    iter_fields,
    logger,
    parse_section,
    public_fields,
    section,
    setting,
    to_raw,
)
from .sections import (
    SCHEDULER_PARAMS,
    ActivationCheckpointingConfig,
    AdamParams,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CompileConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OffloadExtConfig,
    OptimizerConfig,
    SchedulerConfig,
    WandbConfig,
    ZeroConfig,
)

NO_EFFECT = Support.NO_EFFECT
REFUSED = Support.REFUSED
_CHANGES_TRAINING = "offload does not implement it, and ignoring it would change what is trained; remove the section."
_NOT_USED = "offload does not implement it."
_NO_MONITORS = ("offload writes no monitor files; `offload train` writes record.json, trace.json and loss.png, and "
                "engine.telemetry holds the per-phase times.")


@dataclass(kw_only=True, slots=True)
class Config:
    """A DeepSpeed-format training config, checked. Build with :meth:`load`; see docs/CONFIG.md."""

    train_batch_size: int | Auto | None = setting(
        None, "Samples per optimizer step over all ranks = micro batch x accumulation steps x world size.",
        ge=1, auto=True)
    train_micro_batch_size_per_gpu: int | Auto | None = setting(
        None, "Samples per forward/backward on one rank.", ge=1, auto=True)
    gradient_accumulation_steps: int | Auto | None = setting(
        None, "Micro-batches per optimizer step.", ge=1, auto=True)
    gradient_clipping: float | Auto = setting(1.0, "Clip the global gradient norm to this; 0 turns clipping off.",
                                              ge=0, auto=True)
    fp16: FP16Config = section(FP16Config, "fp16 mixed precision with loss scaling.")
    bf16: BF16Config = section(BF16Config, "bf16 mixed precision.", aliases=("bfloat16",))
    optimizer: OptimizerConfig | None = section(None, "The optimizer; leave out to pass your own to initialize.")
    scheduler: SchedulerConfig | None = section(None, "Learning-rate schedule; leave out for a constant rate.")
    zero_optimization: ZeroConfig = section(ZeroConfig, "ZeRO sharding and offload.")
    aio: AioConfig = section(AioConfig, "Swap-file I/O (NVMe offload).")
    activation_checkpointing: ActivationCheckpointingConfig = section(
        ActivationCheckpointingConfig, "Activation checkpointing.")
    steps_per_print: int | None = setting(None, "Log progress every this many optimizer steps (unset: never, as "
                                                "DeepSpeed 0.19.8's default).", ge=1)
    zero_allow_untested_optimizer: bool = setting(False, "Allow a client optimizer other than Adam/AdamW.",
                                                  support=NO_EFFECT, note="offload runs Adam/AdamW, Lion, "
                                                                          "Adagrad and Muon (by the optimizer "
                                                                          "section's type) and torch.optim's other "
                                                                          "elementwise optimizers (as objects); "
                                                                          "any other optimizer is an error at "
                                                                          "initialize.")
    gradient_predivide_factor: float = setting(1.0, "Divide gradients by this before the reduction and by "
                                                    "world/factor after.", gt=0)
    prescale_gradients: bool = setting(False, "Scale gradients before the reduction rather than after.")
    communication_data_type: str | None = setting(None, "Dtype of gradient reductions.",
                                                  choices=("fp32", "fp16", "bf16"), support=NO_EFFECT,
                                                  note="reductions run in the compute dtype.")
    wall_clock_breakdown: bool = setting(False, "Log the time per phase (forward, backward, gather, reduce, "
                                                "gradient wait, optimizer), averaged per step, every steps_per_print "
                                                "steps.")
    memory_breakdown: bool = setting(False, "Log this rank's bytes per tier (device, host, NVMe) by what holds them, "
                                            "every steps_per_print steps.")
    dump_state: bool = setting(False, "Log the resolved config, the step mode and the memory per tier at initialize.")
    disable_allgather: bool = setting(False, "DeepSpeed's all-gather switch.", support=NO_EFFECT,
                                      note="stage 3 gathers each unit with one all-gather, always.")
    zero_force_ds_cpu_optimizer: bool = setting(True, "DeepSpeed: require its CPU optimizer with offload.",
                                                support=NO_EFFECT, note="offload always runs its own CPU Adam.")
    sparse_gradients: bool = setting(False, "Sparse embedding gradients.", support=REFUSED,
                                     note="Embedding gradients are dense; leave it out.")
    tensorboard: MonitorConfig = section(MonitorConfig, "TensorBoard monitor.", support=NO_EFFECT, note=_NO_MONITORS)
    csv_monitor: MonitorConfig = section(MonitorConfig, "CSV monitor.", support=NO_EFFECT, note=_NO_MONITORS)
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases monitor.", support=NO_EFFECT, note=_NO_MONITORS)
    flops_profiler: FlopsProfilerConfig = section(FlopsProfilerConfig, "FLOPs profiler.", support=NO_EFFECT,
                                                  note="use torch.profiler; offload's spans appear in its trace.")
    comms_logger: CommsLoggerConfig = section(CommsLoggerConfig, "Collective-call logger.", support=NO_EFFECT,
                                              note="engine.telemetry counts collective time and bytes per step "
                                                   "(`offload bench step` prints them).")
    data_types: DataTypesConfig = section(DataTypesConfig, "Dtypes of internal buffers.")
    compile: CompileConfig = section(CompileConfig, "DeepSpeed's compile section (DeepCompile).")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoint options.")
    amp: dict[str, Any] | None = setting(None, "NVIDIA apex AMP.", support=REFUSED,
                                         note="Use the fp16 or bf16 section instead.")
    elasticity: dict[str, Any] | None = setting(None, "Elastic training.", support=REFUSED, note=_CHANGES_TRAINING)
    compression_training: dict[str, Any] | None = setting(None, "Compression.", support=REFUSED,
                                                          note=_CHANGES_TRAINING)
    sparse_attention: dict[str, Any] | None = setting(None, "Sparse attention.", support=REFUSED,
                                                      note=_CHANGES_TRAINING)
    quantize_training: dict[str, Any] | None = setting(None, "Quantization-aware training.", support=REFUSED,
                                                       note=_CHANGES_TRAINING)
    curriculum_learning: dict[str, Any] | None = setting(None, "Curriculum learning.", support=REFUSED,
                                                         note=_CHANGES_TRAINING)
    data_efficiency: dict[str, Any] | None = setting(None, "Data efficiency.", support=REFUSED,
                                                     note=_CHANGES_TRAINING)
    pipeline: dict[str, Any] | None = setting(None, "Pipeline parallelism.", support=NO_EFFECT, note=_NOT_USED)
    autotuning: dict[str, Any] | None = setting(None, "DeepSpeed's autotuner.", support=NO_EFFECT,
                                                note="use `offload tune-nvme` for the swap path.")
    nebula: dict[str, Any] | None = setting(None, "Nebula checkpointing.", support=NO_EFFECT, note=_NOT_USED)
    hybrid_engine: dict[str, Any] | None = setting(None, "RLHF hybrid engine.", support=NO_EFFECT, note=_NOT_USED)
    offload: OffloadExtConfig = section(OffloadExtConfig, "offload's own settings (not DeepSpeed keys).")
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False, metadata={"internal": True})

    def check(self, path: str) -> None:
        if (self.offload.cpu_threads is not None
                and self.zero_optimization.offload_optimizer.cpuadam_cores_perc is not None):
            raise ConfigError("zero_optimization.offload_optimizer.cpuadam_cores_perc",
                              "and offload.cpu_threads both set the host step's threads; keep one")
        clip = self.gradient_clipping
        if not self.zero_optimization.compute_grad_norm and isinstance(clip, (int, float)) and clip > 0:
            raise ConfigError("zero_optimization.compute_grad_norm",
                              f"is false, but gradient_clipping {clip:g} needs the norm; set gradient_clipping 0 "
                              "or leave compute_grad_norm out (as DeepSpeed refuses the pair)")
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ConfigError("bf16.enabled", "fp16 and bf16 are both enabled; enable one of them")
        batch = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        train, micro, accum = batch
        if isinstance(train, int) and isinstance(micro, int) and isinstance(accum, int):
            if train % (micro * accum):
                raise ConfigError("train_batch_size",
                                  f"{train} is not train_micro_batch_size_per_gpu ({micro}) x "
                                  f"gradient_accumulation_steps ({accum}) x a whole world size")

    # ----------------------------------------------------------------- building

    @classmethod
    def load(cls, source: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
        """From a Config, a dict, a JSON string or a path to a JSON file."""
        if isinstance(source, Config):
            return source
        if isinstance(source, Mapping):
            raw = source
        elif isinstance(source, (str, os.PathLike)):
            raw = _read_json(source)
        else:
            raise ConfigError("", f"a config is a dict, a JSON string or a path to a JSON file; got "
                                  f"{type(source).__name__}")
        notes: list[str] = []
        raw = _rewrite_legacy(raw, notes)
        config = parse_section(cls, raw, "", notes)
        for note in notes:  # keys without effect are listed once, by initialize and `offload config check`
            if not isinstance(note, NoEffect):
                logger.warning("config: %s", note)
        return dataclasses.replace(config, notes=tuple(notes))

    @property
    def progress_every(self) -> int:
        """How often the commands (``offload train``, ``demo``) print a progress line: steps_per_print, or every
        10 steps where it is unset (the engine's own reports stay off then, as DeepSpeed's)."""
        return self.steps_per_print or 10

    @property
    def no_effect(self) -> tuple[NoEffect, ...]:
        """The notes on keys this config sets that do nothing here, each naming the key and why."""
        return tuple(n for n in self.notes if isinstance(n, NoEffect))

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed-format JSON values; ``Config.load(c.to_dict()) == c``."""
        return to_raw(self)

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level section as DeepSpeed-format JSON: DeepSpeed's ``engine.config`` is the config dict, and
        transformers' Trainer reads it so (``engine.config.get("zero_optimization", {}).get("stage")``)."""
        return self.to_dict().get(key, default)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    # ----------------------------------------------------------------- auto and batch

    def auto_paths(self, runtime: bool = False) -> list[str]:
        """Dotted paths of the keys still "auto" that resolve fills; ``runtime``: also those the engine decides
        at start-up (``RUNTIME_AUTO``), which stay "auto" in a resolved config."""
        found: list[str] = []

        def walk(obj: Any, path: str) -> None:
            if obj is AUTO:
                if runtime or path not in RUNTIME_AUTO:
                    found.append(path)
            elif dataclasses.is_dataclass(obj):
                for f in public_fields(obj):
                    walk(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
        walk(self, "")
        return found

    def resolve(self, world_size: int, hidden_size: int | None = None,
                values: Mapping[str, Any] | None = None) -> Config:
        """A copy with every "auto" filled in and DeepSpeed's batch rule applied for ``world_size``.

        ``values`` maps dotted key paths to what the training script knows (as Hugging Face
        fills "auto" from its TrainingArguments); ``hidden_size`` sizes the ZeRO buckets as
        Hugging Face does. Anything else "auto" takes the field's documented default, except the keys the
        engine decides at start-up (``RUNTIME_AUTO``), which stay "auto".
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError("", f"world size must be a positive whole number, got {world_size!r}")
        values = dict(values or {})
        leaves = {info.path: info for info in iter_fields(Config, variants=_VARIANTS)}
        for key in values:
            if key not in leaves and not key.startswith("scheduler.params."):
                raise ConfigError(key, "is not a config key that resolve can fill")
        raw = self.to_dict()
        notes = list(self.notes)
        for path in self.auto_paths(runtime=True):
            if path in RUNTIME_AUTO and path not in values:
                continue  # the engine decides it at start-up, from what the device holds
            if path in values:
                value = values[path]
            elif path in _HIDDEN_DERIVED and hidden_size is not None:
                value = _HIDDEN_DERIVED[path](hidden_size)
            elif path in _BATCH_KEYS:
                value = None
            else:
                value = _schema_default(path, raw, leaves)
                notes.append(f"{path} is auto and nothing set it; using the default {value!r}")
            _set_path(raw, path, to_raw(value))
        train, micro, accum = _batch_rule(raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu"),
                                          raw.get("gradient_accumulation_steps"), world_size, notes)
        raw.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
        resolved = parse_section(Config, raw, "", notes)
        return dataclasses.replace(resolved, notes=tuple(dict.fromkeys(notes)))


# ------------------------------------------------------------------------- helpers

_VARIANTS = {"scheduler.params": tuple(SCHEDULER_PARAMS.values()), "optimizer.params": (AdamParams,)}
# Keys whose "auto" the engine decides at start-up; resolve leaves them "auto".
RUNTIME_AUTO = ("zero_optimization.offload_optimizer.ratio", "offload.stream_state", "zero_optimization.sub_group_size")
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_HIDDEN_DERIVED = {
    # Hugging Face's integration sizes these from the model's hidden size.
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def config_fields() -> list[FieldInfo]:
    """Every key of the schema (scheduler params of every type), for docs and tests."""
    return list(iter_fields(Config, variants=_VARIANTS))


def _index_key_homes() -> None:
    for info in config_fields():
        if "." in info.path:
            homes = KEY_HOMES.setdefault(info.path.rsplit(".", 1)[1], [])
            if info.path not in homes:
                homes.append(info.path)


def _schema_default(path: str, raw: dict[str, Any], leaves: dict[str, FieldInfo]) -> Any:
    if path.startswith("scheduler.params."):
        params_cls = SCHEDULER_PARAMS[raw["scheduler"]["type"]]
        f = {f.name: f for f in dataclasses.fields(params_cls)}[path.rsplit(".", 1)[1]]
        return f.default
    return leaves[path].default


def _set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = raw
    for p in parents:
        node = node[p]
    node[last] = value


def _batch_rule(train: int | None, micro: int | None, accum: int | None, world: int,
                notes: list[str]) -> tuple[int, int, int]:
    """DeepSpeed's rule train = micro x accum x world: derive what is missing, refuse contradictions."""
    def bad(msg: str) -> ConfigError:
        return ConfigError("train_batch_size", f"{msg} (DeepSpeed's rule: train_batch_size = "
                                               "train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                                               f"world size, and world size is {world})")
    if train is None and micro is None:
        if accum is not None:
            raise bad("gradient_accumulation_steps alone does not fix the batch; give train_batch_size or "
                      "train_micro_batch_size_per_gpu too")
        notes.append("no batch size given; using train_micro_batch_size_per_gpu 1, gradient_accumulation_steps 1")
        micro, accum = 1, 1
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * world:
            raise bad(f"{train} != {micro} x {accum} x {world} = {micro * accum * world}")
        return train, micro, accum
    if train is not None and micro is not None:
        if train % (micro * world):
            raise bad(f"{train} is not divisible by micro batch {micro} x world size {world}")
        return train, micro, train // (micro * world)
    if train is not None and accum is not None:
        if train % (accum * world):
            raise bad(f"{train} is not divisible by accumulation steps {accum} x world size {world}")
        return train, train // (accum * world), accum
    if micro is not None:
        accum = accum if accum is not None else 1
        return micro * accum * world, micro, accum
    assert train is not None
    if train % world:
        raise bad(f"{train} is not divisible by world size {world}")
    return train, train // world, 1


def _undot(raw: Mapping[str, Any], notes: list[str]) -> Mapping[str, Any]:
    """A top-level key written as a dotted path (``"zero_optimization.reduce_bucket_size"``, as TRL's
    ``prepare_deepspeed`` and accelerate's ``ds_key_long`` write them) is that nested key: DeepSpeed itself ignores
    such a key silently; here it acts, and the note says so."""
    dotted = [k for k in raw if isinstance(k, str) and "." in k]
    if not dotted:
        return raw
    nested: dict[str, Any] = copy.deepcopy({k: v for k, v in raw.items() if k not in dotted})
    for key in dotted:
        *parents, leaf = key.split(".")
        section = nested
        for i, part in enumerate(parents):
            child = section.setdefault(part, {})
            if not isinstance(child, Mapping):
                raise ConfigError(".".join(parents[:i + 1]), f"is {child!r}, not a section, so {key!r} cannot set "
                                                              f"a key inside it")
            section[part] = child = dict(child)
            section = child
        value = raw[key]
        if isinstance(value, float) and math.isfinite(value) and value != int(value):
            value = int(value)  # TRL writes 0.9 * hidden_size ** 2 for a bucket's element count
            notes.append(f"{key} = {raw[key]!r} is a count of elements; read as {value}")
        section[leaf] = value
    notes.append(f"dotted keys read as nested ones: {', '.join(sorted(dotted))}")
    return nested


def _rewrite_legacy(raw: Mapping[str, Any], notes: list[str]) -> Mapping[str, Any]:
    """DeepSpeed's deprecated zero_optimization booleans, rewritten to the offload sections; an Adagrad section
    without eps takes DeepSpeed's Adagrad default (1e-10, not Adam's 1e-8); ``steps_per_print`` infinite (how
    accelerate's DeepSpeed path silences DeepSpeed's log) is unset, never."""
    if raw.get("steps_per_print") == math.inf:
        raw = {**raw, "steps_per_print": None}
    raw = _undot(raw, notes)
    optimizer = raw.get("optimizer")
    if (isinstance(optimizer, Mapping) and str(optimizer.get("type", "")).lower() == "adagrad"
            and "eps" not in (optimizer.get("params") or {})):
        raw = {**raw, "optimizer": {**optimizer, "params": {**(optimizer.get("params") or {}), "eps": 1e-10}}}
    zero = raw.get("zero_optimization")
    legacy = ("cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory")
    if not isinstance(zero, Mapping) or not any(k in zero for k in legacy):
        return raw
    rewritten = copy.deepcopy(dict(raw))
    zero = rewritten["zero_optimization"] = dict(zero)
    for key, target in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        if key not in zero:
            continue
        value = zero.pop(key)
        path = f"zero_optimization.{key}"
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        existing = zero.get(target)
        if isinstance(existing, Mapping) and existing.get("device", "none") not in ("none", "cpu" if value else "none"):
            raise ConfigError(path, f"contradicts zero_optimization.{target}.device = {existing.get('device')!r}; "
                                    f"keep only {target}")
        if value:
            zero[target] = {**(existing if isinstance(existing, Mapping) else {}), "device": "cpu"}
        notes.append(f"{path} is deprecated; read as zero_optimization.{target}.device = "
                     f"{'cpu' if value else 'none'}")
    if "cpu_offload_use_pin_memory" in zero:
        value = zero.pop("cpu_offload_use_pin_memory")
        path = "zero_optimization.cpu_offload_use_pin_memory"
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        for target in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(target), Mapping):
                zero[target] = {**zero[target], "pin_memory": value}
        notes.append(f"{path} is deprecated; read as pin_memory = {str(value).lower()} on the offload sections")
    return rewritten


def _read_json(source: str | os.PathLike[str]) -> Any:
    text = os.fspath(source)
    if isinstance(source, str) and text.lstrip().startswith("{"):
        where, body = "config JSON", text
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise ConfigError("", f"config file {text!r} does not exist (give a path to a JSON file, a JSON "
                                  "string or a dict)")
        if not path.is_file():
            raise ConfigError("", f"config path {text!r} is not a file")
        where, body = f"config file {text!r}", path.read_text()
    try:
        raw = json.loads(body, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError("", f"{where} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except _DuplicateKey as e:
        raise ConfigError(e.key, f"given twice in {where}; keep one") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{where} must hold a JSON object, got {type(raw).__name__}")
    return raw


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


_index_key_homes()
