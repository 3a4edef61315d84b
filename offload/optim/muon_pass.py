"""Muon's step over sharded state: its first pass, and the second's part for the matrices.

[Note: Muon over shards] Muon's update is not elementwise: each matrix's momentum-blended gradient is
orthogonalised whole (a few Newton-Schulz iterations, in bf16), and a rank holds only its flat slice of each
unit. So the step runs in two passes. The first (``MuonPass.prepare``, every rank at the start of the step, unit
by unit in unit order) updates this rank's slice of each matrix's momentum, all-gathers the unit's blended slices
into the whole unit, orthogonalises each matrix (on the compute device when it is a GPU, where the reference
would run it), and keeps this rank's slice of the result in the slot's ``exp_avg_sq``, which Muon does not
otherwise use (bf16 in the first half of its bytes). The second is the ordinary per-shard step
(offload/optim/update.py), which applies the decay and the orthogonalised update to the master slice, elementwise,
as torch does to the whole matrix. Each rank orthogonalises every matrix its shard holds part of (one cut between
two ranks, both: the same inputs, the same result), the simplest exact order.

Because the first pass is collective and needs every gradient, Muon's step runs whole after backward: never
overlapped with it, early, speculated or streamed, and its state is on the host or the device (not NVMe).
The momentum is the slot's ``exp_avg`` (torch's ``momentum_buffer``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from offload.machine.accelerator import Accelerator
from offload.optim.hyper import Hyper
from offload.optim.muon import MuonHyper, orthogonalized
from offload.optim.shard_state import ShardPhase, ShardState, widened
from offload.store.state_format import StateSlot
from offload.store.sub_groups import SubGroup


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix of a unit: where it starts in the unit's flat buffer, its shape, and its param group."""

    offset: int
    shape: tuple[int, int]
    group: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class MuonUnit:
    """A unit's Muon matrices and this rank's shard of the unit ([start, start + numel) of its flat buffer)."""

    start: int
    numel: int
    matrices: tuple[Matrix, ...]

    def pieces(self) -> Iterator[tuple[Matrix, int, int]]:
        """Each matrix with the part of it in this rank's shard: (matrix, shard-relative start and end)."""
        for m in self.matrices:
            lo, hi = max(m.offset, self.start), min(m.offset + m.numel, self.start + self.numel)
            if lo < hi:
                yield m, lo - self.start, hi - self.start


def direction(exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """Where the first pass keeps a piece's orthogonalised update: bf16, in the first half of its ``exp_avg_sq``
    bytes."""
    return exp_avg_sq.view(torch.bfloat16)[:exp_avg_sq.numel()]


class MuonPass:
    """The step's first pass over the Muon matrices (see [Note: Muon over shards]); the units register theirs as
    they are sharded."""

    def __init__(self, accel: Accelerator, world: int, group: dist.ProcessGroup | None,
                 muon_groups: frozenset[int]) -> None:
        """``world`` ranks share each unit (``group``: their process group, None for one); ``muon_groups``: the
        param groups Muon steps."""
        self.accel, self.world, self.group, self.muon_groups = accel, world, group, muon_groups
        self.units: dict[int, MuonUnit] = {}

    def add(self, index: int, slots: Iterable[Any], start: int, numel: int, group_of: dict[int, int]) -> None:
        """Unit ``index``'s params (``slots``: each with ``param``, ``offset``, ``shape``) in a Muon group."""
        matrices = tuple(Matrix(s.offset, (s.shape[0], s.shape[1]), group_of[id(s.param)]) for s in slots
                         if group_of.get(id(s.param)) in self.muon_groups)
        if matrices:
            self.units[index] = MuonUnit(start, numel, matrices)

    def prepare(self, groups: Iterable[SubGroup], shards: dict[int, ShardState], hypers: list[Hyper],
                grad_scale: float) -> None:
        """Every unit's momentum updated and its matrices' orthogonalised updates kept, unit by unit in unit
        order (the same on every rank: each unit's gather is collective)."""
        views = {m.unit: g.views(m) for g in groups for m in g.members if m.unit in self.units}
        for index in sorted(self.units):
            self._prepare(self.units[index], views[index], shards[index], hypers, grad_scale)

    def _prepare(self, unit: MuonUnit, views: StateSlot, state: ShardState, hypers: list[Hyper],
                 grad_scale: float) -> None:
        master, momentum, exp_avg_sq = views
        if state.phase is ShardPhase.EMPTY:  # no gradient reached it since the last step: Muon sees zeros
            grad, pre_scale = torch.zeros_like(master), 1.0
        else:
            grad, pre_scale = state.gradient()
        blended = torch.empty(unit.numel, dtype=torch.float32, device=master.device)  # only matrices are read
        for m, lo, hi in unit.pieces():
            hyper = _muon(hypers[m.group])
            g = widened(grad[lo:hi], pre_scale)
            if grad_scale != 1.0:  # as clip_grad_norm_ scales the gradient before torch's Muon reads it
                g = g * grad_scale
            buf = momentum[lo:hi]
            buf.lerp_(g, 1 - hyper.momentum)
            blended[lo:hi] = g.lerp(buf, hyper.momentum) if hyper.nesterov else buf
        whole = self._gathered(blended)
        ns_device = self.accel.device if self.accel.is_cuda else whole.device
        for m, lo, hi in unit.pieces():  # a matrix not in this rank's shard is another rank's to orthogonalise
            matrix = whole[m.offset:m.offset + m.numel].view(m.shape).to(ns_device)
            out = orthogonalized(matrix, _muon(hypers[m.group])).reshape(-1)
            at = unit.start - m.offset  # shard-relative to matrix-relative
            direction(exp_avg_sq[lo:hi]).copy_(out[lo + at:hi + at])

    def _gathered(self, blended: torch.Tensor) -> torch.Tensor:
        """The whole unit's blended updates from every rank's shard (one collective per unit)."""
        if self.world == 1:
            return blended
        device = self.accel.device if self.accel.is_cuda else blended.device  # NCCL gathers device memory
        whole = torch.empty(blended.numel() * self.world, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(whole, blended.to(device), group=self.group)
        return whole


def apply_pieces(unit: MuonUnit, views: StateSlot, hypers: list[Hyper], out16: torch.Tensor | None) -> None:
    """The second pass on one shard's Muon pieces: torch.optim.Muon's decoupled decay, then the orthogonalised
    update at the matrix's step size, elementwise on the master slice (and the new weights into ``out16``)."""
    master, _, exp_avg_sq = views
    for m, lo, hi in unit.pieces():
        hyper = _muon(hypers[m.group])
        piece = master[lo:hi]
        piece.mul_(1 - hyper.lr * hyper.weight_decay)
        piece.add_(direction(exp_avg_sq[lo:hi]), alpha=-hyper.scaled_lr(m.shape))
        if out16 is not None:
            out16[lo:hi].copy_(piece)


def _muon(hyper: Hyper) -> MuonHyper:
    assert isinstance(hyper, MuonHyper), "a Muon matrix is in a Muon group"
    return hyper
