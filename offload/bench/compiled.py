"""``offload bench step --compile BACKEND``: what compiling the blocks gives offload's step beside what it gives
plain PyTorch's, on the same model, in one run.

Four sides, interleaved round by round (the machine's speed drifts): plain PyTorch eager and compiled, offload's
headline variant eager and compiled (``bench step``'s sides, with every repeated block compiled before the engine
is built). The figure the issue asks for is the share of plain PyTorch's gain that offload keeps: the seconds a step
saves by compiling under offload over the seconds it saves under plain PyTorch (1.0: all of it). Each side's median
and its spread over the rounds are kept; the JSON holds every sample.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from offload.bench import step
from offload.bench.comparison import TIME, Comparison

MEASURABLE = 0.05  # the least saving, as a share of plain PyTorch's eager step, that a kept share is reported for


@dataclass
class CompileResult:
    bench: dict[str, Any]
    backend: str
    variant: str
    samples: dict[str, list[float]]  # seconds a step, per side: torch, torch-compiled, offload, offload-compiled
    median_s: dict[str, float]
    spread_s: dict[str, tuple[float, float]]  # (min, max) of each side's round medians
    speedup: dict[str, float]  # eager over compiled: torch, offload
    gain_kept: float | None  # offload's saved seconds over torch's (None: compiling gave torch nothing)
    comparisons: list[Comparison]


def run(b: step.StepBench, backend: str, out_path: Path | None = None, log: TextIO | None = None) -> CompileResult:
    head = next(iter(b.variants()))
    one = replace(b, repeats=1, only=(head,))
    samples: dict[str, list[float]] = {"torch": [], "torch-compiled": [], "offload": [], "offload-compiled": []}
    rounds: dict[str, list[float]] = {k: [] for k in samples}
    for r in range(b.repeats):
        for suffix, compiled in (("", ""), ("-compiled", backend)):
            ran = step.run(replace(one, compile=compiled))
            for side, times in (("torch", ran.samples["torch"]), ("offload", ran.samples[head])):
                samples[side + suffix] += times
                if times:
                    rounds[side + suffix].append(statistics.median(times))
        if log:
            print(f"  round {r + 1}/{b.repeats}: " + ", ".join(
                f"{k} {statistics.median(v):.3f} s" for k, v in samples.items() if v), file=log, flush=True)
    median = {k: statistics.median(v) for k, v in samples.items() if v}
    saved: dict[str, float] = {side: median[side] - median[f"{side}-compiled"] for side in ("torch", "offload")
                               if side in median and f"{side}-compiled" in median}
    size = f"{b.num_parameters() / 1e6:.0f}M"
    comparisons = [Comparison("compile", f"{side} compiled ({backend})", f"{side} eager", TIME,
                              median[f"{side}-compiled"] / median[side], size) for side in saved]
    if "torch-compiled" in median and "offload-compiled" in median:
        comparisons.append(Comparison("compile", f"offload compiled ({backend})", f"torch compiled ({backend})",
                                      TIME, median["offload-compiled"] / median["torch-compiled"], size))
    result = CompileResult(
        bench=asdict(b), backend=backend, variant=head, samples=samples, median_s=median,
        spread_s={k: (min(v), max(v)) for k, v in rounds.items() if v},
        speedup={side: median[side] / median[f"{side}-compiled"] for side in saved},
        gain_kept=saved["offload"] / saved["torch"] if _measurable(saved, median) else None,
        comparisons=comparisons)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(asdict(result), indent=2, default=str))
    return result


def _measurable(saved: dict[str, float], median: dict[str, float]) -> bool:
    """Whether compiling saved plain PyTorch enough for a share of it to mean anything: a twentieth of its eager
    step at least (below that the share is the ratio of two noises)."""
    return "offload" in saved and saved.get("torch", 0.0) > MEASURABLE * median["torch"]


def print_table(result: CompileResult, out: TextIO) -> None:
    print(f"{'side':<20}{'median s/step':>15}{'spread (round medians)':>26}", file=out)
    for side, t in result.median_s.items():
        lo, hi = result.spread_s.get(side, (t, t))
        print(f"{side:<20}{t:>15.4f}{f'{lo:.4f}-{hi:.4f}':>26}", file=out)
    for side, s in result.speedup.items():
        print(f"compiling speeds {side} up {s:.2f}x", file=out)
    if result.gain_kept is not None:
        print(f"offload keeps {result.gain_kept:.0%} of the seconds compiling saves plain PyTorch "
              f"(variant {result.variant!r}, backend {result.backend})", file=out)
    else:
        print(f"compiling saved plain PyTorch less than {MEASURABLE:.0%} of its step here: the share offload keeps "
              "is not measurable on this model and machine", file=out)
