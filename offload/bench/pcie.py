"""`offload bench pcie`: host<->GPU copy bandwidth from pinned and from pageable memory.

The runtime's host tier is pinned (page-locked) so that its copies are asynchronous DMA
on a copy stream; pageable memory is what a plain ``tensor.cuda()`` copies from. Each
direction is timed with CUDA events, pinned and pageable alternating so drift falls on
both, and the pinned figure is also taken on two streams at once (H2D beside D2H), the
way the prefetcher and the gradient drain use the link together. Needs a GPU.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from offload.machine.buffers import AlignedBuffer


@dataclass
class PcieResult:
    device: str
    bytes: int
    gbps: dict[str, float] = field(default_factory=dict)  # median GB/s per (memory, direction)
    pinned_over_pageable: dict[str, float] = field(default_factory=dict)
    duplex_gbps: float = 0.0  # H2D and D2H at once on two streams, both directions' bytes counted


def _timed_gbps(copy: Callable[[], object], nbytes: int, stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        copy()
        end.record(stream)
    end.synchronize()
    return nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def run(size: int = 256 << 20, repeats: int = 5, out: Path | None = None,
        stream: TextIO | None = None) -> PcieResult:
    if not torch.cuda.is_available():
        raise RuntimeError("offload bench pcie needs a GPU: torch.cuda.is_available() is False on this machine")
    numel = size // 4
    gpu = torch.empty(numel, device="cuda")
    gpu2 = torch.empty(numel, device="cuda")
    pinned_buf = AlignedBuffer(size, pin=True)
    pinned = pinned_buf.view(torch.float32, numel)  # the store's kind of host buffer
    pinned2 = torch.empty(numel).pin_memory()
    pageable = torch.empty(numel)
    pinned.fill_(1.0), pinned2.fill_(1.0), pageable.fill_(1.0), gpu.fill_(1.0)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    copies = {
        "pinned h2d": lambda: gpu.copy_(pinned, non_blocking=True),
        "pinned d2h": lambda: pinned.copy_(gpu, non_blocking=True),
        "pageable h2d": lambda: gpu.copy_(pageable, non_blocking=True),
        "pageable d2h": lambda: pageable.copy_(gpu, non_blocking=True),
    }
    samples: dict[str, list[float]] = {k: [] for k in copies}
    duplex: list[float] = []
    for copy in copies.values():  # warm-up
        _timed_gbps(copy, size, s1)
    for _ in range(repeats):
        for name, copy in copies.items():
            samples[name].append(_timed_gbps(copy, size, s1))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        s1.wait_event(start)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            gpu.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(gpu2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
        end.record()
        end.synchronize()
        duplex.append(2 * size / (start.elapsed_time(end) / 1e3) / 1e9)
    gbps = {k: statistics.median(v) for k, v in samples.items()}
    result = PcieResult(device=torch.cuda.get_device_name(), bytes=size, gbps=gbps,
                        pinned_over_pageable={d: gbps[f"pinned {d}"] / gbps[f"pageable {d}"] for d in ("h2d", "d2h")},
                        duplex_gbps=statistics.median(duplex))
    pinned_buf.release_pin()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))
    if stream is not None:
        print_table(result, stream)
    return result


def print_table(result: PcieResult, out: TextIO) -> None:
    print(f"{result.device}, {result.bytes / 2**20:.0f} MiB per copy (median GB/s)", file=out)
    for d in ("h2d", "d2h"):
        print(f"  {d}: pinned {result.gbps[f'pinned {d}']:6.1f}, pageable {result.gbps[f'pageable {d}']:6.1f}"
              f"  = pinned {result.pinned_over_pageable[d]:.2f}x pageable", file=out)
    print(f"  both directions at once on two streams (pinned): {result.duplex_gbps:.1f} GB/s", file=out)
