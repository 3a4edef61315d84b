"""`offload bench adam`: the CPU optimizer step against torch's AdamW and the DRAM ceiling, in one run.

The ceiling is the faster of two in-place probes run just before, with the same threads:
an axpy (read 2, write 1) and Adam's own traffic without its arithmetic (read 4, write 3).

Every timed call starts with a cold cache: a sweep over twice the last-level cache runs
before it, outside the timing. In a training step the optimizer state arrives from DRAM
(forward and backward have evicted it), and without the sweep the contenders would find
each other's leftovers in a large L3 (480 MiB here holds a 10M-parameter Adam's state
almost whole), favouring whichever runs after a contender that shares its tensors.

Two comparisons at each size, medians of repeated runs on the same machine:
1. Adam alone (fp32 grads): ours vs torch.optim.AdamW(fused=True) and (foreach=True), beside
   the in-place read-modify-write bandwidth measured now (the ceiling for an in-place update);
   and ours writing the new state into a second slot, as the speculative step does (its stores
   go around the cache: see [Note: streaming stores] in native/kernels.cpp).
2. The whole CPU side of an offloaded step: bf16 grads in -> global norm -> clip -> AdamW ->
   bf16 params out. Ours is one norm pass plus one fused step pass; torch's is the best
   composition of its ops (grad.float(), clip_grad_norm_, fused AdamW, param.to(bfloat16)).
3. The same CPU side with the state in fewer bytes (offload/store/state_format.py), each format
   beside the fp32 one: its time as a fraction of fp32's, and its bandwidth for its own bytes
   against the ceiling.
4. Each format's compute floor: the same pass with its state hot in one core's cache, per element,
   scaled to the size and threads above. Fewer bytes only shorten a step that memory bounds; where
   the cold step sits at its compute floor (a core's two 512-bit ports widening and rounding 16-bit
   values beside Adam's square root and divide), a format moves its time by its arithmetic instead.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.bench.comparison import RATE, TIME, Comparison
from offload.machine import cpus, native
from offload.optim import AdamHyper, adam_step
from offload.optim.loss_scale import clip_coefficient
from offload.optim.one_state import adagrad_step, lion_step
from offload.store.state_format import FORMATS, Master, StateFormat, split_master
from offload.store.step_cost import ADAM_BYTES  # read p, g, m, v; write p, m, v (fp32)

FUSED_BYTES = 30     # bf16 grad read twice (norm + step), p/m/v read and written, bf16 copy written
AXPY_BYTES = 12      # a += s * b: read a, b; write a
ONE_STATE_BYTES = 20  # Lion or Adagrad: read p, g, the state; write p, the state (fp32)
ONE_STATE_HELD_BYTES = 16  # the same, the master 16+16 (2 + 2 each way) and the state bf16, the gradient fp32
FP32_SIDE = "the fp32 state's CPU side (norm, clipped step, bf16 weights out)"
HYPER = AdamHyper(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux), or 256 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return max(sizes, default=256 << 20)


class CacheFlush:
    """Sweeps (reads and writes) twice the last-level cache, so the next call finds its data in DRAM."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(2 * last_level_cache_bytes() // 4)

    def __call__(self) -> None:
        self.buffer.add_(1.0)


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                before: Callable[[], None] | None = None) -> dict[str, float]:
    """Median seconds of each function, run in alternating rounds: memory bandwidth here drifts
    20-30% within an hour, and rounds spread that drift over every contender alike. ``before`` runs
    ahead of every timed call, outside the timing."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if before is not None:
                before()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


@dataclass
class Row:
    size: int
    what: str
    impl: str
    seconds: float
    params_per_s: float
    gb_per_s: float
    fraction_of_ceiling: float | None = None
    versus: Comparison | None = None  # what this row is compared with, where it is


@dataclass
class Report:
    machine: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)


def _machine(threads: int) -> dict[str, Any]:
    import platform

    import psutil
    return {"cpu": platform.processor() or platform.machine(), "threads": threads,
            "physical_cores": psutil.cpu_count(logical=False), "usable_physical_cores": cpus.physical_cores(),
            "usable_cpus": cpus.usable_cpus(), "kernel_variant": native.active_variant(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def _ceiling_probes(n: int, repeats: int, threads: int, flush: Callable[[], None] | None,
                    gen: torch.Generator) -> tuple[float, float]:
    """Seconds of the two in-place probes (axpy, Adam-shaped traffic) on ``n`` elements, measured now on the same
    threads and tiles; their arrays are freed before the Adam runs are measured."""
    a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
    t = interleaved({"axpy": lambda: native.axpy_(a, b, 1e-6, threads=threads),
                     "touch3": lambda: native.touch3_(a, c, d, b, threads=threads)}, repeats, before=flush)
    return t["axpy"], t["touch3"]


def bench_size(n: int, repeats: int, threads: int, say: Callable[[str], None],
               flush: Callable[[], None] | None = None) -> list[Row]:
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    # The ceiling: the faster of two in-place probes measured now, on the same threads and tiles.
    axpy, touch = _ceiling_probes(n, repeats, threads, flush, gen)
    probes = {"in-place axpy a += s*b (read 2, write 1)": (axpy, AXPY_BYTES),
              "Adam-shaped traffic p,m,v += g (read 4, write 3)": (touch, ADAM_BYTES)}
    ceiling = 0.0
    for impl, (seconds, nbytes) in probes.items():
        gbs = nbytes * n / seconds / 1e9
        ceiling = max(ceiling, gbs)
        rows.append(Row(n, "ceiling", impl, seconds, n / seconds, gbs))
        say(f"  {n:>11,}  ceiling    {impl:<56} {gbs:5.1f} GB/s")

    size = f"{n / 1e6:g}M elements"

    def row(what: str, impl: str, seconds: float, nbytes: int, base: tuple[str, float] | None = None) -> Row:
        """``base``: the (name, seconds) of what this row is faster or slower than: a rate ratio."""
        gbs = nbytes * n / seconds / 1e9
        versus = None if base is None else Comparison("adam", impl, base[0], RATE, base[1] / seconds, size)
        r = Row(n, what, impl, seconds, n / seconds, gbs, gbs / ceiling, versus)
        ratio = f"  {versus.value:4.2f}x the rate of {base[0]}" if versus is not None and base is not None else ""
        say(f"  {n:>11,}  {what:<10} {impl:<56} {seconds * 1e3:8.1f} ms  {n / seconds / 1e9:5.2f} G params/s  "
            f"{gbs:5.1f} GB/s ({gbs / ceiling:4.0%} of ceiling){ratio}"
            + ("  (above the ceiling probed just before: the machine's bandwidth moved between them)"
               if gbs > 1.05 * ceiling else ""))
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

    slot = (torch.empty(n), torch.empty(n), torch.empty(n))

    def ours_elsewhere() -> None:  # the speculative step: the new state into a second slot, the old one kept
        step[0] += 1
        adam_step(p, g, m, v, step[0], HYPER, threads=threads, into=slot)

    tp = torch.nn.Parameter(p.clone())
    tp.grad = g.clone()
    kw: dict[str, Any] = dict(lr=HYPER.lr, betas=HYPER.betas, eps=HYPER.eps, weight_decay=HYPER.weight_decay)
    fused = torch.optim.AdamW([tp], fused=True, **kw)
    foreach = torch.optim.AdamW([tp], foreach=True, **kw)
    # each with the software prefetch and without (see [Note: prefetch by measurement] in offload/machine/prefetch.py)
    variant = native.active_variant()
    ours_fns = {f"offload adam_step ({variant}, {how})": prefetching(on, ours) for on, how in PREFETCH_HOW}
    ours_fns[f"offload adam_step into a second slot ({variant})"] = ours_elsewhere
    fused_name = "torch AdamW fused=True"
    contenders: dict[str, Callable[[], object]] = {fused_name: fused.step, "torch AdamW foreach=True": foreach.step}
    t = interleaved(contenders | ours_fns, repeats, before=flush)
    for impl, seconds in t.items():
        row("adam", impl, seconds, ADAM_BYTES, (fused_name, t[fused_name]) if impl in ours_fns else None)
    del fused, foreach

    # 2. The whole CPU side: bf16 grads in, bf16 params out.
    g16 = g.to(torch.bfloat16)
    out16 = torch.empty(n, dtype=torch.bfloat16)

    def ours_fused() -> None:
        norm = native.grad_sq_norm(g16, threads=threads)
        scale = 1.0 if norm.nonfinite else clip_coefficient(norm.norm, MAX_NORM)
        step[0] += 1
        adam_step(p, g16, m, v, step[0], HYPER, grad_scale=scale, out16=out16, threads=threads)

    opt = torch.optim.AdamW([tp], fused=True, **kw)
    tout = torch.empty(n, dtype=torch.bfloat16)

    def torch_side() -> None:
        tp.grad = g16.float()
        torch.nn.utils.clip_grad_norm_([tp], MAX_NORM)
        opt.step()
        tout.copy_(tp.detach())

    torch_name = "torch float()+clip+fused AdamW+to(bf16)"
    ours_name = f"offload norm + fused step ({native.active_variant()})"
    t = interleaved({torch_name: torch_side, ours_name: ours_fused}, repeats, before=flush)
    row("cpu-side", torch_name, t[torch_name], FUSED_BYTES)
    row("cpu-side", ours_name, t[ours_name], FUSED_BYTES, (torch_name, t[torch_name]))

    # 3. The CPU side per state format, beside fp32's.
    steps = {name: format_step(fmt, p, g16, threads, step) for name, fmt in FORMATS.items()}
    t = interleaved({name: fn for name, (fn, _) in steps.items()}, repeats, before=flush)
    base = t["fp32"]
    for name, seconds in t.items():
        r = row("format", f"{name}: {FORMATS[name].describe()}", seconds, steps[name][1])
        if name != "fp32":
            r.versus = Comparison("adam", f"state format {name}", FP32_SIDE, TIME, seconds / base, size)
            say(f"  {n:>11,}  {'':<10} {'':<56} {seconds / base:4.2f}x the time of {FP32_SIDE}")

    # 4. Each format's compute floor at this size and thread count, beside its cold time.
    per_element = compute_per_element(p, g16, repeats)
    for name, ns in per_element.items():
        if ns <= 0:  # the larger size ran no slower than the smaller: the machine moved under the probe
            say(f"  {n:>11,}  compute    {name}: its floor could not be measured (the machine's speed moved)")
            continue
        floor = ns * 1e-9 * n / threads
        # the cold step's time over its compute floor (near 1: compute bounds it)
        rows.append(Row(n, "compute", f"{name}: state hot in the cache (floor)", floor, n / floor,
                        steps[name][1] * n / floor / 1e9, None,
                        Comparison("adam", f"state format {name}: the step, state from DRAM",
                                   "its compute floor (the state hot in a core's cache)", TIME, t[name] / floor, size)))
        say(f"  {n:>11,}  compute    {name + ': its floor, state hot in the cache':<56} {floor * 1e3:8.1f} ms  "
            f"({ns:4.2f} ns an element on one core); the cold step is {t[name] / floor:4.2f}x this floor")

    # 5. Lion and Adagrad (offload/optim/one_state.py) beside torch's: torch.optim.Adagrad, and Lion in torch's ops
    # (torch has no Lion; the reference update, as DeepSpeed's and lion-pytorch's).
    lion_m, ada_sum, ada_step = torch.zeros(n), torch.zeros(n), [0]
    ref_m = torch.zeros(n)

    def our_lion() -> None:
        lion_step(p, g, lion_m, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, threads=threads)

    def torch_lion() -> None:
        with torch.no_grad():
            tp.mul_(1 - 1e-4 * 0.1)
            tp.add_(ref_m.mul(0.9).add_(g, alpha=0.1).sign_(), alpha=-1e-4)
            ref_m.mul_(0.99).add_(g, alpha=0.01)

    def our_adagrad() -> None:
        ada_step[0] += 1
        adagrad_step(p, g, ada_sum, ada_step[0], lr=1e-2, threads=threads)

    # the same two held in fewer bytes: the 16+16 master and a bf16 buffer (the weights are the master's high half)
    (lion_hi, lion_lo), (ada_hi, ada_lo) = split_master(p.clone()), split_master(p.clone())
    lion_m16, ada_sum16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def our_lion_held() -> None:
        lion_step(lion_hi, g, lion_m16, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, threads=threads,
                  master_lo=lion_lo)

    def our_adagrad_held() -> None:
        adagrad_step(ada_hi, g, ada_sum16, max(ada_step[0], 1), lr=1e-2, threads=threads, master_lo=ada_lo)

    tp.grad = g.clone()
    torch_adagrad = torch.optim.Adagrad([tp], lr=1e-2, foreach=True)
    lion_torch, adagrad_torch = "torch ops Lion (the reference update)", "torch Adagrad foreach=True"
    held = f"16+16 master, bf16 buffer ({variant})"
    t = interleaved({lion_torch: torch_lion, f"offload lion_step ({variant})": our_lion,
                     f"offload lion_step, {held}": our_lion_held,
                     adagrad_torch: torch_adagrad.step, f"offload adagrad_step ({variant})": our_adagrad,
                     f"offload adagrad_step, {held}": our_adagrad_held},
                    repeats, before=flush)
    for impl, seconds in t.items():
        against = None if impl.startswith("torch") else (lion_torch, t[lion_torch]) if "lion" in impl else (
            adagrad_torch, t[adagrad_torch])
        row("lion" if "Lion" in impl or "lion" in impl else "adagrad", impl, seconds,
            ONE_STATE_HELD_BYTES if "16+16" in impl else ONE_STATE_BYTES, against)
    return rows


PREFETCH_HOW = ((True, "prefetching"), (False, "hardware prefetch only"))


def prefetching(on: bool, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with the Adam pass's software prefetch on (the variant's distance) or off, as it was after."""
    def run() -> None:
        with native.prefetching(None if on else 0):
            fn()
    return run


HOT_SMALL, HOT_LARGE = 2048, 49152  # elements: the larger one's state (under 1.5 MB) stays in a core's L2


def compute_per_element(p0: torch.Tensor, g16: torch.Tensor, repeats: int, calls: int = 100) -> dict[str, float]:
    """Nanoseconds an element of each format's CPU side on one thread, its state hot in the cache: the slope
    between two small sizes, so the fixed cost of a call (the binding, the pool's hand-off) drops out."""
    step = [0]
    fns: dict[str, Callable[[], None]] = {}
    for size in (HOT_SMALL, HOT_LARGE):
        for name, fmt in FORMATS.items():
            fn = format_step(fmt, p0[:size].clone(), g16[:size].clone(), 1, step)[0]

            def many(fn: Callable[[], None] = fn) -> None:
                for _ in range(calls):
                    fn()
            fns[f"{name}@{size}"] = many
    t = interleaved(fns, max(repeats, 3))
    return {name: (t[f"{name}@{HOT_LARGE}"] - t[f"{name}@{HOT_SMALL}"]) / calls / (HOT_LARGE - HOT_SMALL) * 1e9
            for name in FORMATS}


def format_step(fmt: StateFormat, p0: torch.Tensor, g16: torch.Tensor, threads: int, step: list[int]
                 ) -> tuple[Callable[[], None], int]:
    """The CPU side of a step (norm of the bf16 gradient, the clipped step, the bf16 weights out) with the state
    held in ``fmt``, and the bytes an element it moves: the gradient read twice, the state read and written, the
    weights written (a 16-bit master is the weights: nothing more to write)."""
    n = p0.numel()
    m, v = torch.zeros(n, dtype=fmt.moments), torch.zeros(n, dtype=fmt.moments)
    lo = None
    if fmt.master is Master.SPLIT:
        master, lo = split_master(p0)
    else:
        master = p0.to(fmt.master_dtype)
    out16 = torch.empty(n, dtype=torch.bfloat16) if fmt.master is Master.FP32 else None
    stochastic = native.Stochastic(1) if fmt.master is Master.BF16_STOCHASTIC else None

    def run() -> None:
        norm = native.grad_sq_norm(g16, threads=threads)
        scale = 1.0 if norm.nonfinite else clip_coefficient(norm.norm, MAX_NORM)
        step[0] += 1
        adam_step(master, g16, m, v, step[0], HYPER, grad_scale=scale, out16=out16, threads=threads, master_lo=lo,
                  stochastic=stochastic)

    return run, 2 * fmt.bytes_per_element + 2 * g16.element_size() + (2 if out16 is not None else 0)


def run(sizes: list[int], repeats: int = 5, threads: int | None = None, out: Path | None = None,
        stream: TextIO | None = None) -> Report:
    threads = threads or native.default_threads()
    with cpus.torch_threads(threads):
        return _run(sizes, repeats, threads, out, stream)


def _run(sizes: list[int], repeats: int, threads: int, out: Path | None, stream: TextIO | None) -> Report:
    def say(msg: str) -> None:
        if stream is not None:
            print(msg, file=stream, flush=True)

    report = Report(machine=_machine(threads))
    flush = CacheFlush()
    report.machine["cache_flush_bytes"] = flush.buffer.numel() * 4
    say(f"offload bench adam: {threads} threads, kernel {native.active_variant()}, torch {torch.__version__}, "
        f"median of {repeats}, each call from a cold cache ({flush.buffer.numel() * 4 / 2**20:.0f} MiB swept "
        "before it)")
    for n in sizes:
        report.rows.extend(bench_size(n, repeats, threads, say, flush))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": report.machine, "rows": [asdict(r) for r in report.rows]}, indent=2))
        say(f"wrote {out}")
    return report
