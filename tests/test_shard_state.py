"""[Note: shard phases] (offload/optim/shard_state.py): a shard's phase changes only through its named transitions,
and each refuses to leave a phase it does not start from, naming the unit (a wrong order fails where it happens,
not as a wrong step later)."""

import pytest
import torch

from offload.optim.adam import AdamHyper
from offload.optim.shard_state import Guess, ShardPhase, ShardState

E, H, SP, ST = ShardPhase.EMPTY, ShardPhase.HOLDING, ShardPhase.SPECULATED, ShardPhase.STEPPED
GUESS = Guess(0.5, (AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),), 1)


def shard_in(phase: ShardPhase, kept: bool = False) -> ShardState:
    """A four-element shard brought to ``phase`` by its own transitions (``kept``: its gradient kept as it landed,
    as a device-stepped unit's is)."""
    state = ShardState(3, "layers.3", None, [], numel=4)
    if phase is not E:
        if kept:
            state.keep_landed(torch.ones(4), 1.0, threads=1)
        else:
            state.add(torch.ones(4), 1.0, threads=1)
    if phase is SP:
        state.speculated(GUESS)
    elif phase is ST:
        state.stepped()
    assert state.phase is phase
    return state


# transition -> (the phases it may leave, the phase it leads to)
TRANSITIONS = {
    "add": ({E, H}, H),
    "keep_landed": ({E, H}, H),
    "read_in_place": ({E, H}, H),
    "took_norm": ({H}, H),
    "speculated": ({H}, SP),
    "settled": ({SP}, SP),
    "stale": ({SP}, H),
    "stepped": ({H}, ST),
    "moved_to_device": ({E}, E),
}


def call(state: ShardState, name: str) -> None:
    args = {"add": (torch.ones(4), 0.5, 1), "keep_landed": (torch.ones(4), 0.5, 1),
            "read_in_place": (torch.ones(4), 0.5), "took_norm": ([],), "speculated": (GUESS,),
            "moved_to_device": (None,)}.get(name, ())
    getattr(state, name)(*args)


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
@pytest.mark.parametrize("start", [E, H, SP, ST], ids=lambda p: p.value)
def test_a_transition_checks_the_phase_it_leaves(name, start):
    allowed, to = TRANSITIONS[name]
    state = shard_in(start, kept=name == "keep_landed")
    if start in allowed:
        call(state, name)
        assert state.phase is to
    else:
        with pytest.raises(AssertionError, match=rf"unit 'layers.3': .* from {start.value} \(only from"):
            call(state, name)
        assert state.phase is start  # refused: nothing changed


def test_unstep_steps_again_only_what_a_pass_stepped_or_speculated():
    for start, to in [(E, E), (H, H), (SP, H), (ST, H)]:
        state = shard_in(start)
        state.unstep()
        assert state.phase is to and state.guessed is None


def test_a_gradient_read_in_place_goes_into_the_accumulator_with_its_factor():
    state = shard_in(E)
    state.read_in_place(torch.full((4,), 3.0, dtype=torch.bfloat16), 0.5)
    assert state.grad is None and state.gradient()[1] == 0.5
    state.materialize(threads=1)
    assert state.phase is H and state.landed is None and torch.equal(state.grad, torch.full((4,), 1.5))
    state.add(torch.ones(4), 0.25, threads=1)  # a second gradient adds
    assert torch.equal(state.gradient()[0], torch.full((4,), 1.75))


def test_empty_forgets_the_step_but_keeps_the_buffers():
    state = shard_in(SP)
    state.empty()
    assert (state.phase, state.norm, state.landed, state.guessed) == (E, None, None, None)
    assert state.grad is not None  # the accumulator is reused by the next step
