"""The engine: ``offload.initialize`` and the Engine it returns.

core.py is the Engine itself (forward, backward, step, state); build.py wires its parts
from the config; accumulation.py is where it stands between steps; memory.py its
per-tier accounting; weights.py whole weights out of it; saving.py its checkpoints;
initialize.py DeepSpeed's entry point.
"""

from offload.engine.core import Engine
from offload.engine.errors import EngineError
from offload.engine.initialize import hidden_size_of, initialize

__all__ = ["Engine", "EngineError", "hidden_size_of", "initialize"]
