"""The prefetch trace: the order units are needed in one iteration, and what to fetch ahead in the next.

An iteration is one forward and its backward (one micro-batch). While it runs, every
unit that has to be brought in is recorded in order. The next iteration compares its
needs with that record as they come: while they agree, the units recorded next are
fetched ahead of use, as far as the lookahead and the gathered-elements limit allow;
at the first disagreement (control flow that changed) it stops prefetching for the rest
of that iteration, fetches on demand, and what it records becomes the new trace. A
wrong guess therefore costs a wasted gather, never a wrong result; and because every
rank runs the same graph, every rank makes the same guesses, so the collectives they
issue stay in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefetchTrace:
    lookahead: int  # elements gathered ahead of use at most (stage3_prefetch_bucket_size); 0: off
    trace: list[int] = field(default_factory=list)  # unit indices, the last complete iteration
    recording: list[int] = field(default_factory=list)
    position: int = 0
    following: bool = False
    iterations: int = 0
    mismatches: int = 0  # iterations that left their trace (changed order)

    def begin_iteration(self) -> None:
        if self.recording:
            self.trace, self.recording = self.recording, []
        self.position = 0
        self.following = self.lookahead > 0 and bool(self.trace)
        self.iterations += 1

    def needed(self, unit: int) -> list[int]:
        """Record that ``unit`` is needed now; the units the trace says come next (empty when not following)."""
        self.recording.append(unit)
        if not self.following:
            return []
        if self.position < len(self.trace) and self.trace[self.position] == unit:
            self.position += 1
            return self.trace[self.position:]
        self.following = False
        self.mismatches += 1
        return []
