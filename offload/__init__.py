"""offload: train PyTorch models larger than GPU memory over a GPU / host / NVMe tiered store."""

from offload.config import Config, ConfigError, load_config
from offload.engine import Engine, EngineError, initialize
from offload.version import __version__

__all__ = ["Config", "ConfigError", "Engine", "EngineError", "__version__", "initialize", "load_config"]
