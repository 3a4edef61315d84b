"""A job asked to stop (a scheduler's SIGTERM, a Ctrl-C, or its own loop) ends after a step every rank agrees on.

[Note: stopping at an agreed step] A stop request only marks this rank (``StopRequest.request``); nothing is
interrupted, so a signal that lands inside a backward hook, an NVMe transfer or a checkpoint's write lets that work
finish. The request travels with the next step's gradient-norm all-reduce (one more number in a reduction every step
makes anyway: no collective of its own), so every rank learns in the same step() that some rank was asked to stop,
and ``Engine.should_stop`` turns true on all of them after that step. torchrun forwards a signal to every worker,
but one that reaches a single rank (a kill aimed at one process) stops them all at the same step just the same. What
follows is the loop's: ``offload train`` and ``offload.hf.Trainer`` save a checkpoint of that step, close the
engine and exit with the signal's conventional status (128 + its number: 143 for SIGTERM, 130 for SIGINT). A
second signal does not wait: the handler gives the signal back to its previous handler (SIGINT's raises
KeyboardInterrupt, SIGTERM's ends the process), and a checkpoint being written is left unpublished, so the last
complete one is what ``latest`` names (training checkpoints are all or nothing: offload/files/
training_checkpoint.py).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

logger = logging.getLogger("offload.engine")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stop(enum.Enum):
    """RUNNING -> REQUESTED (this rank was asked) -> AGREED (every rank knows, after a step); REQUESTED may also be
    reached from another rank's request, at AGREED directly."""

    RUNNING = "running"
    REQUESTED = "requested"
    AGREED = "agreed"


@dataclass
class StopRequest:
    """One engine's stop request on one rank. ``request`` may run in a signal handler: it only sets fields."""

    state: Stop = Stop.RUNNING
    reason: str = ""  # what asked: "SIGTERM", "SIGINT", or the loop's own words
    signum: int | None = None  # the signal that asked, if one did (the exit status follows it)
    step: int | None = None  # the step after which the ranks agreed to stop

    def request(self, reason: str, signum: int | None = None) -> None:
        """Ask to stop after the next step; idempotent (the first reason stays)."""
        if self.state is Stop.RUNNING:
            self.state, self.reason, self.signum = Stop.REQUESTED, reason, signum

    @property
    def requested(self) -> bool:
        """This rank was asked (what it adds to the next step's agreement)."""
        return self.state is not Stop.RUNNING

    def agreed(self, step: int, by_peer: bool) -> None:
        """The step's agreement found a request on some rank (``by_peer``: not on this one): stop after ``step``."""
        if self.state is Stop.AGREED:
            return
        if self.state is Stop.RUNNING and by_peer:
            self.reason = "a request on another rank"
        self.state, self.step = Stop.AGREED, step

    @property
    def exit_status(self) -> int:
        """The conventional status of a process ended by the signal that asked (0 where none did)."""
        return 128 + self.signum if self.signum is not None else 0


class SignalStop:
    """SIGTERM and SIGINT become a stop request while installed (a context manager); a second one of either is
    given back to the handler that was there before, so it stops at once (see [Note: stopping at an agreed step]).
    Only the main thread can install signal handlers; elsewhere this does nothing and says so once."""

    def __init__(self, target: Any) -> None:
        """``target``: what takes the request (an Engine, or anything with ``request_stop(reason, signum)``)."""
        self.target = target
        self._previous: dict[int, Any] = {}
        self._seen = 0

    def install(self) -> SignalStop:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("stop on signals: not the main thread, so SIGTERM and SIGINT keep their own handlers")
            return self
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> SignalStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._seen += 1
        name = signal.Signals(signum).name
        if self._seen == 1:
            self.target.request_stop(name, signum)
            if getattr(getattr(self.target, "group", None), "rank", 0) == 0:  # os.write: safe inside a handler
                os.write(2, f"\noffload: {name}: stopping after this step, with a checkpoint where the job saves "
                            f"one; {name} again stops at once\n".encode())
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt here
        elif signum == signal.SIGINT:
            # SIGINT ignored when the process started (bash starts a background job so, and Python then leaves it
            # ignored): the second one still stops at once, as the first one's line promised
            raise KeyboardInterrupt
        else:  # SIG_DFL (SIGTERM's: the process ends), or SIG_IGN, which would break the same promise
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


class Stoppable:
    """The stop API of ``Engine`` (offload/engine/core.py), a mixin: its step() carries ``stop.requested`` in the
    norm's all-reduce and calls ``_stop_if_agreed`` with what came back."""

    stop: StopRequest
    global_steps: int
    group: Any

    def request_stop(self, reason: str = "the training loop asked", signum: int | None = None) -> None:
        """Ask every rank to stop after the next step (safe from a signal handler: it only sets a flag); the loop
        reads ``should_stop`` after each step() (see [Note: stopping at an agreed step])."""
        self.stop.request(reason, signum)

    @property
    def should_stop(self) -> bool:
        """True on every rank after the same step() once any rank asked to stop: save, close and end there."""
        return self.stop.state is Stop.AGREED

    def stop_on_signals(self) -> SignalStop:
        """``with engine.stop_on_signals():`` SIGTERM and SIGINT ask to stop after the next step; a second one stops
        at once."""
        return SignalStop(self)

    def _stop_if_agreed(self, stop: bool) -> None:
        if stop:
            self.stop.agreed(self.global_steps, by_peer=not self.stop.requested)
            logger.info("rank %d: stopping after step %d (%s)", self.group.rank, self.global_steps, self.stop.reason)
