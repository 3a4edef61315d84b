"""Where each unit's compute-dtype parameter shard is homed when offload_param is nvme, and what that costs: the
units kept in host memory under max_in_cpu, the NVMe-homed ones' slots in their two-slot file, and the host
buffers their reads and writes pass through. Pure arithmetic on sizes, a leaf: the start-up plan
(offload/store/placement.py) and `offload estimate` decide with it; the parameter store and its swap
(offload/store/param_store.py, offload/store/param_swap.py) fill what it decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offload.machine.buffers import round_up
from offload.store.slots import layout

HOST_PARAMS = "parameter shards not stepped on the host"  # the host part the parameter store takes from the budget
WRITE_BUFFERS = 2  # one being filled by Adam while the other is written


@dataclass(frozen=True)
class ParamHome:
    unit: int
    numel: int
    nbytes: int  # on the wire: rounded up to 4 KiB


def place_params(sizes: list[tuple[int, int]], param: Any) -> list[tuple[int, int]]:
    """Of (unit, shard elements) in unit order, those homed on NVMe under offload_param ``param`` (device nvme):
    the host keeps the first units up to max_in_cpu elements (they are needed right after a step, before
    read-ahead has compute to hide behind) and NVMe the rest."""
    from offload.config import ConfigError
    on_nvme, on_host = [], 0
    for unit, n in sizes:
        if on_host + n <= param.max_in_cpu:
            on_host += n
        else:
            on_nvme.append((unit, n))
    largest = max((n for _, n in on_nvme), default=0)
    if largest > param.buffer_size:
        raise ConfigError("zero_optimization.offload_param.buffer_size",
                          f"{param.buffer_size:,} elements cannot hold the largest unit's shard ({largest:,} "
                          "elements); raise buffer_size or lower offload.unit_bytes")
    return on_nvme


def describe_placement(sizes: list[tuple[int, int]], on_nvme: list[tuple[int, int]], param: Any) -> str:
    """One line on where offload_param nvme put the shards: said at initialize and by `offload estimate`, so that
    a max_in_cpu that keeps everything in host memory surprises no one."""
    total, nvme = sum(n for _, n in sizes), sum(n for _, n in on_nvme)
    if not on_nvme:
        return (f"offload_param.device is nvme, but max_in_cpu ({param.max_in_cpu:,} elements) holds every parameter "
                f"shard of this rank ({total:,} elements in {len(sizes)} units) in host memory: nothing goes to "
                f"NVMe; set max_in_cpu below {total:,} to move shards there")
    return (f"parameter shards: {len(sizes) - len(on_nvme)} of {len(sizes)} units ({total - nvme:,} elements) in "
            f"host memory under max_in_cpu ({param.max_in_cpu:,}), {len(on_nvme)} ({nvme:,} elements) on NVMe")


def plan_homes(sizes: list[tuple[int, int]], item: int) -> tuple[dict[int, ParamHome], int]:
    """Each NVMe-homed unit's shard size, and the size of the two-slot file that holds them."""
    homes = {unit: ParamHome(unit, numel, round_up(numel * item)) for unit, numel in sizes}
    return homes, layout([(unit, home.nbytes) for unit, home in homes.items()])[1]


def param_buffer_bytes(numels: list[int], item: int, buffer_count: int) -> int:
    """Host bytes of the read and write buffers for NVMe-homed shards of ``numels`` elements."""
    return (buffer_count + WRITE_BUFFERS) * max(round_up(n * item) for n in numels)
