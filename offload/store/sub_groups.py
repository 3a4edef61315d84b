"""How a rank's optimizer state is cut and where each piece lives: the sub-groups (whole units' shards stepped
together, up to ``sub_group_size`` elements) and the tier each is homed on within the budgets. Pure arithmetic on
sizes, a leaf: the start-up plan (offload/store/placement.py) and `offload estimate` decide with it, and the
store (offload/store/optimizer_state.py, which has the notes on how the state is held and stepped) fills what it
decided."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.config.fields import Auto
from offload.config.sections import ZeroConfig
from offload.machine.buffers import round_up
from offload.store.budget import TierBudget
from offload.store.state_format import FP32, StateFormat, StateSlot
from offload.store.tier import Tier

SPECULATIVE_SLOT = "optimizer state (speculative slot)"  # the host budget's name for the second slots
# The streamed lane's ring on the device holds this many of the largest streamed sub-group (offload/optim/
# streamed_step.py). Replayed on the h100 preset (the 0.91B GPT, docs/performance.md): three 309.3 ms a step with
# clipping and 307.1 without, two 326.1 and 313.6 (the third place lets the next sub-groups come up under backward
# while the largest, an embedding's, is stepped and written back).
RING_SLOTS = 3
STREAMED_SLOTS = "streamed optimizer state (a ring of sub-groups)"  # the streamed lane's, on the device
# the streamed units' new weights on the device, from their step to the next gather ([Note: the hand-off])
STREAMED_HANDED = "streamed units' new weights (handed to the next gather)"
# on the host: a device home's new weights from NVMe state streamed ([Note: NVMe state streamed], streamed_step.py)
STREAMED_COPIES = "streamed units' parameter copies"


@dataclass(frozen=True)
class Member:
    """One unit's shard inside a sub-group (element offset and count)."""

    unit: int
    offset: int
    numel: int


@dataclass
class SubGroup:
    index: int
    members: list[Member]
    numel: int
    tier: Tier = Tier.HOST
    resident: StateSlot | None = None  # its state while in memory (always, for device/host)
    # host: the second slot of the speculative step (see [Note: the speculative slot])
    spare: StateSlot | None = None
    in_spare: set[int] = field(default_factory=set)  # units whose current state is in ``spare``
    borrowed: bool = False  # host: its slots are views of a buffer a split shares (``split``), not its own
    fmt: StateFormat = FP32  # how its state is held
    highs: dict[int, torch.Tensor] = field(default_factory=dict)  # per unit, its lent high half (fmt.high_elsewhere)
    # host: stepped on the compute device, its state streamed over the bus (see [Note: the streamed lane] in
    # offload/optim/streamed_step.py)
    streamed: bool = False

    @property
    def nbytes(self) -> int:
        return round_up(self.fmt.slot_bytes(self.numel))

    def views(self, member: Member, *, other: bool = False) -> StateSlot:
        """(master, exp_avg, exp_avg_sq[, master_lo]) of one unit's shard in its current slot (``other``: in the
        slot the speculative step writes); only while the sub-group is resident."""
        assert self.resident is not None, f"sub-group {self.index} is not in memory"
        slot = self.resident if (member.unit in self.in_spare) == other else self.spare
        assert slot is not None, f"sub-group {self.index} has no second slot"
        views = slot.narrow(member.offset, member.numel)
        if self.fmt.high_elsewhere:  # see [Note: the weights are the high half]
            views = StateSlot(self.highs[member.unit], views.exp_avg, views.exp_avg_sq, views.master_lo)
        return views

    def flip(self, member: Member) -> None:
        """The other slot holds the unit's state of the step just taken: it becomes current."""
        assert self.spare is not None, f"sub-group {self.index} has no second slot"
        self.in_spare ^= {member.unit}


def plan_sub_groups(sizes: list[tuple[int, int]], sub_group_size: int,
                    on_device: frozenset[int] = frozenset(), fmt: StateFormat = FP32,
                    streamed: frozenset[int] = frozenset()) -> list[SubGroup]:
    """Consecutive units' shards packed up to ``sub_group_size`` elements (a larger unit is one alone); the units
    ``on_device`` (the first ones: see offload/store/placement.py) form sub-groups of their own, on the device; the
    ``streamed`` ones (homed on the host, stepped on the device) one sub-group each, so the device's ring holds
    units' state and one unit's copies overlap the next one's step; every one holds its state in ``fmt``."""
    groups: list[SubGroup] = []
    for unit, numel in sizes:
        device, stream = unit in on_device, unit in streamed
        if (not groups or groups[-1].numel + numel > sub_group_size or (groups[-1].tier is Tier.DEVICE) != device
                or stream or groups[-1].streamed):
            groups.append(SubGroup(len(groups), [], 0, tier=Tier.DEVICE if device else Tier.HOST, fmt=fmt,
                                   streamed=stream))
        g = groups[-1]
        g.members.append(Member(unit, g.numel, numel))
        g.numel += numel
    return groups


def place_sub_groups(groups: list[SubGroup], device: str, host: TierBudget, buffer_count: int,
                     spare: bool = False) -> None:
    """Choose each sub-group's home tier within the host budget (what ``host.used`` holds is already planned):
    ``device`` is offload_optimizer.device. With nvme the host keeps the first sub-groups that fit beside the
    NVMe buffers (with ``spare``, each with its speculative second slot: see [Note: the speculative slot]), and
    NVMe the rest. A plan that cannot fit is a ConfigError naming the budget."""
    from offload.config import ConfigError
    if device == "none":
        for g in groups:
            g.tier = Tier.DEVICE
        return
    groups = [g for g in groups if g.tier is not Tier.DEVICE]  # kept on the device by a partial offload (ratio < 1)
    if device == "cpu":
        need = sum(g.nbytes for g in groups)
        left = None if host.limit is None else host.limit - host.used
        if left is not None and need > left:
            raise ConfigError("offload.budgets.host",
                              f"{host.limit:,} bytes cannot hold the optimizer state on the host: it needs "
                              f"{need:,} bytes beside {host.used:,} for gradients and copies; raise the "
                              "budget, use more ranks, or put the optimizer on NVMe (offload_optimizer.device: "
                              "nvme keeps what fits on the host and the rest on NVMe)")
        for g in groups:
            g.tier = Tier.HOST
        return
    largest = max((g.nbytes for g in groups), default=0)
    if host.limit is None:
        for g in groups:
            g.tier = Tier.NVME
        return
    buffers = min(buffer_count, len(groups)) * largest
    left = host.limit - host.used - buffers
    if left < 0:
        raise ConfigError("offload.budgets.host",
                          f"{host.limit:,} bytes cannot hold the {min(buffer_count, len(groups))} "
                          f"NVMe buffers of {largest:,} bytes (one sub-group's state) beside "
                          f"{host.used:,} for gradients and copies; raise the budget or lower "
                          "zero_optimization.sub_group_size or offload_optimizer.buffer_count")
    for g in groups:
        cost = g.nbytes * (2 if spare else 1)
        if cost <= left:
            g.tier, left = Tier.HOST, left - cost
        else:
            g.tier = Tier.NVME


# [Note: the sub-group's default size] DeepSpeed's default sub_group_size, 1e9 elements, sizes the NVMe step's host
# buffers: buffer_count (4) of the largest sub-group, 4 x 1e9 x 12 bytes with fp32 Adam state, 48 GB of host memory
# for any model past 4B parameters a rank: the RAM, not the disk, would bound the model. With the state on NVMe,
# sub_group_size "auto" (the default) is 2e7 elements: a sub-group holds at most that, or one unit's shard where it
# is larger (offload.unit_bytes' 64 MiB is 33.5M bf16 weights, a rank's shard of it 33.5M / W, and a shard is
# never split), so the buffers hold four of those, whatever the model's size: at W = 1 about 1.6 GB with fp32
# state and 0.8 GB with the 16+16 master and bf16 moments. Each read and write is still tens of MiB, far past the
# size where the disk reaches its bandwidth (offload tune-nvme's grid), and smaller sub-groups step under backward
# sooner (on the Xeon the 16-layer GPT's step was not slower than at 1e8: docs/performance.md, Memory). With the
# state on the host or the device, "auto" is DeepSpeed's 1e9 (its sub-groups hold no buffers). A number set in the
# config acts as DeepSpeed's does.
NVME_SUB_GROUP = 20_000_000
DEEPSPEED_SUB_GROUP = 1_000_000_000


def sub_group_elements(zero: ZeroConfig) -> int:
    """zero_optimization.sub_group_size as the plan cuts by it (see [Note: the sub-group's default size])."""
    if isinstance(zero.sub_group_size, Auto):
        return NVME_SUB_GROUP if zero.offload_optimizer.device == "nvme" else DEEPSPEED_SUB_GROUP
    return int(zero.sub_group_size)


PIPELINE_WORTH = 16_000_000  # elements of NVMe state below which one sub-group's serial pass costs little


def unpipelined_note(groups: list[SubGroup], sub_group_size: int) -> str | None:
    """What to say when all of a rank's NVMe optimizer state is one large sub-group: its Adam and write then wait
    for the last gradient and run one after the other, and its one buffer is as large as the state."""
    nvme = [g for g in groups if g.tier is Tier.NVME]
    if len(nvme) != 1 or nvme[0].numel < PIPELINE_WORTH:
        return None
    n = nvme[0].numel
    if len(nvme[0].members) == 1:  # a unit is never split across sub-groups
        return (f"the optimizer state on NVMe is one unit's, {n:,} elements: its Adam and write wait for "
                f"backward's last gradient and run one after the other (only its read hides under backward), and "
                f"its buffer takes {nvme[0].nbytes / 2**30:.2f} GiB; a smaller offload.unit_bytes would cut it "
                "into units that pipeline")
    suggest = float(f"{n / 8:.0e}")
    return (f"the optimizer state on NVMe is one sub-group of {n:,} elements (sub_group_size {sub_group_size:,}): "
            f"its Adam and write wait for backward's last gradient and run one after the other (only its read hides "
            f"under backward), and its buffer takes "
            f"{nvme[0].nbytes / 2**30:.2f} GiB; zero_optimization.sub_group_size {int(suggest):,} would make about 8 "
            "sub-groups that pipeline")


def nvme_buffers(nvme_groups: list[SubGroup], buffer_count: int) -> tuple[int, int]:
    """(count, bytes each) of the host buffers the step pipelines NVMe sub-groups through: each holds the
    largest sub-group's state."""
    return min(buffer_count, len(nvme_groups)), max(g.nbytes for g in nvme_groups)


@dataclass
class StatePlacement:
    """What the start-up plan decided: elements of optimizer state per tier, by the tier's name (``Tier.value``):
    it is logged and goes into results as text."""

    tiers: dict[str, int] = field(default_factory=dict)
