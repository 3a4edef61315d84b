"""What the ranks agree on around a step, and how one rank's failure reaches the others.

[Note: one rank's failed step] With several ranks, one whose step fails must neither
leave the others waiting in a collective it will never join nor let them commit a step
it could not. Two agreements carry it. (1) What the step checks and waits for before
the norm (a gradient for every trained parameter, unless ignore_unused_parameters; the
gradients landing; the last step's work on host threads: an early NVMe pass that was
lost, a delayed update) may fail on one rank: that rank still joins the norm's
all-reduce, with a flag in it instead of its norm, and then every rank raises (it, its
error; the others, an EngineError saying another rank failed, after dropping the step's
gradients; where this rank had already stepped shards during backward, overlapped, it
says its step is half applied instead). This costs nothing: the all-reduce happens anyway
(at stage 0, whose norm needs no sum over the ranks, the same all-reduce sums the flag
alone, with the order check of [Note: gradient reduction order] in
offload/zero/runtime.py, which it carries at every stage). (2) With the optimizer
state on NVMe, a transfer may fail inside the step. Every rank votes once at the
commit point (every write done, no slot current yet, no host state touched): yes
there, no from its failure path (offload/zero/collectives.py's ``Vote``). A refused
vote aborts the pass as the rank's own failure would, so every rank keeps its last
step and this step's gradients, and step() called again on every rank retries it.
That is one more scalar all-reduce per step, only with NVMe state and several ranks.
The other collectives that follow a drain (checkpoints, state dicts, gathered
parameters) agree on it with one all_ok first.

[Note: one rank's failed pass] A forward or backward that raises on one rank part way
(a parameter read from NVMe failed, a batch only this rank has broke the model) is
different: the other ranks are inside the same pass, in or on their way to its
collectives (ZeRO-3's gathers, backward's reductions), and the failed rank's next
collective would pair with one of theirs. Gloo then fails on a size mismatch or, where
the sizes agree (transformer blocks are alike), hands one unit's shards to another:
wrong weights, silently. So with other ranks and collectives in the pass, the engine
takes no more work after such a failure (every call but close() raises, saying why),
and the error itself carries a note that says so; the job restarts every rank from the
last checkpoint (torchrun tears the others down when this one exits). With one rank,
or a pass without collectives (stages 0-2's forward, a backward that only accumulates),
the engine stays usable, as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from offload.engine import errors
from offload.machine.accelerator import Accelerator
from offload.observe.telemetry import Telemetry
from offload.optim.sharded import ShardedAdam
from offload.zero.collectives import Group, ReductionOrder, Vote, all_ok, all_reduce_sum


class StepAgreement(NamedTuple):
    """What one all-reduce at the step tells every rank."""

    sum_sq: float  # the squared global gradient norm
    nonfinite: int  # non-finite gradient elements, over every rank
    peers_failed: bool  # some rank failed before its norm (see [Note: one rank's failed step])
    in_order: bool  # every rank issued its reductions in the same order (see [Note: gradient reduction order])
    stop: bool  # some rank was asked to stop (see [Note: stopping at an agreed step] in engine/stopping.py)


def global_grad_sq_norm(optimizer: ShardedAdam, group: Group, partition: Group, accel: Accelerator,
                        telemetry: Telemetry, failed: bool, order: list[float], stop: bool = False
                        ) -> StepAgreement:
    """The sum of squared gradients and the count of non-finite ones over every partition, whether another
    rank ``failed`` before its norm (see [Note: one rank's failed step]; a rank that failed adds nothing to the
    norm), whether every rank issued its reductions in the same ``order`` (``ReductionOrder.take``), and whether
    any rank was asked to ``stop``."""
    with telemetry.span("optimizer", "norm"):
        totals = torch.tensor([0.0, 0.0, 1.0 if failed else 0.0, 1.0 if stop else 0.0, *order],
                              dtype=torch.float64, device=accel.device)
        if not failed:
            host_sq, host_nonfinite = optimizer.grad_sq_norm()  # host shards' parts, mostly taken as they landed
            totals[0], totals[1] = host_sq, float(host_nonfinite)
            on_device = optimizer.device_grad_sq_norm()
            if on_device is not None:
                totals[:2] += on_device
        if partition.world < group.world:
            # Stage 0: every rank holds the whole gradient already, so only the failure and stop flags (a
            # parameter unused here fails only this rank) and the reductions' order are summed over the ranks.
            all_reduce_sum(totals[2:], group)
        else:
            all_reduce_sum(totals, partition)
        sum_sq, nonfinite, failures, stops, *summed = accel.read_scalars(totals, "global gradient norm")  # one sync
        in_order = ReductionOrder.agreed(summed, group.world)
        return StepAgreement(sum_sq, int(nonfinite), failures > 0, in_order, stops > 0)


def commit_vote(nvme_state: bool, partition: Group, group: Group, accel: Accelerator, step: int) -> Vote | None:
    """The ranks' vote at the step's commit point, where a step can fail before it (optimizer state on NVMe,
    ``nvme_state``) and there are other ranks (see [Note: one rank's failed step])."""
    if partition.world == 1 or not nvme_state:
        return None
    return Vote(partition, accel.device, errors.peer_step_failed(group.rank, step, retryable=True))


def drained(optimizer: ShardedAdam, group: Group, accel: Accelerator, before: str, publish: bool = False) -> None:
    """Every gradient landed and every step handed to a host thread done (``publish``: and the last delayed
    update published), agreed by every rank (see [Note: one rank's failed step]); ``before``: the collective
    a rank that failed here would leave the others in."""
    alone = group.world == 1 or not optimizer.offload  # nothing of it can fail on one rank alone
    error: Exception | None = None
    try:
        if publish:
            optimizer.publish()
        optimizer.drain()
    except Exception as e:  # noqa: BLE001 - raised once every rank knows
        if alone:
            raise
        error = e
    if not alone and not all_ok(error is None, group, accel.device):
        raise error or errors.peer_failed_before(group.rank, before)
