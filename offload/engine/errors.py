"""The engine's one error type, apart so that every engine room can raise it."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class EngineError(RuntimeError):
    """The engine was used in a way it cannot honour; the message says what to do instead."""


def released_parameter_read(units: list[str]) -> EngineError:
    return EngineError(
        "a parameter was read while its unit was released: some module's forward reads a parameter of another "
        "module without calling that module (e.g. F.linear(x, self.child.weight)), or code reads parameters "
        "outside forward. Name the reading module's class in offload.atomic_modules so it is never split from its "
        "children, or call the child module instead. Units: " + ", ".join(units))


# What torch says when an op meets a released parameter, an empty tensor (see [Note: a released parameter] in
# offload/zero/unit.py): a size or shape of 0 somewhere in its message.
_EMPTY_OPERAND = re.compile(r"storage of size 0|data is not allocated|\(0\)|\[0\]|\b0x\d|\dx0\b|size 0\b"
                            r"|must be \d-D|should have at least \w+ dimensions")


def reads_a_released_parameter(message: str) -> bool:
    return bool(_EMPTY_OPERAND.search(message))


def input_dtype_hint(message: str, compute: torch.dtype, inputs: Any) -> str | None:
    """What to do when a forward failed on a dtype clash between a floating input and the (16-bit) parameters:
    the engine moves inputs to the device but casts them only with fp16.auto_cast, as DeepSpeed does."""
    if compute == torch.float32 or not any(w in message for w in ("same dtype", "expected scalar type",
                                                                  "should be the same")):
        return None
    floats = sorted({str(t.dtype).removeprefix("torch.") for t in tree_flatten(inputs)[0]
                     if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != compute})
    if not floats:
        return None
    name = str(compute).removeprefix("torch.")
    return (f"offload: the model's parameters are {name} (the config's precision), and floating inputs are not "
            f"cast to it (here {', '.join(floats)}): cast them, e.g. batch.to(torch.{name})"
            + (", or set fp16.auto_cast" if compute == torch.float16 else ""))


def half_applied_step() -> EngineError:
    return EngineError("backward failed while the optimizer step ran overlapped with it, and some shards were "
                       "already updated, so this step is half applied; set offload.overlap_step to \"off\" to keep "
                       "every step all-or-nothing")


def backward_after_update_began(call: int, calls_per_step: int | None) -> EngineError:
    """See [Note: more backward calls than micro-batches] in accumulation.py."""
    shown = (f"no step before took more than {calls_per_step}" if calls_per_step is not None
             else "the accumulation was complete")
    return EngineError(f"engine.backward() call {call} since the last step comes after the call that completed this "
                       f"step ({shown}), and the optimizer update already began during that one "
                       "(offload.overlap_step / speculative_step), so this call's gradients cannot join the step: "
                       "they were not taken. Call engine.step() now to apply the step without them; keep the same "
                       "number of backward calls in every step, or set offload.overlap_step and "
                       "offload.speculative_step to \"off\" for a loop whose calls vary")


def params_behind(step: int, strerror: str | None) -> EngineError:
    return EngineError(f"step {step} was applied, but writing new parameter shards to NVMe failed: {strerror}. The "
                       "master weights hold the step; the units left behind are rewritten from them before the next "
                       "forward, so fix the disk and go on (do not repeat this step)")


def unused_parameters(rank: int, names: list[str]) -> EngineError:
    return EngineError(f"rank {rank}: {len(names)} trainable parameter(s) received no gradient this step "
                       f"({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}), and zero_optimization."
                       "ignore_unused_parameters is false; the step's gradients were dropped. Set it to true (they "
                       "are then stepped with a zero gradient, as DeepSpeed does: weight decay and Adam's moments "
                       "still move them), freeze them (requires_grad=False), or use them in the forward")


def peer_step_failed(rank: int, step: int, retryable: bool, half_applied: bool = False) -> EngineError:
    """Raised where this rank's step was ready but another rank's failed (see [Note: one rank's failed step])."""
    if half_applied:
        return EngineError(f"rank {rank}: another rank's gradients or its last step did not complete (its error says "
                           f"why), but this rank had already stepped some shards of step {step} during backward, so "
                           "its step is half applied: rebuild every rank from the last checkpoint (offload."
                           "overlap_step \"off\" keeps every step all-or-nothing)")
    if retryable:
        return EngineError(f"rank {rank}: step {step} was not applied because another rank's step failed (its error "
                           "says why); every rank kept its last step and this step's gradients, so once the cause is "
                           "fixed call step() again on every rank")
    return EngineError(f"rank {rank}: step {step} was not applied because another rank's gradients or its last step "
                       "did not complete (its error says why); this rank dropped this step's gradients. If that "
                       "rank's error says a step was lost, rebuild every rank from the last checkpoint")


def reductions_out_of_order(rank: int, step: int, half_applied: bool) -> EngineError:
    """Raised on every rank when their gradient reductions since the last step differ in order (see [Note:
    gradient reduction order] in offload/zero/runtime.py)."""
    outcome = ("this rank had already stepped some shards during backward, so the step is half applied: rebuild "
               "every rank from the last checkpoint" if half_applied else
               "the step was not applied and its gradients were dropped")
    return EngineError(f"rank {rank}: the ranks reduced step {step}'s gradients in different orders, so reductions "
                       f"summed one unit's gradients with another's: {outcome}. Every rank must use the "
                       "same modules in the same order each step: a module used on some ranks and not others (a "
                       "branch the data chooses, an expert no token reached, an early exit) breaks that. Make every "
                       "rank use it (add 0 * its output to the loss where it is skipped)")


def peer_failed_before(rank: int, what: str) -> EngineError:
    return EngineError(f"rank {rank}: {what} did not start because another rank's gradients or its last step did not "
                       "complete (its error says why); if it says a step was lost, rebuild every rank from the last "
                       "checkpoint")


def out_of_step(rank: int, where: str, error: BaseException) -> str:
    return (f"rank {rank}: {where} raised part way ({type(error).__name__}: {error}) while the other ranks went on "
            "with that pass's collectives, so this rank's collectives are out of step with theirs and this engine "
            "takes no more work (pairing mismatched collectives gives a hang or wrong weights); stop every rank and "
            "resume from the last checkpoint (close() still releases this rank's memory)")


def no_optimizer(call: str) -> EngineError:
    return EngineError(f"{call}: this engine was built without an optimizer (no optimizer section in the config, no "
                       "optimizer= to initialize), so it runs forward only, as DeepSpeed's ZeRO-Inference; to train "
                       "the model, build its engine with an optimizer section")
