"""A DeepSpeed-format config's ``"auto"`` values, resolved from ``TrainingArguments`` as Hugging Face resolves them.

Users move from ``Trainer(args=TrainingArguments(deepspeed="ds_config.json"))`` to
``offload.hf.Trainer(..., offload_config="ds_config.json")`` with the same file, so the
same file must mean the same thing: each key below is filled from the same argument by
the same rule as transformers' DeepSpeed integration (``HfTrainerDeepSpeedConfig``).
An ``"auto"`` value is replaced; any other value must equal the argument's, or the
config is refused with every mismatch named (``- ds <key>=<value> vs hf <argument>=<value>``);
a key that is absent stays absent, except the micro-batch and accumulation, which the
Trainer's loop decides (absent, they are filled as ``"auto"`` would be), and clipping:
absent, it is ``max_grad_norm``'s, as the plain Trainer clips (DeepSpeed would clip at its default, 1.0),
with a warning that says so; ``bf16``/``fp16`` asked for by the arguments add their
section when it is absent, as accelerate adds it for DeepSpeed. Keys filled only
where ``"auto"`` (never compared): ``warmup_min_lr``, and the bucket and persistence sizes
derived from the model's width.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from torch import nn

logger = logging.getLogger("offload.hf")


class ConfigMismatch(ValueError):
    """A value of the config that contradicts TrainingArguments; the message names both."""


class _Filler:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, key: str) -> tuple[dict[str, Any] | None, str]:
        *path, leaf = key.split(".")
        node: Any = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node, leaf) if isinstance(node, dict) else (None, leaf)

    def is_auto(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and node.get(leaf) == "auto"

    def is_true(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and bool(node.get(leaf))

    def match(self, key: str, value: Any, argument: str, must_match: bool = True) -> None:
        node, leaf = self._node(key)
        if node is None:
            return
        if node.get(leaf) == "auto":
            node[leaf] = value
        elif must_match and node.get(leaf) is not None and node.get(leaf) != value:
            self.mismatches.append(f"- ds {key}={node.get(leaf)} vs hf {argument}={value}")

    def only(self, key: str, value: Any) -> None:
        self.match(key, value, "", must_match=False)


def resolve(config: dict[str, Any], args: Any, model: nn.Module, num_training_steps: int) -> dict[str, Any]:
    """``config`` (not modified) with its ``"auto"`` values filled from ``args`` (TrainingArguments), ``model`` (its
    width) and ``num_training_steps``; ConfigMismatch names every value that contradicts an argument."""
    f = _Filler(copy.deepcopy(config))
    auto_batch = bool(getattr(args, "auto_find_batch_size", False))
    f.match("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size",
            not auto_batch)
    f.match("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    f.match("train_batch_size",
            args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
            "train_batch_size (calculated)", not auto_batch)
    f.match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    # The Trainer's loop decides the batch and where an accumulation ends, so absent batch keys follow its
    # arguments as "auto" does (DeepSpeed refuses a config without them; an engine left at its defaults of one
    # would step at every micro-batch of the loop's accumulation).
    f.config.setdefault("train_micro_batch_size_per_gpu", args.per_device_train_batch_size)
    f.config.setdefault("gradient_accumulation_steps", args.gradient_accumulation_steps)
    if "gradient_clipping" not in f.config and args.max_grad_norm:
        # The plain Trainer clips at max_grad_norm (1.0 unless set); DeepSpeed, given no gradient_clipping, clips at
        # its default 1.0 whatever max_grad_norm says. Clip as the Trainer would, and say so.
        f.config["gradient_clipping"] = args.max_grad_norm
        logger.warning("offload config: no gradient_clipping, so gradients are clipped at max_grad_norm=%s as "
                       "the Trainer clips them (DeepSpeed would clip at its default, 1.0); set gradient_clipping "
                       "to 0 (or max_grad_norm to 0) to turn clipping off", args.max_grad_norm)
    f.match("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    f.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.only("scheduler.params.warmup_min_lr", 0)
    f.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    f.match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    f.match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    for kind in ("fp16", "bf16"):  # an argument asking for it adds the section, as accelerate does for DeepSpeed
        if getattr(args, kind) and kind not in f.config:
            f.config[kind] = {"enabled": True}
    width_keys = ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                  "zero_optimization.stage3_param_persistence_threshold"]
    if any(f.is_auto(k) for k in width_keys):
        hidden = _hidden_size(model)
        if hidden is None:
            raise ConfigMismatch(
                "the model's config has neither hidden_size nor hidden_sizes, so these \"auto\" values cannot be "
                f"derived from its width: {[k for k in width_keys if f.is_auto(k)]}; give them numbers")
        f.only("zero_optimization.reduce_bucket_size", hidden * hidden)
        if f.config.get("zero_optimization", {}).get("stage") == 3:
            f.only("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
            f.only("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    f.match("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    f.match("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if f.mismatches:
        raise ConfigMismatch("the offload config contradicts TrainingArguments:\n" + "\n".join(f.mismatches) +
                             "\nSet these keys to \"auto\" (or to the arguments' values), as with DeepSpeed")
    return f.config


def _hidden_size(model: nn.Module) -> int | None:
    """The width Hugging Face's integration sizes buckets by: hidden_size, the largest of hidden_sizes, or the
    text config's."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if getattr(source, "hidden_size", None) is not None:
            return int(source.hidden_size)
        if getattr(source, "hidden_sizes", None):
            return int(max(source.hidden_sizes))
    return None
