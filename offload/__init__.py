"""offload: train PyTorch models larger than GPU memory over a GPU / host / NVMe tiered store."""

from offload import comm, ops, utils, zero  # noqa: E402 - DeepSpeed's deepspeed.ops, .utils and .zero, over the engine
from offload.comm import init_distributed
from offload.config import Config, ConfigError, load_config
from offload.config.arguments import add_config_arguments
from offload.engine import Engine, EngineError, initialize
from offload.version import __version__

DeepSpeedEngine = Engine  # DeepSpeed's name for the engine class, for a script's isinstance checks

__all__ = ["Config", "ConfigError", "DeepSpeedEngine", "Engine", "EngineError", "__version__",
           "add_config_arguments", "comm", "init_distributed", "initialize", "load_config", "ops", "utils", "zero"]
