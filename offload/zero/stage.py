"""What a ZeRO stage partitions, and so how the one engine runs under it.

Every stage runs through the same units, hooks and optimizer; a stage only decides
three things:

=====  =================  ==========================================  ======================================
stage  optimizer state    gradients                                   16-bit parameters
=====  =================  ==========================================  ======================================
0      replicated         all-reduced once per step (at the last      resident on every rank
                          micro-batch; ``.grad`` accumulates before)
1      partitioned (1/W)  reduce-scattered once per step, likewise    resident; each rank's updated
                                                                      partition all-gathered after the step
2      partitioned (1/W)  reduce-scattered unit by unit as backward   resident; all-gathered after the step
                          produces them, every micro-batch
3      partitioned (1/W)  as stage 2                                  partitioned; gathered around each use
=====  =================  ==========================================  ======================================

A *partition* is what the optimizer owns on this rank: 1/W of each unit's flat buffer
in stages 1-3, all of it in stage 0 (a group of one). Each rank's unit is gathered for
good in stages 0-2 ("resident"), and its partition is a view into the gathered buffer,
so the step writes the new values in place and one all-gather spreads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.zero.collectives import Group


@dataclass(frozen=True)
class Stage:
    number: int

    def __post_init__(self) -> None:
        if self.number not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.number} does not exist; use 0, 1, 2 or 3")

    @property
    def resident_params(self) -> bool:
        """Parameters stay gathered on the compute device between uses (stages 0-2)."""
        return self.number < 3

    @property
    def reduce_every_micro_batch(self) -> bool:
        """Gradients leave the device as each micro-batch's backward produces them (stages 2-3); stages 0-1 keep
        whole gradients in ``.grad`` until the last micro-batch of the step."""
        return self.number >= 2

    @property
    def all_reduce(self) -> bool:
        """Every rank needs the whole gradient (stage 0: each rank steps every parameter)."""
        return self.number == 0

    def partition(self, group: Group) -> Group:
        """The group a unit's flat buffer is split over: the data-parallel group, or this rank alone (stage 0)."""
        return group if self.number >= 1 else Group(0, 1, None)

    def partition_count(self, world: int) -> int:
        return world if self.number >= 1 else 1

    def describe(self) -> str:
        return {0: "stage 0: data parallel (gradients all-reduced, everything replicated)",
                1: "stage 1: optimizer state partitioned",
                2: "stage 2: optimizer state and gradients partitioned",
                3: "stage 3: optimizer state, gradients and parameters partitioned"}[self.number]
