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
import statistics
import time
from collections.abc import Callable

import torch

from offload.machine.accelerator import Accelerator
from offload.optim.adam import AdamHyper, adam_step
from offload.store.step_cost import ADAM_BYTES, Rates
from offload.zero.collectives import Group, smallest

ADAM_ELEMENTS = 16 << 20  # 64 MiB a buffer, 288 MiB in all: past a host's caches
COPY_BYTES = 64 << 20
ROUNDS = 3


def _median_seconds(run: Callable[[], None], sync: Callable[[], None]) -> float:
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
    """This machine's rates (see [Note: rates measured at start-up]), the slowest rank's each: every rank plans
    with the same figures, so the ranks' splits are alike. On a CPU device, those an emulated GPU is given
    (``OFFLOAD_EMULATED_RATES``), or None: a CPU's own say nothing of a GPU's."""
    if accel.is_cuda:
        mine = _measured(accel.device, threads)
    elif accel.emulated_rates is not None:
        unknown = set(accel.emulated_rates) - set(NAMES)
        if unknown or len(accel.emulated_rates) != len(NAMES):
            raise ValueError(f"OFFLOAD_EMULATED_RATES names {', '.join(sorted(unknown)) or 'too few rates'}; it "
                             f"gives each of {', '.join(NAMES)}")
        mine = Rates(**accel.emulated_rates)
    else:
        return None
    agreed = {name: smallest(int(getattr(mine, name) * 1e3), group, accel.device) / 1e3  # MB/s
              for name in NAMES}
    return Rates(**agreed)


@functools.cache
def _measured(device: torch.device, threads: int | None) -> Rates:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    adam = _adam_seconds(threads)
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=cuda)
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)
    up = _median_seconds(lambda: on_device.copy_(host, non_blocking=True), sync)
    down = _median_seconds(lambda: host.copy_(on_device, non_blocking=True), sync)
    within = _median_seconds(lambda: other.copy_(on_device), sync)
    return Rates(device_gbps=2 * COPY_BYTES / within / 1e9,
                 host_gbps=ADAM_ELEMENTS * (ADAM_BYTES + 2) / adam / 1e9,
                 h2d_gbps=COPY_BYTES / up / 1e9, d2h_gbps=COPY_BYTES / down / 1e9)


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
