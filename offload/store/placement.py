"""Where one rank's state goes, decided before anything is allocated: one pure function.

``plan`` takes the units' shard sizes, which of them train, the config and the compute
dtype's size, and returns a ``Placement``: each parameter shard's home, the optimizer's
sub-groups with their tiers, and the bytes reserved up front on the host and on NVMe, by
part. Every budget check of start-up is made here, in the order start-up meets them,
as a ConfigError naming the budget (``Placement.problems``; ``check`` raises the first).
The stores then allocate what the plan says and take from the budgets as they go, so
going over a budget while training is a bug in this plan. ``offload estimate`` calls the
same function, so an estimate is the engine's own plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from offload.config import ConfigError
from offload.store.budget import TierBudget
from offload.store.optimizer_state import SubGroup, nvme_buffers, place_sub_groups, plan_sub_groups
from offload.store.param_store import Home
from offload.store.param_swap import WRITE_BUFFERS, param_buffer_bytes, place_params, plan_homes
from offload.store.two_slots import layout

STAGING_BUFFERS = 4  # gradient staging buffers between the device and the host accumulators


def host_parts(sizes: list[tuple[int, int]], nvme_units: set[int], item: int) -> dict[str, int]:
    """Host bytes an offloaded optimizer reserves besides its state, by part: fp32 gradient accumulators,
    compute-dtype copies of the new shards (not for shards homed on NVMe), and gradient staging buffers."""
    return {"gradient accumulators": 4 * sum(n for _, n in sizes),
            "parameter copies": item * sum(n for i, n in sizes if i not in nvme_units),
            "gradient staging": STAGING_BUFFERS * max(n for _, n in sizes) * item}


@dataclass
class Placement:
    homes: dict[int, Home]  # every unit's compute-dtype shard
    nvme_params: list[tuple[int, int]]  # (unit, shard elements) homed on NVMe, in unit order
    groups: list[SubGroup]  # the optimizer's sub-groups of the trained shards, each with its tier
    placed: bool  # the sub-groups got their tiers (a host budget too small for them leaves them unplaced)
    step_buffers: dict[str, int] = field(default_factory=dict)  # host_parts: what an offloaded optimizer takes
    host: dict[str, int] = field(default_factory=dict)  # bytes reserved up front, by part
    nvme: dict[str, int] = field(default_factory=dict)
    problems: list[ConfigError] = field(default_factory=list)  # in the order start-up meets them

    def check(self) -> None:
        """Raise the first budget the plan does not fit (what initialize refuses)."""
        if self.problems:
            raise self.problems[0]


def plan(shard_sizes: list[tuple[int, int]], trained: set[int], config: Any, item: int) -> Placement:
    """The placement of one rank's units (``shard_sizes``: (unit, shard elements) in unit order; ``trained``:
    the units the optimizer steps) under ``config``, whose compute dtype has ``item`` bytes. Raises only for a
    setting that no budget could fix (offload_param.buffer_size below a shard)."""
    zero = config.zero_optimization
    host_limit, nvme_limit = config.offload.budgets.host, config.offload.budgets.nvme
    param, opt = zero.offload_param, zero.offload_optimizer
    nvme_params = place_params(shard_sizes, param) if param.device == "nvme" else []
    off_device = Home.HOST if param.device != "none" else Home.DEVICE
    homes = {i: off_device for i, _ in shard_sizes} | {i: Home.NVME for i, _ in nvme_params}
    trained_sizes = [(i, n) for i, n in shard_sizes if i in trained]
    out = Placement(homes, nvme_params, plan_sub_groups(trained_sizes, int(zero.sub_group_size)), False)

    if nvme_params:
        shards, file_bytes = plan_homes(nvme_params, item)
        buffers = param_buffer_bytes([n for _, n in nvme_params], item, param.buffer_count)
        if nvme_limit is not None and file_bytes > nvme_limit:
            out.problems.append(ConfigError(
                "offload.budgets.nvme", f"{nvme_limit:,} bytes cannot hold the parameter shards on NVMe: "
                f"{file_bytes:,} bytes (two slots per unit) beside 0 already planned; raise the budget, keep more "
                "parameters on the host (offload_param.max_in_cpu), or use more ranks"))
        if host_limit is not None and buffers > host_limit:
            largest = max(h.nbytes for h in shards.values())
            out.problems.append(ConfigError(
                "offload.budgets.host", f"{host_limit:,} bytes cannot hold the {param.buffer_count} + "
                f"{WRITE_BUFFERS} parameter NVMe buffers of {largest:,} bytes (one unit's shard) beside 0 already "
                "planned; raise the budget, lower offload_param.buffer_count or offload.unit_bytes"))
        out.nvme["parameter shards (two slots per unit)"] = file_bytes
        out.host["parameter NVMe buffers"] = buffers

    if opt.device != "none" and trained_sizes:
        parts = out.step_buffers = host_parts(trained_sizes, {i for i, _ in nvme_params}, item)
        if host_limit is not None and sum(parts.values()) > host_limit:
            out.problems.append(ConfigError(
                "offload.budgets.host", f"{host_limit:,} bytes cannot hold this rank's gradient accumulators and "
                f"parameter copies ({', '.join(f'{k} {v:,}' for k, v in parts.items())}), before any optimizer "
                "state; raise the budget or use more ranks"))
        out.host.update(parts)

    budget = TierBudget("host", host_limit, used=sum(out.host.values()))
    try:
        place_sub_groups(out.groups, opt.device, budget, opt.buffer_count)
    except ConfigError as e:
        out.problems.append(e)
        return out
    out.placed = True
    on_host = [g for g in out.groups if g.tier == "host"]
    on_nvme = [g for g in out.groups if g.tier == "nvme"]
    if on_host:
        out.host["optimizer state"] = sum(g.nbytes for g in on_host)
    if on_nvme:
        file_bytes = layout([(g.index, g.nbytes) for g in on_nvme])[1]
        used = sum(out.nvme.values())
        if nvme_limit is not None and used + file_bytes > nvme_limit:
            out.problems.append(ConfigError(
                "offload.budgets.nvme", f"{nvme_limit:,} bytes cannot hold the optimizer state on NVMe: "
                f"{file_bytes:,} bytes ({sum(g.numel for g in on_nvme):,} elements x 12 bytes, two slots each so a "
                "failed step never loses the last one); raise the budget, give the host a larger budget "
                "(offload.budgets.host), or use more ranks"))
        count, size = nvme_buffers(on_nvme, opt.buffer_count)
        out.nvme["optimizer state (two slots per sub-group)"] = file_bytes
        out.host["optimizer NVMe buffers"] = count * size
    return out
