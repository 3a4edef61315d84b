"""The rates `offload_optimizer.ratio: auto` chooses its split by at start-up, measured here in a fraction of a second.

[Note: rates measured at start-up] auto's split is a trade (offload/store/placement.py, [Note: auto by rates]):
device room spent on optimizer state shortens the host's Adam, spent on parameter shards it saves their crossing
of the bus. Which buys more depends on this machine: its host memory as the Adam kernel streams it, its bus each
way, its device memory. So start-up measures them, once a process: the native Adam over buffers larger than the
caches (with the threads the step will use), pinned copies up and down, a copy within the device. The figures are
medians of three after a warm-up, each a few milliseconds on a GPU host; they are logged with the plan. Compute is
not measured (it depends on the batch the script feeds): the split is chosen for offload's own lanes, and the
refit after the first step (offload/engine/refit.py) moves more state into the room that step left.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable

import torch

from offload.machine.accelerator import Accelerator
from offload.machine.buffers import AlignedBuffer
from offload.optim.adam import AdamHyper, adam_step
from offload.store.step_cost import ADAM_BYTES, Rates
from offload.zero.collectives import Group, smallest

logger = logging.getLogger("offload.engine")

ADAM_ELEMENTS = 16 << 20  # 64 MiB a buffer, 288 MiB in all: past a host's caches
COPY_BYTES = 64 << 20
ROUNDS = 3


def _median_seconds(run: Callable[[], object], sync: Callable[[], None]) -> float:
    run()
    sync()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


NAMES = ("device_gbps", "host_gbps", "h2d_gbps", "d2h_gbps")


def measure(accel: Accelerator, threads: int | None, group: Group) -> Rates | None:
    """This machine's rates (see [Note: rates measured at start-up]), the slowest rank's each: every rank prices
    the same way (their splits differ only where their shards or room do). On a CPU device, those an emulated GPU
    is given (``OFFLOAD_EMULATED_RATES``), or None: a CPU's own say nothing of a GPU's. A rank whose measuring
    fails says why, and every rank then plans without rates (state first): none is left waiting in the agreement."""
    if not accel.is_cuda and accel.emulated_rates is None:
        return None
    smallest(0, group, accel.device)  # the ranks start together: they share the host's memory as they will in Adam
    mine: Rates | None = None
    try:
        mine = _measured(accel.device, threads) if accel.is_cuda else _given(accel.emulated_rates or {})
    except (RuntimeError, ValueError) as e:  # out of memory, a pinned allocation refused, a bad emulated figure
        logger.warning("rank %d: measuring this machine's rates failed (%s); offload_optimizer.ratio auto keeps "
                       "the state first, as much as the room holds", group.rank, str(e).splitlines()[0])
    agreed = {name: smallest(int(getattr(mine, name) * 1e3) if mine else 0, group, accel.device) / 1e3  # MB/s
              for name in NAMES}
    return Rates(**agreed) if all(v > 0 for v in agreed.values()) else None


def _given(rates: dict[str, float]) -> Rates:
    unknown = set(rates) - set(NAMES)
    if unknown or len(rates) != len(NAMES):
        raise ValueError(f"OFFLOAD_EMULATED_RATES names {', '.join(sorted(unknown)) or 'too few rates'}; it gives "
                         f"each of {', '.join(NAMES)}")
    return Rates(**rates)


@functools.cache
def _measured(device: torch.device, threads: int | None) -> Rates:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    adam = _adam_seconds(threads)
    pinned = AlignedBuffer(COPY_BYTES, pin=cuda)  # unpinned after: it is no part of any budget
    try:
        up, down, within = _copy_seconds(pinned.tensor, device, sync)
    finally:
        pinned.release_pin()
    return Rates(device_gbps=2 * COPY_BYTES / within / 1e9,
                 host_gbps=ADAM_ELEMENTS * (ADAM_BYTES + 2) / adam / 1e9,
                 h2d_gbps=COPY_BYTES / up / 1e9, d2h_gbps=COPY_BYTES / down / 1e9)


def _copy_seconds(host: torch.Tensor, device: torch.device, sync: Callable[[], None]
                  ) -> tuple[float, float, float]:
    """A copy of ``host`` up, one down, and one within the device (its buffers freed after)."""
    on_device = torch.empty_like(host, device=device)
    other = torch.empty_like(on_device)
    return (_median_seconds(lambda: on_device.copy_(host, non_blocking=True), sync),
            _median_seconds(lambda: host.copy_(on_device, non_blocking=True), sync),
            _median_seconds(lambda: other.copy_(on_device), sync))


def _adam_seconds(threads: int | None) -> float:
    """The native Adam's pass over ``ADAM_ELEMENTS`` (its buffers freed after)."""
    master, grad, m, v = (torch.zeros(ADAM_ELEMENTS) for _ in range(4))
    out16 = torch.empty(ADAM_ELEMENTS, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return _median_seconds(lambda: adam_step(master, grad, m, v, 1, hyper, out16=out16, threads=threads),
                           lambda: None)


def describe(rates: Rates) -> str:
    return (f"host Adam {rates.host_gbps:,.0f} GB/s, host to device {rates.h2d_gbps:,.1f} GB/s, device to host "
            f"{rates.d2h_gbps:,.1f} GB/s, device memory {rates.device_gbps:,.0f} GB/s")
