"""The engine: ``offload.initialize`` and the Engine it returns.

Its rooms (tests/test_imports.py checks that each module is named here):

- core.py: the Engine itself (forward, backward, step), with two mixins: accessors.py (what DeepSpeed's engine
  answers: batch, clipping, stage, rank, learning rate) and persistence.py (whole-model reads and writes: gathered
  parameters, state dicts, 16-bit saves, training checkpoints); compiling.py, a third, is ``engine.compile()``;
  lending.py, a fourth, ``offload_states()`` / ``reload_states()`` (the device's memory lent back between steps).
- initialize.py: DeepSpeed's entry point (muon_groups.py: the config's type Muon's param groups); build.py wires
  the parts from the config.
- life.py: whether the engine takes work; accumulation.py: where it stands between steps; step_schedule.py: how
  the step runs against backward, chosen once; agreement.py: what the ranks agree on around a step.
- memory.py: the per-tier accounting; rates.py: the machine's rates measured at start-up; refit.py: the split
  corrected by the first step's peak.
- weights.py: whole weights out of a live engine; checkpoint_io.py: which engine state goes into which training
  checkpoint file and back (the format is offload/files/training_checkpoint.py; activation checkpointing is
  offload/checkpointing.py, DeepSpeed's name for it).
- errors.py: the engine's one error type and its messages; stopping.py: a stop request (a signal, the loop) agreed
  by every rank at a step; model_zero_grad.py: the model's own zero_grad() told to the engine.
"""

from offload.engine.core import Engine
from offload.engine.errors import EngineError
from offload.engine.initialize import hidden_size_of, initialize

__all__ = ["Engine", "EngineError", "hidden_size_of", "initialize"]
