"""`offload bench hooks`: the host time the engine's module hooks add per call, on a model too small to compute.

A model of many tiny linear layers, each its own unit, runs forward and backward
through the engine (W = 1, ZeRO-3, nothing persistent) and, in alternating rounds, the
same layers as plain PyTorch modules. With 32 x 32 weights the compute is a few
microseconds a layer, so what the engine adds is its hooks: the forward pre- and
post-hooks (acquire and release a unit), the pre-backward hook (gather again) and the
post-accumulate gradient hooks (reduce, hand the gradient to the landing worker).
Each figure is (engine - plain) / hook calls, the median over rounds with its spread,
with and without a telemetry trace being kept; the budget is 30 microseconds a call
(the GPU step issue's, where 75 units pay it twice a step). The backward figure includes
what the landing worker's thread costs the autograd thread on the way (the hand-off, and
the GIL while the worker lands each gradient and takes its norm), since that is host
time backward pays per unit too; and backward's figure runs until every gradient has landed (the landing
worker drained), so landing work moved out of backward still counts.

Two placements: parameters homed on the device (every use gathers and releases) and on
the host (on a CPU, W = 1: read in place, the hooks have nothing to copy).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from offload.machine.cpus import torch_threads

BUDGET_US = 30.0


@dataclass(kw_only=True)
class HookBench:
    layers: int = 64
    width: int = 32  # the smallest whose layer reaches offload.unit_bytes' floor (4 KiB), so one unit each
    rounds: int = 5
    iterations: int = 20  # forward+backward passes per round and side

    def __post_init__(self) -> None:
        if self.layers < 2 or self.width < 1 or self.rounds < 1 or self.iterations < 1:
            raise ValueError(f"layers >= 2, width, rounds and iterations >= 1; got {self}")
        if (self.width * self.width + self.width) * 4 < 4096:
            raise ValueError(f"width {self.width}: a layer must hold at least 4 KiB (offload.unit_bytes' floor) to be "
                             "a unit of its own; use width >= 32")


@dataclass
class HookRow:
    placement: str  # where parameter shards live: device or host
    tracing: bool
    phase: str  # forward or backward
    calls_per_pass: int
    us_per_call: float  # median over rounds
    spread_us: tuple[float, float]  # min and max over rounds
    plain_ms_per_pass: float
    engine_ms_per_pass: float

    @property
    def within_budget(self) -> bool:
        return self.us_per_call <= BUDGET_US


@dataclass
class HookReport:
    bench: HookBench
    rows: list[HookRow] = field(default_factory=list)
    machine: str = ""


def _layers(bench: HookBench, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(bench.width, bench.width) for _ in range(bench.layers)))


def _engine(bench: HookBench, placement: str) -> Any:
    from offload.engine.initialize import initialize
    layer_bytes = (bench.width * bench.width + bench.width) * 4
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "cpu"},
                                    **({"offload_param": {"device": "cpu"}} if placement == "host" else {})},
              # One unit per layer; Adam after backward and whole, so backward holds hooks only (an overlapped or
              # early step would put Adam's own work on the landing worker beside them).
              "offload": {"unit_bytes": layer_bytes, "overlap_step": "off", "early_step": "off"}}
    engine, *_ = initialize(model=_layers(bench), config=config, device="cpu", dist_init_required=False)
    return engine


def _calls(engine: Any) -> dict[str, int]:
    """Hook calls per forward and per backward: two per anchored module forward; one pre-backward per unit and
    one gradient hook per trainable parameter in backward."""
    anchors = sum(len(u.plan.anchors) + len(u.plan.borrowers) for u in engine.units)
    grads = sum(len(u.trainable) for u in engine.units)
    return {"forward": 2 * anchors, "backward": len(engine.units) + grads}


def _timed_passes(model: Any, x: torch.Tensor, iterations: int) -> tuple[float, float]:
    """Seconds spent in forward and in backward (the engine's until its gradients have landed) over
    ``iterations`` passes; the engine steps after each, the plain model drops its gradients, neither timed."""
    fwd = bwd = 0.0
    engine = hasattr(model, "step")
    for _ in range(iterations):
        t0 = time.perf_counter()
        loss = model(x).sum()
        t1 = time.perf_counter()
        if engine:
            model.backward(loss)
            model.optimizer.drain()  # the gradients have landed: the landing worker's share counts wherever it runs
        else:
            loss.backward()
        t2 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        if engine:
            model.step()
        else:
            for p in model.parameters():
                p.grad = None
    return fwd, bwd


def run(bench: HookBench, out: Path | None = None, stream: TextIO | None = None) -> HookReport:
    with torch_threads(1):  # the hooks are single-threaded host work; compute threads would only add noise
        return _run(bench, out, stream)


def _run(bench: HookBench, out: Path | None, stream: TextIO | None) -> HookReport:
    report = HookReport(bench, machine=_machine())
    x = torch.randn(1, bench.width)
    plain = _layers(bench)
    for placement in ("device", "host"):
        engine = _engine(bench, placement)
        calls = _calls(engine)
        try:
            for tracing in (False, True):
                if tracing:
                    engine.telemetry.start_trace()
                per_round: dict[str, list[float]] = {"forward": [], "backward": []}
                plain_t: dict[str, list[float]] = {"forward": [], "backward": []}
                engine_t: dict[str, list[float]] = {"forward": [], "backward": []}
                _timed_passes(engine, x, 2)  # warm-up: the prefetch trace is recorded on the first pass
                _timed_passes(plain, x, 2)
                for _ in range(bench.rounds):
                    pf, pb = _timed_passes(plain, x, bench.iterations)
                    ef, eb = _timed_passes(engine, x, bench.iterations)
                    for phase, (pt, et) in {"forward": (pf, ef), "backward": (pb, eb)}.items():
                        plain_t[phase].append(pt / bench.iterations)
                        engine_t[phase].append(et / bench.iterations)
                        per_round[phase].append((et - pt) / bench.iterations / calls[phase] * 1e6)
                engine.telemetry.stop_trace()
                for phase in ("forward", "backward"):
                    report.rows.append(HookRow(
                        placement, tracing, phase, calls[phase], statistics.median(per_round[phase]),
                        (min(per_round[phase]), max(per_round[phase])),
                        statistics.median(plain_t[phase]) * 1e3, statistics.median(engine_t[phase]) * 1e3))
                    if stream is not None:
                        _print_row(report.rows[-1], stream)
        finally:
            engine.close()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(to_json(report), indent=2))
    return report


def to_json(report: HookReport) -> dict[str, Any]:
    return {"benchmark": "hooks", "budget_us_per_call": BUDGET_US, "machine": report.machine,
            "bench": asdict(report.bench),
            "rows": [{**asdict(r), "within_budget": r.within_budget} for r in report.rows]}


def print_header(stream: TextIO) -> None:
    stream.write(f"{'placement':<10}{'trace':<7}{'phase':<10}{'calls':>6}{'us/call':>9}{'spread':>16}"
                 f"{'plain ms':>10}{'engine ms':>11}  budget {BUDGET_US:.0f} us\n")


def _print_row(row: HookRow, stream: TextIO) -> None:
    spread = f"{row.spread_us[0]:.1f}-{row.spread_us[1]:.1f}"
    stream.write(f"{row.placement:<10}{'on' if row.tracing else 'off':<7}{row.phase:<10}{row.calls_per_pass:>6}"
                 f"{row.us_per_call:>9.1f}{spread:>16}{row.plain_ms_per_pass:>10.2f}{row.engine_ms_per_pass:>11.2f}"
                 f"  {'within' if row.within_budget else 'OVER'}\n")
    stream.flush()


def _machine() -> str:
    import platform
    return f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
