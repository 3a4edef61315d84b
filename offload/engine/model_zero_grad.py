"""The model's own ``zero_grad()``, told to its engine.

[Note: the model's own zero_grad] A script's ``model.zero_grad()`` clears ``.grad``, which is all it clears in
PyTorch. What a stage keeps there (stages 0-1 between micro-batches, a backward the engine did not start: see [Note:
a backward this engine did not start] in offload/zero/backward_state.py) it clears as it is. Gradients already
reduced into the shards it cannot reach, so the engine wraps the model's method on the instance (``close`` takes it
off): once the accumulation is complete and step() has not run, it drops them as ``engine.zero_grad()`` does (the
result PyTorch gives); between micro-batches at stages 2-3, where the count of micro-batches goes on and nothing can
be dropped alone, it says so once. ``p.grad = None`` there is not seen.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Protocol

from torch import nn

from offload.engine.accumulation import Accumulation, Phase
from offload.zero.stage import Stage

logger = logging.getLogger("offload.engine")


class Engine(Protocol):
    """What of the engine a ``zero_grad`` call reads and drops."""

    module: nn.Module
    accumulation: Accumulation
    stage: Stage

    def discard_gradients(self) -> None: ...


class ModelZeroGrad:
    """The engine's side of its model's ``zero_grad``: what a call drops or says, and the wrapper it installs."""

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)
        self._model = engine.module
        self._warned = False
        self._model.zero_grad = _Watched(self._model, self)  # type: ignore[method-assign]

    def cleared(self) -> None:
        """The model's ``zero_grad`` is about to clear ``.grad``."""
        engine = self._engine()
        if engine is None:
            return
        acc = engine.accumulation
        if acc.phase is Phase.BOUNDARY:
            engine.discard_gradients()
        elif acc.phase is Phase.COLLECTING and engine.stage.reduce_every_micro_batch and not self._warned:
            self._warned = True
            logger.warning("model.zero_grad() after %d of %d micro-batches cannot clear their gradients: ZeRO stage %d "
                           "has reduced them into the shards already, so the step applies them with the later ones "
                           "(PyTorch would drop them). engine.discard_gradients() drops the whole accumulation; "
                           "zero_grad() after engine.step() clears nothing the step needs (said once)",
                           acc.pending, acc.steps, engine.stage.number)

    def close(self) -> None:
        """The model's own method again."""
        if isinstance(vars(self._model).get("zero_grad"), _Watched):
            del self._model.zero_grad


class _Watched:
    """A model's own ``zero_grad``, telling its engine first."""

    def __init__(self, model: nn.Module, watch: ModelZeroGrad) -> None:
        self._model, self._watch = model, watch

    def __call__(self, set_to_none: bool = True) -> None:
        self._watch.cleared()
        type(self._model).zero_grad(self._model, set_to_none)

    def __reduce__(self) -> tuple[Any, ...]:
        """A copied (or pickled) model takes its own method along, not the engine."""
        return functools.partial, (type(self._model).zero_grad, self._model)
