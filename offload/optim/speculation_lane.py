"""The host thread the speculative step's Adam runs on, and who gets to touch a shard while it is queued there.

[Note: speculation on a lane of its own] On the landing worker, each shard's speculative Adam
ran right after its landing norm, so the two took turns: on an H200 (156M GPT) 9.5 ms of norms
and 41 ms of Adam a step, one after the other from the first landing, against a backward of
21 ms, and ``step()`` waited 35 ms for the last norm, queued behind the Adam of every shard
before it. So the speculation runs on a thread of its own, and the landing worker only hands
each shard over (a ``Ticket``). The step needs only the landings to know the factor; then, in
the next forward's order, it claims each shard: a speculation not yet begun is cancelled and
the shard stepped there and then with the real factor (the forward's first units land last, in
backward's order, so waiting for their speculation would wait for every other one first); one
that has begun is waited for and kept or recomputed. Anything else that touches a shard's
gradient or state first claims it the same way (another gradient of the unit landing, a sum
sent down again), and everything that drains the optimizer drains this thread too. Claims and
the thread's start of a ticket take one lock, so a ticket runs whole or not at all; the same
kernel on the same values either way, so the step is bitwise the one after backward. A
speculation that fails is left to the step (its 16-bit copy restored, the shard HOLDING), so
the lane never dies with shards half settled behind it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from offload.machine.accelerator import Accelerator, Event


class TicketPhase(enum.Enum):
    """QUEUED -> RUNNING -> DONE, or QUEUED -> CANCELLED (claimed before the thread reached it)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


@dataclass
class Ticket:
    """One shard's speculation handed to the lane."""

    phase: TicketPhase = TicketPhase.QUEUED


class SpeculationLane:
    """A host queue of speculative Adam calls, one ticket per shard and step (see the note above)."""

    def __init__(self, accel: Accelerator) -> None:
        self.accel = accel
        self._queue = accel.host_queue("speculate")
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._finished: dict[int, Event] = {}  # the lane's record after each unit's latest ticket (re-recorded)

    def hand_over(self, unit: int, work: Callable[[], None]) -> None:
        """On the landing worker: ``work`` (unit's speculative Adam) runs on the lane unless claimed first. The
        unit's earlier ticket was claimed already (its gradient landed again only after a claim)."""
        ticket = Ticket()
        self._queue.run(lambda: self._run(ticket, work))
        self._finished[unit] = self._queue.record(into=self._finished.get(unit))
        self._tickets[unit] = ticket  # last: a claim that finds it finds the event of its run

    def _run(self, ticket: Ticket, work: Callable[[], None]) -> None:
        with self._lock:
            if ticket.phase is not TicketPhase.QUEUED:
                return
            ticket.phase = TicketPhase.RUNNING
        try:
            work()
        finally:
            with self._lock:
                ticket.phase = TicketPhase.DONE

    def claim(self, unit: int) -> TicketPhase | None:
        """Before another thread touches unit's gradient or optimizer state: its speculation is cancelled if the
        lane has not begun it, else waited for. Returns CANCELLED (it never ran), DONE (it ran), or None (nothing
        was handed over). The work handed over must not raise (a failed speculation is the step's to redo); if it
        does, the lane stops and this raises its error."""
        ticket = self._tickets.pop(unit, None)
        if ticket is None:
            return None
        with self._lock:
            was = ticket.phase
            if was is TicketPhase.QUEUED:
                ticket.phase = TicketPhase.CANCELLED
                return TicketPhase.CANCELLED
        if was is TicketPhase.RUNNING:
            self.accel.wait(self._finished[unit], "a shard's speculative Adam")
        return TicketPhase.DONE

    def drain(self) -> None:
        """Every speculation handed over so far has run (or was cancelled)."""
        self.accel.drain(self._queue, "speculations drained")
