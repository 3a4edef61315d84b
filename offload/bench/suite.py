"""`offload bench all`: every benchmark this machine supports, in one run, into one JSON and one summary plot.

Each benchmark keeps its own baseline (torch's fused AdamW for adam, the other engine,
checksums off and fio for nvme, plain PyTorch for step and DeepSpeed's ZeRO-3 beside it
where DeepSpeed is installed, pageable memory for pcie) and
the summary collects the headline ratio of each: what a reader compares across machines
is the ratio, never the absolute figure. ``--quick`` shrinks every size and runs only the
headline variants, so the whole run takes well under a minute here (a smoke test of the
benchmarks, not figures to quote).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.bench import adam, nvme, pcie, step, versus


@dataclass
class Headline:
    bench: str
    what: str
    ratio: float  # > 1: better than the baseline, except step (offload / baseline time: lower is better)
    baseline: str


@dataclass
class SuiteResult:
    machine: dict[str, Any]
    quick: bool
    results: dict[str, Any] = field(default_factory=dict)
    headlines: list[Headline] = field(default_factory=list)


def run_all(path: Path, out_dir: Path, quick: bool, stream: TextIO) -> SuiteResult:
    suite = SuiteResult(machine={"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                        quick=quick)

    def section(name: str) -> None:
        print(f"\n== {name}", file=stream, flush=True)

    res: pcie.PcieResult | step.StepResult  # the PCIe bench's, then each step bench's
    if torch.cuda.is_available():
        section("pcie: pinned vs pageable host<->GPU copies")
        res = pcie.run(size=(64 << 20) if quick else (256 << 20), repeats=3 if quick else 5, stream=stream)
        suite.results["pcie"] = asdict(res)
        suite.headlines += [Headline("pcie", f"pinned {d}", r, "pageable") for d, r in res.pinned_over_pageable.items()]
    section("adam: native CPU Adam vs torch's fused AdamW")
    report = adam.run([10_000_000] if quick else [10_000_000, 100_000_000], repeats=3 if quick else 5, stream=stream)
    suite.results["adam"] = asdict(report)
    largest = max(r.size for r in report.rows)
    for row in report.rows:
        if row.size == largest and row.ratio_vs_baseline is not None:
            suite.headlines.append(Headline("adam", f"{row.what} at {largest / 1e6:.0f}M", row.ratio_vs_baseline,
                                            "torch fused AdamW"))
    section("nvme: swap I/O engines, with checksums, and fio when installed")
    rows = nvme.run(path, size=(64 << 20) if quick else (1 << 30), blocks=(1 << 20,) if quick else (1 << 20, 8 << 20),
                    depths=(8,) if quick else (8, 32), rounds=1 if quick else 3, stream=stream)
    suite.results["nvme"] = [asdict(r) for r in rows]
    for op in ("read", "write"):
        ours = [r for r in rows if r.op == op and not r.impl.startswith("fio")]
        fio = [r for r in rows if r.op == op and r.impl.startswith("fio")]
        if ours and fio:
            suite.headlines.append(Headline("nvme", f"{op} (best engine)", max(r.gb_per_s for r in ours) /
                                            max(r.gb_per_s for r in fio), "fio"))
        elif ours:
            base = min(r.gb_per_s for r in ours)
            suite.headlines.append(Headline("nvme", f"{op} (best engine)", max(r.gb_per_s for r in ours) / base,
                                            "slowest engine (fio not installed)"))
    for where in ("cpu", "nvme"):
        section(f"step: ZeRO-3 training step, offload {where}, beside plain PyTorch")
        small: dict[str, Any] = dict(hidden=128, layers=2, seq=64, micro=2, steps=2, warmup=1, repeats=1,
                                     headline_only=True) if quick else {}
        bench = step.StepBench(offload=where, nvme_path=str(path), trace_dir=str(out_dir), **small)
        res = step.run(bench, out_dir / f"step-{where}.json", log=stream)
        step.print_table(res, stream)
        suite.results[f"step_{where}"] = asdict(res)
        if res.ratio is not None:  # plain PyTorch ran (it may not fit on a GPU)
            suite.headlines.append(Headline("step", f"offload {where} / torch step time", res.ratio,
                                            "plain PyTorch"))
    if versus.deepspeed_version() is not None:
        section("step: offload beside DeepSpeed ZeRO-3, params and optimizer on the host and on NVMe")
        small = dict(hidden=128, layers=2, seq=64, micro=2, steps=2, warmup=1, repeats=1) if quick else {}
        bench = step.StepBench(offload="nvme", nvme_path=str(path), world=1, **small)
        vs = versus.run(bench, out_dir / "versus" / "step-vs-deepspeed.json", log=stream)
        versus.print_table(vs, stream)
        suite.results["step_vs_deepspeed"] = asdict(vs)
        for name, ratios in vs.ratios.items():
            if "offload/deepspeed" in ratios:
                suite.headlines.append(Headline("step", f"offload / DeepSpeed step time, {name}",
                                                ratios["offload/deepspeed"], "DeepSpeed ZeRO-3"))
    else:
        print("\n(DeepSpeed is not installed: no side-by-side with it; ./dev.sh deepspeed installs it)", file=stream)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "all.json").write_text(json.dumps(asdict(suite), indent=2))
    plot(suite, out_dir / "summary.png")
    section("summary (ratio against each benchmark's baseline)" + (": --quick, a smoke run, not figures to quote"
                                                                      if quick else ""))
    for h in suite.headlines:
        better = "lower is better" if h.bench == "step" else "higher is better"
        print(f"  {h.bench:5s} {h.what:38s} {h.ratio:6.2f}x  vs {h.baseline} ({better})", file=stream)
    print(f"wrote {out_dir / 'all.json'} and {out_dir / 'summary.png'}", file=stream)
    return suite


def plot(suite: SuiteResult, path: Path) -> None:
    """One bar per headline ratio, grouped by benchmark, with the baseline at 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [f"{h.bench}: {h.what}\n(vs {h.baseline})" for h in suite.headlines]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.5))
    colors = ["tab:orange" if h.bench == "step" else "tab:blue" for h in suite.headlines]
    ax.barh(names, [h.ratio for h in suite.headlines], color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("ratio to the baseline (blue: higher is better; orange, step time: lower is better)")
    title = f"offload bench all{' --quick' if suite.quick else ''}: {suite.machine['cpu']}"
    ax.set_title(title + (f", {suite.machine['gpu']}" if suite.machine["gpu"] else ", no GPU"))
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
