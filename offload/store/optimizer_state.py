"""Where each sub-group's fp32 master weights and Adam moments live, and the pipelined pass over them.

A rank's optimizer state is cut into sub-groups of whole units' shards, up to
``sub_group_size`` elements each. A sub-group's master, exp_avg and exp_avg_sq are one
buffer [3, n] whose home is a tier:
- ``device``: the compute device (no optimizer offload);
- ``host``: host memory, updated in place, no copies at all;
- ``nvme``: a swap file, read into one of ``buffer_count`` pinned buffers for the step.
With ``offload_optimizer.device: nvme`` and a host budget, the host keeps the first
sub-groups that fit in what the budget leaves and the rest go to NVMe.

[Note: the step pipeline] NVMe sub-groups are processed first: the read of sub-group
i+1 (and further, up to the free buffers) is in flight while Adam runs on i, and i's
write-back starts as soon as Adam is done with it; a buffer is read into again only
after its write has completed. Host sub-groups are processed after every NVMe write
has completed.

[Note: reads ahead of the step] The step's first reads do not depend on the gradients,
so ``read_ahead`` issues them (one per buffer, in the pass's order) when the last
micro-batch's backward begins, and the pass takes them over: with up to buffer_count
NVMe sub-groups (DeepSpeed's defaults, sub_group_size 1e9 and 4 buffers, cover 4B
parameters per rank) every read of the step hides under backward. Anything else that
uses the buffers (a master read, a checkpoint, building) first waits for them and drops
them; nothing writes a current slot while they are in flight.

[Note: a failed step loses nothing] Each NVMe sub-group has two slots in the swap
file; a step reads the slot holding the last completed step and writes the other, and
flips which slot is current only when every write of the step has completed. Host
state is touched only after that. A read or write that fails (disk full, I/O error, a
checksum mismatch) therefore leaves the state of the last completed step intact and
readable, and the step can be retried.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from offload.accelerator import Accelerator
from offload.aio.base import Engine, RequestGroup
from offload.aio.buffers import AlignedBuffer, BufferPool, round_up
from offload.aio.checksum import ChecksummedFile
from offload.store.budget import TierBudget
from offload.store.swapdir import SwapDir
from offload.telemetry import Telemetry

logger = logging.getLogger("offload.store")

KINDS = 3  # master, exp_avg, exp_avg_sq: fp32 each


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
    tier: str = "host"
    resident: torch.Tensor | None = None  # [3, numel] fp32 while in memory (always, for device/host)
    slots: tuple[int, int] = (0, 0)  # byte offsets of the two NVMe slots
    current: int = 0  # the slot holding the last completed step

    @property
    def nbytes(self) -> int:
        return round_up(KINDS * self.numel * 4)

    def views(self, member: Member) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of one unit's shard; only while the sub-group is resident."""
        assert self.resident is not None, f"sub-group {self.index} is not in memory"
        s = slice(member.offset, member.offset + member.numel)
        return self.resident[0, s], self.resident[1, s], self.resident[2, s]


def plan_sub_groups(sizes: list[tuple[int, int]], sub_group_size: int) -> list[SubGroup]:
    """Consecutive units' shards packed up to ``sub_group_size`` elements (a larger unit is one alone)."""
    groups: list[SubGroup] = []
    for unit, numel in sizes:
        if not groups or groups[-1].numel + numel > sub_group_size:
            groups.append(SubGroup(len(groups), [], 0))
        g = groups[-1]
        g.members.append(Member(unit, g.numel, numel))
        g.numel += numel
    return groups


def place_sub_groups(groups: list[SubGroup], device: str, host: TierBudget, buffer_count: int) -> None:
    """Choose each sub-group's home tier within the host budget (what ``host.used`` holds is already planned):
    ``device`` is offload_optimizer.device. With nvme the host keeps the first sub-groups that fit beside the
    NVMe buffers, and NVMe the rest. A plan that cannot fit is a ConfigError naming the budget."""
    from offload.config import ConfigError
    if device == "none":
        for g in groups:
            g.tier = "device"
        return
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
            g.tier = "host"
        return
    largest = max((g.nbytes for g in groups), default=0)
    if host.limit is None:
        for g in groups:
            g.tier = "nvme"
        return
    buffers = min(buffer_count, len(groups)) * largest
    left = host.limit - host.used - buffers
    if left < 0:
        raise ConfigError("offload.budgets.host",
                          f"{host.limit:,} bytes cannot hold the {min(buffer_count, len(groups))} "
                          f"pinned NVMe buffers of {largest:,} bytes (one sub-group's state) beside "
                          f"{host.used:,} for gradients and copies; raise the budget or lower "
                          "zero_optimization.sub_group_size or offload_optimizer.buffer_count")
    for g in groups:
        if g.nbytes <= left:
            g.tier, left = "host", left - g.nbytes
        else:
            g.tier = "nvme"


def nvme_buffers(nvme_groups: list[SubGroup], buffer_count: int) -> tuple[int, int]:
    """(count, bytes each) of the host buffers the step pipelines NVMe sub-groups through: each holds the
    largest sub-group's state."""
    return min(buffer_count, len(nvme_groups)), max(g.nbytes for g in nvme_groups)


@dataclass
class StatePlacement:
    """What the start-up plan decided: elements of optimizer state per tier."""

    tiers: dict[str, int] = field(default_factory=dict)


class OptimizerStateStore:
    """Owns every sub-group's master/moment buffer on its tier, and the pass that the step runs over them."""

    def __init__(self, sizes: list[tuple[int, int]], sub_group_size: int, *, device: str, accel: Accelerator,
                 host: TierBudget, nvme: TierBudget, buffer_count: int = 4,
                 swap: tuple[SwapDir, Engine] | None = None, rank: int = 0,
                 telemetry: Telemetry | None = None) -> None:
        """``device``: "none" (the compute device), "cpu" or "nvme"; ``swap`` is needed for "nvme"."""
        self.accel = accel
        self.telemetry = telemetry or Telemetry()
        self.groups = plan_sub_groups(sizes, sub_group_size)
        self.by_unit = {m.unit: (g, m) for g in self.groups for m in g.members}
        self.host, self.nvme = host, nvme
        self.placement = StatePlacement()
        self._file: ChecksummedFile | None = None
        self._pool: BufferPool | None = None
        self._buffers: list[AlignedBuffer] = []
        self._fill: AlignedBuffer | None = None
        self._ahead: list[tuple[SubGroup, AlignedBuffer, object]] = []  # reads issued ahead of the step pass
        self.reads_ahead = 0
        place_sub_groups(self.groups, device, host, buffer_count)
        for g in self.groups:
            self.placement.tiers[g.tier] = self.placement.tiers.get(g.tier, 0) + g.numel
            if g.tier == "device":
                g.resident = torch.zeros(KINDS, g.numel, dtype=torch.float32, device=accel.device)
            elif g.tier == "host":
                t, buf = accel.host_buffer(KINDS * g.numel, torch.float32)
                host.take(buf.capacity, "optimizer state")
                g.resident = t.view(KINDS, g.numel)
                g.resident.zero_()
        nvme_groups = [g for g in self.groups if g.tier == "nvme"]
        if nvme_groups:
            assert swap is not None, "nvme optimizer state needs a swap directory and an I/O engine"
            swap_dir, engine = swap
            offset = 0
            for g in nvme_groups:
                g.slots = (offset, offset + g.nbytes)
                offset += 2 * g.nbytes
            if nvme.limit is not None and nvme.used + offset > nvme.limit:
                from offload.config import ConfigError
                raise ConfigError("offload.budgets.nvme",
                                  f"{nvme.limit:,} bytes cannot hold the optimizer state on NVMe: {offset:,} bytes "
                                  f"({sum(g.numel for g in nvme_groups):,} elements x 12 bytes, two slots each so a "
                                  "failed step never loses the last one); raise the budget, give the host a larger "
                                  "budget (offload.budgets.host), or use more ranks")
            nvme.take(offset, "optimizer state (two slots per sub-group)")
            self._file = ChecksummedFile(engine, swap_dir.reserve(f"optimizer-rank{rank}.swap", offset))
            count, size = nvme_buffers(nvme_groups, buffer_count)
            self._pool = BufferPool(count * size, pin=accel.is_cuda, name="optimizer NVMe buffers")
            self._buffers = [self._pool.acquire(size) for _ in range(count)]
            host.take(count * size, "optimizer NVMe buffers")
        logger.info("optimizer state: %s", ", ".join(f"{t} {n:,} elements" for t, n in self.placement.tiers.items()))

    # ----------------------------------------------------------------- filling and reading

    def init_member(self, unit: int, master: torch.Tensor) -> None:
        """Set a unit's master weights (moments start at zero). Units arrive in order; an NVMe sub-group is
        written to its slot when its last unit has arrived, so building holds one sub-group at a time."""
        g, m = self.by_unit[unit]
        if g.tier != "nvme":
            g.views(m)[0].copy_(master)
            return
        self.drop_read_ahead()
        if m.offset == 0:
            self._fill = self._buffers[0]
            g.resident = self._fill.view(torch.float32, KINDS * g.numel).view(KINDS, g.numel)
            g.resident.zero_()
        g.views(m)[0].copy_(master)
        if m is g.members[-1]:
            assert self._file is not None
            self._file.write(self._fill.tensor, g.slots[0], g.nbytes).wait()
            g.current, g.resident, self._fill = 0, None, None

    def read_master(self, unit: int) -> torch.Tensor:
        """A copy of one unit's fp32 master shard (from NVMe when that is its home)."""
        g, m = self.by_unit[unit]
        if g.tier != "nvme":
            return g.views(m)[0].detach().clone()
        assert self._file is not None
        self.drop_read_ahead()
        buf = self._buffers[0]
        self._file.read(buf.tensor, g.slots[g.current], g.nbytes).wait()
        return buf.view(torch.float32, KINDS * g.numel)[m.offset:m.offset + m.numel].clone()

    def one_at_a_time(self, *, read: bool, write: bool) -> Iterator[SubGroup]:
        """Every sub-group resident in turn, an NVMe one through one buffer: read from its current slot first
        (``read``) and written back to that slot after the caller is done with it (``write``: the caller
        replaced the whole sub-group). Never more than one sub-group in memory; for checkpoints."""
        self.drop_read_ahead()
        for g in self.groups:
            if g.tier != "nvme":
                yield g
                continue
            assert self._file is not None
            buf = self._buffers[0]
            if read:
                self._file.read(buf.tensor, g.slots[g.current], g.nbytes).wait()
                self.telemetry.add_bytes("nvme_read", g.nbytes)
            g.resident = buf.view(torch.float32, KINDS * g.numel).view(KINDS, g.numel)
            try:
                yield g
                if write:
                    self._file.write(buf.tensor, g.slots[g.current], g.nbytes).wait()
                    self.telemetry.add_bytes("nvme_write", g.nbytes)
            finally:
                g.resident = None

    # ----------------------------------------------------------------- the step

    def step_pass(self) -> Iterator[SubGroup]:
        """Yield every sub-group resident in memory, NVMe ones pipelined (see [Note: the step pipeline])."""
        nvme = [g for g in self.groups if g.tier == "nvme"]
        if nvme:
            yield from self._nvme_pass(nvme)
        for g in self.groups:
            if g.tier != "nvme":
                yield g

    def read_ahead(self) -> int:
        """Start the step pass's first NVMe reads now (see [Note: reads ahead of the step]); returns how many."""
        if self._file is None or self._ahead:
            return 0
        nvme = [g for g in self.groups if g.tier == "nvme"]
        for g, buf in zip(nvme, self._buffers):
            self._ahead.append((g, buf, self._file.read(buf.tensor, g.slots[g.current], g.nbytes)))
            self.telemetry.add_bytes("nvme_read", g.nbytes)
        self.reads_ahead += len(self._ahead)
        return len(self._ahead)

    def drop_read_ahead(self) -> None:
        """Wait for reads issued ahead and forget them (their buffers are about to be used otherwise)."""
        ahead, self._ahead = self._ahead, []
        for _, _, read in ahead:
            _quiet_wait(read)

    def _nvme_pass(self, groups: list[SubGroup]) -> Iterator[SubGroup]:
        assert self._file is not None
        file, tel = self._file, self.telemetry
        ahead, self._ahead = self._ahead, []
        taken = {id(buf) for _, buf, _ in ahead}
        free: deque[tuple[AlignedBuffer, RequestGroup | None]] = deque(
            (b, None) for b in self._buffers if id(b) not in taken)
        inflight: deque[tuple[SubGroup, AlignedBuffer, object]] = deque(ahead)  # in the pass's order
        upcoming = deque(groups[len(ahead):])
        assert [g for g, _, _ in ahead] == groups[:len(ahead)], "reads ahead must be the pass's first sub-groups"
        try:
            while upcoming or inflight:
                while upcoming and free:
                    buf, write = free.popleft()
                    if write is not None:
                        with tel.span("nvme_wait", "write"):
                            write.wait()
                    g = upcoming.popleft()
                    inflight.append((g, buf, file.read(buf.tensor, g.slots[g.current], g.nbytes)))
                    tel.add_bytes("nvme_read", g.nbytes)
                g, buf, read = inflight.popleft()
                with tel.span("nvme_wait", "read"):
                    read.wait()  # type: ignore[attr-defined]
                g.resident = buf.view(torch.float32, KINDS * g.numel).view(KINDS, g.numel)
                yield g
                g.resident = None
                free.append((buf, file.write(buf.tensor, g.slots[1 - g.current], g.nbytes)))
                tel.add_bytes("nvme_write", g.nbytes)
            with tel.span("nvme_wait", "write"):
                for _, write in free:
                    if write is not None:
                        write.wait()
        finally:
            for g, _, read in inflight:  # a failed step: let every transfer finish before buffers are reused
                g.resident = None
                _quiet_wait(read)
            for _, write in free:
                _quiet_wait(write)
        for g in groups:  # every write completed: the new slots are the current state
            g.current = 1 - g.current

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        self.drop_read_ahead()
        if self._file is not None:
            self._file.close()
            self._file = None
        for buf in self._buffers:
            if self._pool is not None:
                self._pool.release(buf)
        self._buffers.clear()
        for g in self.groups:
            g.resident = None


def _quiet_wait(request: object) -> None:
    if request is None:
        return
    try:
        request.wait()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the first failure is already propagating
        pass
