"""offload: train PyTorch models larger than GPU memory over a GPU / host / NVMe tiered store."""

from offload.config import Config, ConfigError, load_config
from offload.engine import Engine, EngineError, initialize

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Engine", "EngineError", "__version__", "initialize", "load_config"]
