"""Where the hooks stand in a backward, and which backward is the engine's own.

[Note: a backward this engine did not start] Autograd runs the hooks for any backward that
reaches the model, not only ``engine.backward``'s: a GAN's generator loss backpropagated
through the discriminator (another engine's backward, or a plain ``loss.backward()``). PyTorch
leaves such gradients in ``.grad``, where the script's ``module.zero_grad()``,
``optimizer.zero_grad()`` or ``p.grad = None`` clears them before the model's own next
backward (DeepSpeedExamples' DCGAN does, at the top of each iteration). Reduced into the
shards, they could not be cleared and would silently join the next step (issue 70). So a
backward the engine did not announce (``begin_backward``) keeps its gradients in ``.grad`` at
every stage (``TrainingState.ACCUMULATING``); what a clear leaves there is reduced with the
engine's next reducing backward, added to its gradients as autograd adds them, as PyTorch
would step on it.
"""

from __future__ import annotations

import enum


class TrainingState(enum.Enum):
    """What the hooks are in the middle of.

    IDLE: no backward is running; a forward's post-hook releases the units it gathered once no use holds them.
    ACCUMULATING and REDUCING: a backward is running (its end-of-backward callback is queued): a unit gathered by
    its pre-backward hook stays until its gradients are in. ACCUMULATING leaves them in ``.grad`` (stages 0-1 before
    the last micro-batch, and any backward the engine did not start), REDUCING reduces each unit's as it is done
    (see [Note: stages] in offload/zero/runtime.py)."""

    IDLE = "idle"
    ACCUMULATING = "backward, accumulating"
    REDUCING = "backward, reducing"


class BackwardState:
    """The hooks' training state, changed only by the transitions below, and what the engine announced of the
    coming backward."""

    def __init__(self) -> None:
        self.state = TrainingState.IDLE
        self._coming = TrainingState.REDUCING  # what the announced backward does with its gradients
        self._announced = False  # engine.backward runs the coming backward (see the note above)

    @property
    def idle(self) -> bool:
        return self.state is TrainingState.IDLE

    def announce(self, reduce: bool) -> None:
        """``engine.backward`` runs the coming backward: it reduces the gradients it produces (``reduce``), or only
        accumulates them (see [Note: stages]). ``returned`` ends it."""
        self._coming = TrainingState.REDUCING if reduce else TrainingState.ACCUMULATING
        self._announced = True

    def returned(self) -> None:
        """``engine.backward``'s backward returned or failed: a later one it did not announce keeps its gradients,
        even where this one never reached the model."""
        self._announced = False

    def begin(self, rank: int) -> None:
        """IDLE -> what the backward beginning now does with its gradients."""
        assert self.idle, f"rank {rank}: a backward begins while {self.state.value}"
        self.state = self._next()

    def end(self) -> None:
        """-> IDLE: the backward ended, or failed (idempotent)."""
        self.state = TrainingState.IDLE

    def reduces(self) -> bool:
        """Whether the gradients now arriving are reduced (outside a backward the hooks saw begin: as the next
        one's would be)."""
        return (self._next() if self.idle else self.state) is TrainingState.REDUCING

    def _next(self) -> TrainingState:
        return self._coming if self._announced else TrainingState.ACCUMULATING
