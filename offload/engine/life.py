"""Whether the engine takes work: one state, and the transitions that change it."""

from __future__ import annotations

import enum

from offload.engine import errors
from offload.engine.errors import EngineError


class Life(enum.Enum):
    """OPEN -> OUT_OF_STEP when a pass with collectives failed on this rank while the others went on (see [Note:
    one rank's failed pass] in offload/engine/agreement.py); either -> CLOSED by ``Lifetime.close``, which is
    idempotent. OPEN <-> LENT by ``engine.offload_states()`` / ``reload_states()`` (offload/engine/lending.py).
    Only OPEN takes work."""

    OPEN = "open"
    OUT_OF_STEP = "out of step"
    LENT = "states offloaded"  # engine.offload_states() gave the device's memory back until reload_states()
    CLOSED = "closed"


class Lifetime:
    """One engine's life on one rank."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.state = Life.OPEN
        self._why = ""  # OUT_OF_STEP: why this rank's collectives are out of step with the others'

    def check(self) -> None:
        """Raise unless the engine takes work, saying why."""
        if self.state is Life.CLOSED:
            raise EngineError("this engine was closed; create a new one with offload.initialize")
        if self.state is Life.OUT_OF_STEP:
            raise EngineError(self._why)
        if self.state is Life.LENT:
            raise EngineError("this engine's states are offloaded (engine.offload_states()): call "
                              "engine.reload_states() before training, saving or reading its weights")

    def lend(self) -> None:
        """OPEN -> LENT: the states left the device."""
        self.check()
        self.state = Life.LENT

    def reclaim(self) -> None:
        """LENT -> OPEN: the states are back."""
        assert self.state is Life.LENT, f"reclaim from {self.state.value}"
        self.state = Life.OPEN

    def left_collectives(self, where: str, error: BaseException, collectives: bool) -> None:
        """``where`` raised on this rank: with other ranks and collectives in that pass, the others go on without
        it, so the ranks' collectives are out of step and the engine takes no more work; ``error`` says so too."""
        if self.world == 1 or not collectives or self.state is not Life.OPEN:
            return
        self.state, self._why = Life.OUT_OF_STEP, errors.out_of_step(self.rank, where, error)
        if hasattr(error, "add_note"):
            error.add_note(f"offload: {self._why}")

    def close(self) -> bool:
        """Closed from now on; returns whether it was not already (whether there is anything to release)."""
        was_closed, self.state = self.state is Life.CLOSED, Life.CLOSED
        return not was_closed
