"""DeepSpeed-format configs as typed dataclasses; every bad key is a ConfigError naming its path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .fields import AUTO, Auto, ConfigError, FieldInfo, NoEffect, Support
from .load import Config, config_fields
from .sections import (
    ActivationCheckpointingConfig,
    AdamParams,
    AioConfig,
    BF16Config,
    BudgetsConfig,
    CheckpointConfig,
    FP16Config,
    OffloadExtConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    ZeroConfig,
)


def load_config(source: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
    """Shorthand for :meth:`Config.load` (a path, a JSON string, a dict or a Config)."""
    return Config.load(source)


__all__ = [
    "AUTO", "ActivationCheckpointingConfig", "AdamParams", "AioConfig", "Auto", "BF16Config", "BudgetsConfig",
    "CheckpointConfig", "Config", "ConfigError", "FP16Config", "FieldInfo", "NoEffect", "OffloadExtConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "Support",
    "WarmupCosineLRParams", "WarmupDecayLRParams", "WarmupLRParams", "ZeroConfig", "config_fields", "load_config",
]
