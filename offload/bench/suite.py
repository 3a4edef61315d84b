"""`offload bench all`: every benchmark this machine supports, in one run, into one JSON and one summary plot.

Each benchmark keeps its own baseline (torch's fused AdamW for adam, the other engine,
checksums off and fio for nvme, plain PyTorch for step and DeepSpeed's ZeRO-3 beside it
where DeepSpeed is installed, pageable memory for pcie) and
the summary collects the headline ratio of each: what a reader compares across machines
is the ratio, never the absolute figure. Each is a ``Comparison`` (offload/bench/comparison.py),
which names its subject and baseline and says by its quantity which way is better, so the
printed summary, ``all.json`` and ``summary.png`` read the same. ``--quick`` shrinks every size
and runs only the headline variants (a smoke test of the benchmarks, not figures to quote).
"""

from __future__ import annotations

import json
import platform
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.bench import adam, nvme, pcie, step, versus
from offload.bench.comparison import RATE, TIME, Comparison, grouped, summary_lines


@dataclass
class SuiteResult:
    machine: dict[str, Any]
    quick: bool
    results: dict[str, Any] = field(default_factory=dict)
    headlines: list[Comparison] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # each section's wall time


def run_all(path: Path, out_dir: Path, quick: bool, stream: TextIO) -> SuiteResult:
    suite = SuiteResult(machine={"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
                        quick=quick)

    started: list[tuple[str, float]] = []

    def section(key: str, name: str) -> None:
        """Start the next section, the last one's wall time kept (where --quick spends its time)."""
        now = time.perf_counter()
        if started:
            suite.seconds[started[-1][0]] = now - started[-1][1]
        started.append((key, now))
        print(f"\n== {name}", file=stream, flush=True)

    res: pcie.PcieResult | step.StepResult  # the PCIe bench's, then each step bench's
    if torch.cuda.is_available():
        section("pcie", "pcie: pinned vs pageable host<->GPU copies")
        res = pcie.run(size=(64 << 20) if quick else (256 << 20), repeats=3 if quick else 5, stream=stream)
        suite.results["pcie"] = asdict(res)
        suite.headlines += [Comparison("pcie", f"pinned {d} copies", f"pageable {d} copies", RATE, r)
                            for d, r in res.pinned_over_pageable.items()]
    section("adam", "adam: native CPU Adam vs torch's fused AdamW")
    report = adam.run([10_000_000] if quick else [10_000_000, 100_000_000], repeats=3 if quick else 5, stream=stream)
    suite.results["adam"] = asdict(report)
    suite.headlines += adam_headlines(report)
    section("nvme", "nvme: swap I/O engines, with checksums, and fio when installed")
    rows = nvme.run(path, size=(64 << 20) if quick else (1 << 30), blocks=(1 << 20,) if quick else (1 << 20, 8 << 20),
                    depths=(8,) if quick else (8, 32), rounds=1 if quick else 3, stream=stream)
    suite.results["nvme"] = [asdict(r) for r in rows]
    for op in ("read", "write"):
        ours = [r for r in rows if r.op == op and not r.impl.startswith("fio")]
        fio = [r for r in rows if r.op == op and r.impl.startswith("fio")]
        if ours and fio:
            suite.headlines.append(Comparison("nvme", f"{op}s, offload's best engine", f"fio's best {op}s", RATE,
                                              max(r.gb_per_s for r in ours) / max(r.gb_per_s for r in fio)))
        elif ours:
            base = min(r.gb_per_s for r in ours)
            suite.headlines.append(Comparison("nvme", f"{op}s, offload's best engine",
                                              f"offload's slowest engine's {op}s (fio not installed)", RATE,
                                              max(r.gb_per_s for r in ours) / base))
    for where in ("cpu", "nvme"):
        section(f"step {where}", f"step: ZeRO-3 training step, offload {where}, beside plain PyTorch")
        small: dict[str, Any] = dict(hidden=128, layers=2, seq=64, micro=2, steps=2, warmup=1, repeats=1,
                                     headline_only=True) if quick else {}
        bench = step.StepBench(offload=where, nvme_path=str(path), trace_dir=str(out_dir), **small)
        res = step.run(bench, out_dir / f"step-{where}.json", log=stream)
        step.print_table(res, stream)
        suite.results[f"step_{where}"] = asdict(res)
        if res.ratio is not None:  # plain PyTorch ran (it may not fit on a GPU)
            suite.headlines.append(Comparison("step", f"offload, params and optimizer state on {where}",
                                              "plain PyTorch's step", TIME, res.ratio))
    if versus.deepspeed_version() is not None:
        section("deepspeed", "step: offload beside DeepSpeed ZeRO-3, params and optimizer on the host and on NVMe")
        small = dict(hidden=128, layers=2, seq=64, micro=2, steps=2, warmup=1, repeats=1) if quick else {}
        bench = step.StepBench(offload="nvme", nvme_path=str(path), world=1, **small)
        vs = versus.run(bench, out_dir / "versus" / "step-vs-deepspeed.json", log=stream)
        versus.print_table(vs, stream)
        suite.results["step_vs_deepspeed"] = asdict(vs)
        for name, ratios in vs.ratios.items():
            if "offload/deepspeed" in ratios:
                where = versus.PLACEMENTS[name].describe() if name in versus.PLACEMENTS else name
                suite.headlines.append(Comparison("step", f"offload, {where}", "DeepSpeed ZeRO-3's step", TIME,
                                                  ratios["offload/deepspeed"]))
    else:
        print("\n(DeepSpeed is not installed: no side-by-side with it; ./dev.sh deepspeed installs it)", file=stream)
    section("summary", "summary: each figure is its subject's time or rate over its baseline's"
            + (": --quick, a smoke run, not figures to quote" if quick else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "all.json").write_text(json.dumps(asdict(suite), indent=2))
    plot(suite, out_dir / "summary.png")
    for line in summary_lines(suite.headlines):
        print(line, file=stream)
    print("  where the time went: " + ", ".join(f"{k} {v:.0f} s" for k, v in suite.seconds.items()), file=stream)
    print(f"wrote {out_dir / 'all.json'} and {out_dir / 'summary.png'}", file=stream)
    return suite


def adam_headlines(report: adam.Report) -> list[Comparison]:
    """Every comparison the adam bench made at its largest size, each row its own (formats and variants named)."""
    largest = max(r.size for r in report.rows)
    return [r.versus for r in report.rows if r.size == largest and r.versus is not None]


TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)


def plot(suite: SuiteResult, path: Path) -> None:
    """One panel per (benchmark, baseline), its baseline written once in its title; a bar per figure with its
    value printed, on a log scale (0.17x and 6x both readable) with the baseline at 1; green where the subject
    beats its baseline, red where it does not."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = grouped(suite.headlines)
    if not groups:
        return
    heights = [len(g) * 0.45 + 1.1 for g in groups.values()]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    values = [c.value for c in suite.headlines]
    low, high = min(min(values), 1.0) / 1.6, max(max(values), 1.0) * 1.6
    for ax, ((bench, baseline, _), group) in zip(axes[:, 0], groups.items(), strict=True):
        labels = [c.label for c in group]
        colors = ["tab:green" if c.wins else "tab:red" for c in group]
        # each bar runs from the baseline (1) to its value: left of it less, right of it more
        bars = ax.barh(labels, [c.value - 1.0 for c in group], left=1.0, color=colors)
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ticks = [t for t in TICKS if low <= t <= high]
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.axvline(1.0, color="black", linewidth=1)
        for bar, c in zip(bars, group, strict=True):
            right = c.value >= 1
            ax.text(c.value * (1.04 if right else 1 / 1.04), bar.get_y() + bar.get_height() / 2, f"{c.value:.2f}x",
                    va="center", ha="left" if right else "right", fontsize=8)
        ax.invert_yaxis()
        title = f"{bench}: against {baseline} ({group[0].quantity}, {group[0].better})"
        ax.set_title(textwrap.fill(title, 70), fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=8)
    title = f"offload bench all{' --quick' if suite.quick else ''}: {suite.machine['cpu']}"
    fig.suptitle(title + (f", {suite.machine['gpu']}" if suite.machine["gpu"] else ", no GPU"), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
