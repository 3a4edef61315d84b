"""The collectives ZeRO-3 uses, as plain functions over one process group (testable without a model).

torch 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
``all_gather_single`` / ``reduce_scatter_single`` and warns on the old names; the
GPU machine's 2.11 only has the old ones. We call whichever this torch has.
With one rank and no process group every function is a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Group:
    """This rank's place in the data-parallel group; ``pg`` is None for a single process."""

    rank: int
    world: int
    pg: dist.ProcessGroup | None

    @classmethod
    def current(cls) -> Group:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
        return cls(0, 1, None)


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False) -> dist.Work | None:
    """Fill ``full`` (world x shard elements) with every rank's ``shard``, in rank order; with ``async_op``
    the returned work must be waited for before ``full`` is read (None: already done)."""
    if group.pg is None:
        full.copy_(shard)
        return None
    return _all_gather(full, shard, group=group.pg, async_op=async_op)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False
                   ) -> dist.Work | None:
    """``shard`` = this rank's slice of the element-wise sum of every rank's ``full``; with ``async_op`` the
    returned work must be waited for before ``shard`` is read (None: already done)."""
    if group.pg is None:
        shard.copy_(full)
        return None
    return _reduce_scatter(shard, full, group=group.pg, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group: Group, async_op: bool = False) -> dist.Work | None:
    """``t`` = the element-wise sum of every rank's ``t``; with ``async_op`` the returned work must be waited
    for before ``t`` is read (None: already done)."""
    if group.pg is None:
        return None
    return dist.all_reduce(t, group=group.pg, async_op=async_op)


class ReductionOrder:
    """The order of this rank's gradient reductions since the last step, as two small hashes whose sums over the
    ranks (in the norm's all-reduce) tell whether every rank issued the same reductions in the same order (see
    [Note: gradient reduction order] in offload/zero/runtime.py). Collectives pair by issue order, so ranks that
    differ summed one unit's gradients with another's: where the sizes agree nothing else would say so."""

    MOD = 4093  # a prime: each hash below it, so world x the sum of squares stays exact in float64
    WIDTH = 4  # the values take() gives: each hash and its square

    def __init__(self) -> None:
        self._a = self._b = 0

    def add(self, index: int) -> None:
        self._a = (self._a * 31 + index + 1) % self.MOD
        self._b = (self._b * 37 + 2 * index + 1) % self.MOD

    def take(self) -> list[float]:
        """This rank's values for the sum, and a fresh start for the next step."""
        a, b = float(self._a), float(self._b)
        self._a = self._b = 0
        return [a, a * a, b, b * b]

    @staticmethod
    def agreed(summed: list[float], world: int) -> bool:
        """Whether every rank's hashes were equal, from their sums: W x sum(h^2) == sum(h)^2 only then."""
        if world < 2 or world > 20_000:  # beyond that the products leave float64's exact integers: no verdict
            return True
        a, a2, b, b2 = summed
        return world * a2 == a * a and world * b2 == b * b


def all_ok(ok: bool, group: Group, device: torch.device) -> bool:
    """Whether every rank says ok: how one rank's failure between collectives (a write that failed) reaches the
    others, which would otherwise wait for it in the next collective until the process group times out."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    all_reduce_sum(flag, group)
    return float(flag) == 0.0


def smallest(value: int, group: Group, device: torch.device) -> int:
    """The smallest of every rank's ``value``: one choice all ranks make alike from what each measured."""
    if group.pg is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.pg)
    return int(t.item())


class Vote:
    """One agreement of every rank at a step's commit point: each rank votes exactly once, yes where it reached
    the point (``commit``) or no where it failed before (``fail``), so a rank whose step failed never leaves the
    others waiting, and no rank commits a step another could not. ``refused`` is the error raised where this rank
    was ready but another was not."""

    def __init__(self, group: Group, device: torch.device, refused: BaseException) -> None:
        self.group, self.device, self.refused = group, device, refused
        self.cast = False

    def commit(self) -> None:
        """Every rank reached the commit point, or raise ``refused``."""
        assert not self.cast, "a vote is cast once"
        self.cast = True
        if not all_ok(True, self.group, self.device):
            raise self.refused

    def fail(self) -> None:
        """This rank failed: vote no, unless it already voted (it failed after, or the vote was refused)."""
        if not self.cast:
            self.cast = True
            all_ok(False, self.group, self.device)


def broadcast(t: torch.Tensor, group: Group, src: int = 0) -> None:
    if group.pg is not None:
        dist.broadcast(t, src=src, group=group.pg)
