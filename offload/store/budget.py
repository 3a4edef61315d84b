"""Byte budgets per tier: hard limits, kept by accounting.

A budget is checked twice. At start-up the engine adds up what each tier must hold and
a plan that does not fit is a ConfigError naming the budget and the numbers. While
training every allocation is taken from its tier's account; going over is a bug in
offload (the start-up plan was wrong), raised as BudgetExceeded with the numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from offload.store.tier import Tier


class BudgetExceeded(RuntimeError):
    """An allocation would take a tier past its budget (a bug: start-up planning should prevent it)."""


@dataclass
class TierBudget:
    """One tier's account: what it holds by part, and its limit. ``tier`` is a Tier like every other name of a
    tier (offload/store/tier.py); its value names the budget in the error."""

    tier: Tier
    limit: int | None  # bytes; None: not limited
    used: int = 0
    peak: int = 0
    parts: dict[str, int] = field(default_factory=dict)  # what holds the bytes
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                raise BudgetExceeded(f"{self.tier.value} budget of {self.limit:,} bytes exceeded: {what} needs "
                                     f"{nbytes:,} with {self.used:,} in use ({self._describe()})")
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.parts[what] = self.parts.get(what, 0) + nbytes

    def give(self, nbytes: int, what: str) -> None:
        with self._lock:
            self.used -= nbytes
            self.parts[what] = self.parts.get(what, 0) - nbytes

    def _describe(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in self.parts.items() if v) or "nothing"

    def summary(self) -> dict[str, int]:
        with self._lock:
            out = {k: v for k, v in self.parts.items() if v}
            out["total"] = self.used
            out["peak"] = self.peak
            if self.limit is not None:
                out["budget"] = self.limit
            return out
