"""Where the engine stands between two optimizer steps: the micro-batches accumulated so far.

[Note: the accumulation phase] After a step (or zero_grad, or a load) the engine is
EMPTY. Each backward adds one micro-batch: COLLECTING until gradient_accumulation_steps
of them are in, then at the BOUNDARY, where step() applies them and the engine is EMPTY
again (step() elsewhere is a no-op, as in DeepSpeed). A caller may end an accumulation
early (``end_early``: the coming backward is its last, as at the end of an epoch whose
batches are not a multiple of the count; DeepSpeed's ``set_gradient_accumulation_boundary``).
A step that fails before it
applies anything goes back to the BOUNDARY so that calling step() again retries it. A
save is refused unless EMPTY: the files would not hold the gradients collected.

[Note: zero_grad between micro-batches] Scripts written for DeepSpeed call
``engine.zero_grad()`` before every micro-batch. DeepSpeed's clears ``.grad`` and nothing
else: at stages 2-3 the earlier micro-batches are already reduced into the partitions, so
the accumulation goes on; at stages 0-1 they still sit in ``.grad`` and are lost, but the
count goes on and the boundary steps with the later ones. The engine does the same (and
says so once at stages 0-1). Once the accumulation is complete (COLLECTING no more),
``zero_grad`` instead of ``step`` drops it, as a torch loop that skips a batch expects;
``discard_gradients`` drops it at any phase.

[Note: more backward calls than micro-batches] A GAN's discriminator takes two losses from
two forward passes, ``engine.backward`` on each, then one ``engine.step()``; PyTorch steps on
their sum. So a backward at the BOUNDARY (the accumulation complete, step() not yet called)
adds to the accumulation as one more micro-batch, scaled as every one is, and step() applies
them all, as DeepSpeed's stage 0 does (its stage 2 keeps only the last call's: wrong by
PyTorch, not followed). What a backward that completes the accumulation does early is undone
by such a call where it can be: its gradients left where they landed are added up, their
norms are taken again, stages 0-1 reduce this one too. What cannot be undone is an update
that already ran during that backward (the overlapped or speculative step), so the engine
steps during a backward only when it is surely the step's last: the user said so
(``end_early``), or the loop has shown how many calls make its steps (``calls_per_step``, the
most any step took; never before the first step) and this is the last of them. A step whose
calls grow past that after an update began is refused with an error that names the call,
before that backward runs: its gradient is not taken, and step() applies the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from offload.engine.errors import EngineError


class Phase(enum.Enum):
    EMPTY = "empty"
    COLLECTING = "collecting"
    BOUNDARY = "boundary"


@dataclass
class Accumulation:
    steps: int  # gradient_accumulation_steps
    pending: int = 0  # micro-batches since the last step
    micro_steps: int = 0  # every step() call since the start, as DeepSpeed counts them (a checkpoint keeps it)
    early: bool = False  # the coming (or last) backward ends this accumulation, however many are in
    stepped: bool = True  # step() was called after the last backward (so "the current micro-batch" is the next)
    # The most backward calls a step took (None before the first): see [Note: more backward calls than
    # micro-batches].
    calls_per_step: int | None = None
    _taken: int = 0  # the calls the step under way took (a retry restores them)

    @property
    def phase(self) -> Phase:
        if self.pending == 0:
            return Phase.EMPTY
        return Phase.BOUNDARY if self.pending >= self.steps or self.early else Phase.COLLECTING

    def next_is_last(self) -> bool:
        """The coming backward completes the accumulation (or, past it, adds to it: see [Note: more backward calls
        than micro-batches])."""
        return self.early or self.pending + 1 >= self.steps

    def next_surely_last(self) -> bool:
        """The coming backward is the step's last for sure, so an update may begin during it: the user ended the
        accumulation early, or the loop's calls per step are known and this is the last of them."""
        if self.early:
            return True
        return self.calls_per_step is not None and self.pending + 1 >= max(self.steps, self.calls_per_step)

    def next_is_only(self) -> bool:
        """The coming backward is the step's only one as far as is known (its gradients may be read where they
        land: a later call adds them up first)."""
        return self.pending == 0 and max(self.steps, self.calls_per_step or 1) == 1

    def next_adds_past_boundary(self) -> bool:
        """The coming backward adds to an accumulation that was already complete."""
        return self.pending > 0 and self.phase is Phase.BOUNDARY

    def end_early(self, ends: bool = True) -> None:
        """The coming backward ends the accumulation with fewer micro-batches than ``steps`` (``ends`` false:
        it does not, after all)."""
        if self.pending and self.phase is Phase.BOUNDARY:
            raise EngineError("the accumulation is complete: call step() before ending another one")
        self.early = ends

    def add(self) -> None:
        self.pending += 1
        self.stepped = False

    def current_ends(self) -> bool:
        """Whether the current micro-batch ends the accumulation, as DeepSpeed's is_gradient_accumulation_boundary
        answers: the one whose backward ran, until step() is called; then the coming one."""
        return self.phase is Phase.BOUNDARY if not self.stepped else self.next_is_last()

    def take(self) -> bool:
        """step() begins: whether it applies (at the boundary; the phase is EMPTY after) or is a no-op."""
        if self.phase is Phase.EMPTY:
            raise EngineError("step() was called without a backward() since the last step; call "
                              "engine.backward(loss) first")
        self.stepped = True
        self.micro_steps += 1
        if self.phase is Phase.COLLECTING:
            return False
        self._taken, self.calls_per_step = self.pending, max(self.pending, self.calls_per_step or 0)
        self.pending, self.early = 0, False
        return True

    def retry(self) -> None:
        """The step failed before applying anything: its gradients are intact, and step() retries it."""
        self.pending, self.stepped = max(self._taken, self.steps), False
        self.micro_steps -= 1  # the failed call did not count

    def clear(self) -> None:
        self.pending, self.early, self.stepped = 0, False, True

    def check_save(self) -> None:
        if self.phase is not Phase.EMPTY:
            raise EngineError(f"save_checkpoint() between micro-batches ({self.pending} of {self.steps} "
                              "accumulated) would lose their gradients; call it after engine.step() at an "
                              "accumulation boundary")
