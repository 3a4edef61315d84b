"""`offload bench adam`: the CPU optimizer step against torch's AdamW and the DRAM ceiling, in one run.

Two comparisons at each size, medians of repeated runs on the same machine:
1. Adam alone (fp32 grads): ours vs torch.optim.AdamW(fused=True) and (foreach=True), beside
   the in-place read-modify-write bandwidth measured now (the ceiling for an in-place update).
2. The whole CPU side of an offloaded step: bf16 grads in -> global norm -> clip -> AdamW ->
   bf16 params out. Ours is one norm pass plus one fused step pass; torch's is the best
   composition of its ops (grad.float(), clip_grad_norm_, fused AdamW, param.to(bfloat16)).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from offload import native
from offload.optim import AdamHyper, adam_step

ADAM_BYTES = 28      # read p, g, m, v; write p, m, v (fp32)
FUSED_BYTES = 30     # bf16 grad read twice (norm + step), p/m/v read and written, bf16 copy written
AXPY_BYTES = 12      # a += s * b: read a, b; write a
HYPER = AdamHyper(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0


def median_seconds(fn: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Row:
    size: int
    what: str
    impl: str
    seconds: float
    params_per_s: float
    gb_per_s: float
    fraction_of_ceiling: float | None = None
    ratio_vs_baseline: float | None = None


@dataclass
class Report:
    machine: dict = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)


def _machine(threads: int) -> dict:
    import platform

    import psutil
    return {"cpu": platform.processor() or platform.machine(), "threads": threads,
            "physical_cores": psutil.cpu_count(logical=False), "kernel_variant": native.active_variant(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def bench_size(n: int, repeats: int, threads: int, say: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    axpy = median_seconds(lambda: a.add_(b, alpha=1e-6), repeats)
    ceiling = AXPY_BYTES * n / axpy / 1e9
    rows.append(Row(n, "ceiling", "in-place axpy (torch add_)", axpy, n / axpy, ceiling))
    say(f"  {n:>11,}  in-place bandwidth ceiling {ceiling:6.1f} GB/s")
    del a, b

    def row(what: str, impl: str, seconds: float, nbytes: int, base: float | None) -> Row:
        gbs = nbytes * n / seconds / 1e9
        r = Row(n, what, impl, seconds, n / seconds, gbs, gbs / ceiling, None if base is None else base / seconds)
        ratio = f"  {r.ratio_vs_baseline:4.2f}x vs torch" if base is not None else ""
        say(f"  {n:>11,}  {what:<10} {impl:<34} {seconds * 1e3:8.1f} ms  {n / seconds / 1e9:5.2f} G params/s  "
            f"{gbs:5.1f} GB/s ({gbs / ceiling:4.0%} of ceiling){ratio}")
        rows.append(r)
        return r

    # 1. Adam alone, fp32 gradients.
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    m, v = torch.zeros(n), torch.zeros(n)
    step = [0]

    def ours() -> None:
        step[0] += 1
        adam_step(p, g, m, v, step[0], HYPER, threads=threads)

    tp = torch.nn.Parameter(p.clone())
    tp.grad = g.clone()
    fused = torch.optim.AdamW([tp], lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, weight_decay=HYPER.weight_decay,
                              fused=True)
    t_fused = median_seconds(fused.step, repeats)
    row("adam", "torch AdamW fused=True", t_fused, ADAM_BYTES, None)
    del fused
    foreach = torch.optim.AdamW([tp], lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps,
                                weight_decay=HYPER.weight_decay, foreach=True)
    row("adam", "torch AdamW foreach=True", median_seconds(foreach.step, repeats), ADAM_BYTES, None)
    del foreach
    row("adam", f"offload adam_step ({native.active_variant()})", median_seconds(ours, repeats), ADAM_BYTES, t_fused)

    # 2. The whole CPU side: bf16 grads in, bf16 params out.
    g16 = g.to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)

    def ours_fused() -> None:
        norm = native.grad_sq_norm(g16, threads=threads)
        scale = 1.0 if norm.nonfinite else min(1.0, MAX_NORM / (norm.norm + 1e-6))
        step[0] += 1
        adam_step(p, g16, m, v, step[0], HYPER, grad_scale=scale, out16=out16, threads=threads)

    opt = torch.optim.AdamW([tp], lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, weight_decay=HYPER.weight_decay,
                            fused=True)
    tout = torch.empty(n, dtype=torch.bfloat16)

    def torch_side() -> None:
        tp.grad = g16.float()
        torch.nn.utils.clip_grad_norm_([tp], MAX_NORM)
        opt.step()
        tout.copy_(tp.detach())

    t_torch = median_seconds(torch_side, repeats)
    row("cpu-side", "torch float()+clip+fused AdamW+to(bf16)", t_torch, FUSED_BYTES, None)
    row("cpu-side", f"offload norm + fused step ({native.active_variant()})", median_seconds(ours_fused, repeats),
        FUSED_BYTES, t_torch)
    return rows


def run(sizes: list[int], repeats: int = 5, threads: int | None = None, out: Path | None = None,
        stream: TextIO | None = None) -> Report:
    threads = threads or native.default_threads()
    torch.set_num_threads(threads)

    def say(msg: str) -> None:
        if stream is not None:
            print(msg, file=stream, flush=True)

    report = Report(machine=_machine(threads))
    say(f"offload bench adam: {threads} threads, kernel {native.active_variant()}, torch {torch.__version__}, "
        f"median of {repeats}")
    for n in sizes:
        report.rows.extend(bench_size(n, repeats, threads, say))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": report.machine, "rows": [asdict(r) for r in report.rows]}, indent=2))
        say(f"wrote {out}")
    return report


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)
