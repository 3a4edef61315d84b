"""What one rank's engine holds in each tier, from its own accounting, and the device room left for gathers.

The host and NVMe tiers keep their accounts as they allocate (offload/store/budget.py);
the device tier is added up here from what the engine keeps there between uses. The
placement plan (offload/store/placement.py) predicted the same parts and checked the
device budget before anything was allocated; ``offload estimate`` shows the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.config import Config
from offload.optim.sharded import ShardedAdam
from offload.store.budget import TierBudget
from offload.store.param_store import ParamStore
from offload.store.tier import Tier
from offload.zero.runtime import LiveLimit
from offload.zero.stage import Stage
from offload.zero.unit import Unit


@dataclass
class MemoryAccount:
    config: Config
    stage: Stage
    compute_dtype: torch.dtype
    units: list[Unit]
    params: ParamStore
    optimizer: ShardedAdam
    host: TierBudget
    nvme: TierBudget
    gather_room: int | None = None  # elements the device budget leaves for gathers (the placement plan's)

    def device_parts(self) -> dict[str, int]:
        """What stays on the device between uses: parameters (stage 3: this rank's shards), the whole gradients
        stages 0-1 keep in .grad until the last micro-batch, the optimizer state and fp32 gradient accumulators
        (or the 16-bit gradients they keep until the step) of the units stepped on the device, and an offloaded
        optimizer's accumulators placed on the device."""
        parts = {"parameters" if self.stage.resident_params else "shards": sum(
            u.full.numel() * u.full.element_size() if u.resident else self.params.device_nbytes(u.index)
            for u in self.units)}
        if not self.stage.reduce_every_micro_batch:
            parts["gradients (whole, in .grad)"] = self.compute_dtype.itemsize * sum(
                s.numel for u in self.units for s in u.slots if s.param.requires_grad)
        parts.update(self.optimizer.device_bytes())  # state (all, or a partial offload's share), gradients
        return parts

    def device_resident_bytes(self) -> int:
        return sum(self.device_parts().values())

    def live_limit(self) -> LiveLimit:
        """stage3_max_live_parameters, or less where the device budget leaves less room after the shards (the
        placement plan checked the budget and sized the room)."""
        max_live = LiveLimit(self.config.zero_optimization.stage3_max_live_parameters)
        if self.gather_room is None or self.gather_room >= max_live.elements:
            return max_live
        return LiveLimit(self.gather_room, "offload.budgets.device (minus the resident shards, in elements)",
                         "Raise offload.budgets.device or lower offload.unit_bytes")

    def summary(self, gathered: tuple[int, int], activations: tuple[int, int] | None) -> dict[str, dict[str, int]]:
        """Bytes per tier by what holds them; ``gathered`` and ``activations`` are (now, peak) in elements and
        bytes, from the runtime and the activation store."""
        item = self.compute_dtype.itemsize
        device = self.device_parts()
        if not self.stage.resident_params:
            device.update(gathered_now=gathered[0] * item, gathered_peak=gathered[1] * item)
        if activations is not None:
            device.update(activations_now=activations[0], activations_peak=activations[1])
        budget = self.config.offload.budgets.device
        if budget is not None:
            device["budget"] = budget
        return {Tier.DEVICE.value: device, Tier.HOST.value: self.host.summary(), Tier.NVME.value: self.nvme.summary()}


def report(summary: dict[str, dict[str, int]], rank: int, device: torch.device) -> str:
    lines = [f"memory on rank {rank} ({device}):"]
    for tier, parts in summary.items():
        if not any(parts.values()):
            continue
        lines.append(f"  {tier:7s}" + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items()))
    return "\n".join(lines)
