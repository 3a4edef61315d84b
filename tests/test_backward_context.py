"""The main thread keeps its last backward's context ([Note: the backward's context]), so that no gloo worker is
the last to hold it when a rank's interpreter finalizes (the exit abort; tools/exit_abort_stress.py counts it)."""

import subprocess
import sys
import textwrap

import torch.distributed as dist
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.machine.launch import run_ranks

# Which backward's context (a Mark in a context variable, set only around the backward) is released when, and on
# which thread. One process, no group: what the hold changes is deterministic here.
ONE_PROCESS = textwrap.dedent("""
    import contextvars, sys, threading, torch
    from offload.machine.backward_context import hold_on_main_thread
    if sys.argv[1] == "held":
        hold_on_main_thread()
    events, var = [], contextvars.ContextVar("mark")
    class Mark:
        def __init__(self, step): self.step = step
        def __del__(self): events.append((self.step, threading.current_thread() is threading.main_thread()))
    w = torch.ones(3, requires_grad=True)
    for step in range(3):
        token = var.set(Mark(step))
        (w * 2).sum().backward()
        var.reset(token)
        events.append(("after", step))
    print(events)
""")


def _events(mode: str) -> list:
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS, mode], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # a list of tuples of ints, strs and bools


def test_the_main_thread_holds_the_last_backwards_context_until_the_next_backward():
    # torch's own behaviour: the context is released as the backward ends
    assert _events("plain") == [(0, True), ("after", 0), (1, True), ("after", 1), (2, True), ("after", 2)]
    # held: released by the next backward, on the main thread; the last one outlives the loop (one at a time)
    assert _events("held") == [("after", 0), (0, True), ("after", 1), (1, True), ("after", 2)]


def two_rank_run(rank, world, steps=3):
    """The engine's training at world 2 with a Mark set around each backward: after each step (every collective of
    it finished on both ranks: a barrier), the step's context is still alive, held by the main thread, and the one
    before it is released."""
    import contextvars
    import threading

    from offload.machine.backward_context import held
    freed, var = {}, contextvars.ContextVar("mark")

    class Mark:
        def __init__(self, step):
            self.step = step

        def __del__(self):
            freed[self.step] = threading.current_thread().name

    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, world))
    alive_after_step = []
    for step, tokens in enumerate(batches(steps, 2 * world)):
        token = var.set(Mark(step))
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        var.reset(token)
        engine.step()
        dist.barrier()
        alive_after_step.append(step not in freed)
    engine.close()
    return held(), alive_after_step, sorted(freed)


def test_a_two_rank_engine_holds_each_backwards_context_past_its_collectives():
    for installed, alive, freed in run_ranks(two_rank_run, 2):
        assert alive == [True, True, True]
        assert freed == [0, 1]  # the last is released by the TLS at the process's end, after finalization
        assert installed
