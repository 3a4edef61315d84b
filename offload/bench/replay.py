"""`offload bench schedule` and `offload bench replay`: a step recorded on the CPU, timed on a described machine.

``schedule`` runs a few steps of the bench's GPT through the engine on the CPU with the
device emulated as a discrete one (every copy a GPU needs is made, on the emulated streams),
records them as a graph (see [Note: recorded step graph] in offload/observe/step_graph.py) with the
FLOPs of each stretch of compute counted by torch's FLOP counter, and writes it as JSON.

``replay`` times that graph on a machine described by a few rates: the device's FLOP/s and
memory GB/s, PCIe GB/s each way, the host memory GB/s Adam gets, the link between ranks, and
the host microseconds of one hook call. Each lane runs its items in order; an item starts
when its lane is free, the thread that issued it got that far, and the events it waits for
are recorded; a copy also waits for the bus in its direction, which copies on every stream
share, taken in the order the copies are ready (see [Note: the replay's order]).
The estimate is a lower bound of a kind: no launch latency, no contention between host
threads for memory bandwidth, a collective at W > 1 on the compute stream. It
is an instrument for comparing schedules (synchronous step against early step, 4 MiB units
against blocks), and its critical path says which lane and which kind of work set the time.

The compute FLOPs scale with ``--tokens`` over the tokens recorded (record at a short
micro-batch on the CPU, replay at the GPU's); parameter and gradient bytes do not.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from offload.observe import step_graph


@dataclass(kw_only=True)
class Machine:
    """The rates a replay charges work at."""

    name: str = "custom"
    device_tflops: float  # the model's compute, as fast as plain PyTorch's step runs it
    device_gbps: float  # device memory (a copy there reads and writes: 2 x its bytes)
    h2d_gbps: float  # pinned host -> device
    d2h_gbps: float  # pinned device -> host
    host_gbps: float  # host memory, as Adam / accumulation / norm stream it (one thread's share is the lane's)
    link_gbps: float  # a collective between ranks, per rank
    hook_forward_us: float  # host time of one forward hook call
    hook_backward_us: float  # one backward hook call (with the landing hand-off)
    hook_step_us: float  # the step's Python per shard
    device_bytes: int = 0  # the device's memory (what torch.cuda.mem_get_info reports as its total); not a rate

    def cost_s(self, item: dict[str, Any], lane_kind: str, world: int, token_scale: float) -> float:
        kind = item["kind"]
        nbytes = item.get("nbytes", 0)
        if kind in step_graph.COMPUTE_KINDS:
            return item.get("flops", 0.0) * token_scale / (self.device_tflops * 1e12)
        if kind in step_graph.DEVICE_COPY_KINDS:
            if world == 1:
                return 2 * nbytes / (self.device_gbps * 1e9)
            return nbytes * (world - 1) / world / (self.link_gbps * 1e9)
        if kind == "h2d":
            return nbytes / (self.h2d_gbps * 1e9)
        if kind == "d2h":
            return nbytes / (self.d2h_gbps * 1e9)
        if kind in step_graph.HOST_MEMORY_KINDS:
            rate = self.device_gbps if lane_kind == "device" else self.host_gbps
            return nbytes / (rate * 1e9)
        if kind in step_graph.HOOK_KINDS:
            return getattr(self, f"{kind}_us") * 1e-6
        return 0.0


# One H100 80GB HBM3 (PCIe Gen5 host) (docs/performance.md), for the 155.8M GPT of its runs (12 x 1024, vocabulary
# 4096, seq 512, micro-batch 8, bf16): PCIe as `bench pcie` measured it; host GB/s as `bench adam` measured the
# Adam-shaped traffic there on 2026-11-24 (the 2026-11-22 step's Adam, 95 ms, ran at 49); FLOP/s so that the
# model's 3.81 TFLOP a step (torch's FLOP counter, forward and backward) take what plain PyTorch's step took less
# its fused AdamW (24.3 - 2 ms); HBM at a copy's usual share of its peak; hook costs from `bench hooks` on a 2-core
# Xeon (the H100's host was not measured).
RATES = tuple(f.name for f in fields(Machine) if f.name not in ("name", "device_bytes"))  # a command line's

MACHINES: dict[str, Machine] = {
    "h100": Machine(name="h100", device_tflops=171.0, device_gbps=2500.0, h2d_gbps=53.1, d2h_gbps=54.8,
                    host_gbps=135.0, link_gbps=150.0, hook_forward_us=25.0, hook_backward_us=60.0,
                    hook_step_us=10.0, device_bytes=85_000_000_000),  # an H100 80GB HBM3 as torch sees it
}


@dataclass
class Replay:
    machine: dict[str, Any]
    free: list[str]  # kinds charged nothing (a what-if)
    tokens: int
    token_scale: float
    world: int
    total_ms: float
    steps: int
    step_ms: float  # the window over the steps recorded
    step_starts_ms: list[float]
    lane_busy_ms: dict[str, float]
    critical_ms: dict[str, float]  # "lane/kind" on the critical path
    kind_ms: dict[str, float] = field(default_factory=dict)  # every item's time by kind, all lanes
    # lane -> (start ms, ms, kind, on the critical path) of each item that took time: the picture's, not the JSON's
    spans: dict[str, list[tuple[float, float, str, bool]]] = field(default_factory=dict, repr=False)


def replay(data: dict[str, Any], machine: Machine, tokens: int | None = None, free: frozenset[str] = frozenset()
           ) -> Replay:
    """Time a recorded step graph on ``machine`` (see the module docstring). ``free``: kinds of work charged nothing,
    the estimate of a change that would remove them (landing gradients without an accumulation pass, say)."""
    unknown = set(free) - set(step_graph.KINDS)
    if unknown:
        raise ValueError(f"unknown kind(s) of work {sorted(unknown)}; kinds: {', '.join(step_graph.KINDS)}")

    def cost_of(item: dict[str, Any], lane: str) -> float:
        return 0.0 if item["kind"] in free else machine.cost_s(item, kinds.get(lane, "host"), world, scale)

    meta = data["meta"]
    lanes: dict[str, list[dict[str, Any]]] = data["lanes"]
    kinds = data["lane_kinds"]
    world = int(meta.get("world", 1))
    recorded_tokens = int(meta.get("tokens", 1))
    tokens = tokens or recorded_tokens
    scale = tokens / recorded_tokens
    where: dict[int, tuple[str, int]] = {}  # record id -> its point
    for lane, items in lanes.items():
        for i, item in enumerate(items):
            if item.get("record") is not None:
                where[item["record"]] = (lane, i)
    end: dict[str, list[float]] = {lane: [] for lane in lanes}
    # the bus each way is one resource, whichever stream copies over it (parameters, gradients, streamed state)
    bus: dict[str, tuple[str, int]] = {}
    cause: dict[tuple[str, int], tuple[str, int] | None] = {}  # what bound each item's start
    cost: dict[tuple[str, int], float] = {}
    busy: dict[str, float] = defaultdict(float)
    by_kind: dict[str, float] = defaultdict(float)

    def done(point: tuple[str, int]) -> bool:  # the first n items of the lane are done
        lane, n = point
        return len(end.get(lane, ())) >= n

    def ready(lane: str) -> tuple[float, float, tuple[str, int] | None] | None:
        """When the lane's next item can start (and when it could but for the bus), and what bound it; None while
        what it waits for has not been placed."""
        i = len(end[lane])
        item = lanes[lane][i]
        deps: list[tuple[str, int]] = []
        if item.get("issued"):
            issued_lane, n = item["issued"]
            if n > 0:
                deps.append((issued_lane, n - 1))
        deps += [where[rid] for rid in item.get("waits", ()) if rid in where]
        if not all(done((dl, di + 1)) for dl, di in deps):
            return None
        start, bound = (end[lane][-1], (lane, i - 1)) if i else (0.0, None)
        for dl, di in deps:
            if end[dl][di] > start:
                start, bound = end[dl][di], (dl, di)
        free = start
        if item["kind"] in bus:  # one copy at a time each way: after the last one that took the bus
            bl, bi = bus[item["kind"]]
            if end[bl][bi] > start:
                start, bound = end[bl][bi], (bl, bi)
        return start, free, bound

    # [Note: the replay's order] Items are placed in the order they can start, the earliest first (ties: the
    # earlier ready, then the lane's name), not lane by lane: so a copy takes the bus when it is ready and the bus
    # free, as a copy engine serves whichever stream is ready, and the result does not depend on which lane the
    # replay happens to look at first. (Lane by lane, the bus went to whichever copy the replay reached first,
    # and that came from a set's order: the same recording replayed at 322 to 461 ms from one process to the next.)
    pending = sorted(lane for lane, items in lanes.items() if items)
    while pending:
        best: tuple[float, float, str, tuple[str, int] | None] | None = None
        for lane in pending:
            at = ready(lane)
            if at is not None and (best is None or (at[0], at[1]) < (best[0], best[1])):
                best = (at[0], at[1], lane, at[2])
        if best is None:
            stuck = {lane: lanes[lane][len(end[lane])] for lane in pending}
            raise ValueError(f"the schedule cannot finish: these lanes wait for what never comes: {stuck}")
        start, _, lane, bound = best
        i = len(end[lane])
        item = lanes[lane][i]
        took = cost[(lane, i)] = cost_of(item, lane)
        if item["kind"] in step_graph.COPY_KINDS:
            bus[item["kind"]] = (lane, i)
        end[lane].append(start + took)
        cause[(lane, i)] = bound
        busy[lane] += took
        by_kind[item["kind"]] += took
        if len(end[lane]) == len(lanes[lane]):
            pending.remove(lane)
    last = max(((lane, len(e) - 1) for lane, e in end.items() if e), key=lambda p: end[p[0]][p[1]])
    total = end[last[0]][last[1]]
    critical: dict[str, float] = defaultdict(float)
    point: tuple[str, int] | None = last
    on_path: set[tuple[str, int]] = set()
    while point is not None:
        if cost[point]:
            critical[f"{point[0]}/{lanes[point[0]][point[1]]['kind']}"] += cost[point]
            on_path.add(point)
        point = cause[point]
    spans = {lane: [((end[lane][i] - cost[(lane, i)]) * 1e3, cost[(lane, i)] * 1e3, items[i]["kind"],
                     (lane, i) in on_path) for i in range(len(items)) if cost[(lane, i)]]
             for lane, items in lanes.items()}
    starts = [end[step_graph.HOST][i] for i, item in enumerate(lanes.get(step_graph.HOST, ()))
              if item["kind"] == "mark" and item.get("label") == "forward"]
    steps = max(1, len(starts))
    first = starts[0] if starts else 0.0
    return Replay(machine=asdict(machine), free=sorted(free), tokens=tokens, token_scale=scale, world=world,
                  total_ms=total * 1e3,
                  steps=steps, step_ms=(total - first) / steps * 1e3, step_starts_ms=[s * 1e3 for s in starts],
                  lane_busy_ms={k: v * 1e3 for k, v in sorted(busy.items())},
                  critical_ms={k: v * 1e3 for k, v in sorted(critical.items(), key=lambda kv: -kv[1])},
                  kind_ms={k: v * 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                  spans={lane: s for lane, s in spans.items() if s})


def machine_from(name: str, overrides: dict[str, float]) -> Machine:
    """A preset with some rates replaced (``overrides``: field -> value)."""
    if name not in MACHINES:
        raise ValueError(f"unknown machine {name!r}; presets: {', '.join(MACHINES)} (override any rate with its flag)")
    bad = set(overrides) - set(RATES)
    if bad:
        raise ValueError(f"unknown machine rate(s) {sorted(bad)}; known: {sorted(RATES)}")
    values = {**asdict(MACHINES[name]), **overrides}
    for key, value in values.items():
        if key != "name" and not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}")
    return Machine(**values)


def print_replay(r: Replay, out: TextIO, label: str = "") -> None:
    m = r.machine
    what_if = f" with {', '.join(r.free)} free" if r.free else ""
    out.write(f"{label}on {m['name']}{what_if} at {r.tokens} tokens/step (x{r.token_scale:g} the recorded compute), "
              f"W = {r.world}: {r.step_ms:.1f} ms/step over {r.steps} step(s)\n")
    out.write("  busy per lane (ms/step): " + ", ".join(
        f"{k} {v / r.steps:.1f}" for k, v in r.lane_busy_ms.items() if v) + "\n")
    out.write("  critical path (ms/step): " + ", ".join(
        f"{k} {v / r.steps:.1f}" for k, v in list(r.critical_ms.items())[:8]) + "\n")


# ----------------------------------------------------------------- recording


@dataclass(kw_only=True)
class ScheduleBench:
    """What to record: the bench's GPT, one rank, a variant's placement and step mode."""

    hidden: int = 1024
    layers: int = 12
    heads: int = 16
    vocab: int = 4096  # with the defaults: the 155.8M-parameter GPT of the H100 step (docs/performance.md)
    seq: int = 512
    micro: int = 1  # recorded micro-batch (the replay scales compute to its --tokens)
    dtype: str = "bf16"
    params: str = "none"  # offload_param.device: none (device) or cpu
    early: str = "off"  # the early-returning step: on or off
    speculative: str = "off"  # host shards speculated during backward (see [Note: speculative step]): on or off
    clip: float = 1.0
    overlap: str = "off"  # offload.overlap_step: the host Adam during the last backward (needs clip 0)
    ratio: float | str = 1.0  # offload_optimizer.ratio: the state (and, beside host params, the shards) kept on the GPU
    stream: float | str = 0.0  # offload.stream_state: the host-homed state the GPU steps over the bus (auto: by rates)
    device_budget: int | None = None  # offload.budgets.device: what auto fills (a CPU has no device memory to measure)
    unit_bytes: int = 4 << 20
    steps: int = 2  # recorded, after one warm-up step

    def __post_init__(self) -> None:
        if self.params not in ("none", "cpu"):
            raise ValueError(f"params must be none or cpu, got {self.params!r}")
        for name in ("early", "speculative", "overlap"):
            if getattr(self, name) not in ("on", "off"):
                raise ValueError(f"{name} must be on or off, got {getattr(self, name)!r}")
        if self.steps < 1 or self.micro < 1:
            raise ValueError(f"steps and micro must be >= 1, got {self.steps}, {self.micro}")


def record(b: ScheduleBench, out: Path, log: TextIO | None = None, machine: Machine | None = None
           ) -> dict[str, Any]:
    """Run ``b`` on this CPU as a discrete device and write its recorded steps to ``out``. With a share chosen at
    start-up (ratio or stream auto), the emulated device is given ``machine``'s rates, so the split is the one
    start-up would choose there (and, where no device budget is set, half its memory as the room)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import offload
    from offload.bench.step import StepBench, batches, engine_config
    from offload.engine import rates
    from offload.models import GPT

    by_rates = machine is not None and "auto" in (b.ratio, b.stream)
    budget = b.device_budget
    if by_rates and budget is None:
        assert machine is not None
        budget = machine.device_bytes // 2 or None
    step_bench = StepBench(hidden=b.hidden, layers=b.layers, heads=b.heads, vocab=b.vocab, seq=b.seq, micro=b.micro,
                           world=1, dtype=b.dtype, steps=b.steps, warmup=1, unit_bytes=b.unit_bytes,
                           device_budget=budget)
    variant = {"device": "cpu", "params": b.params, "early": b.early, "clip": b.clip, "speculative": b.speculative,
               "ratio": b.ratio, "stream": b.stream,  # speculating is overlapping with a guess
               "overlap": "on" if b.speculative == "on" or b.overlap == "on" else "off"}
    torch.manual_seed(0)
    env = {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}  # read as the engine's accelerator starts
    if by_rates:
        assert machine is not None
        env["OFFLOAD_EMULATED_RATES"] = ",".join(f"{k}={getattr(machine, k)}" for k in rates.NAMES)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine, *_ = offload.initialize(model=GPT(step_bench.model_config()),
                                        config=engine_config(step_bench, variant))
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    graph = engine.accel.graph
    try:
        data_rows = batches(step_bench, 1 + b.steps, b.micro)
        engine.backward(engine(data_rows[0][:, :-1], data_rows[0][:, 1:]))  # warm-up: traces, buffers, first step
        engine.step()
        engine.accel.synchronize()
        with FlopCounterMode(display=False) as counter:
            engine.accel.start_graph(flops=counter.get_total_flops, world=1, tokens=b.micro * b.seq,
                                     units=len(engine.units), bench=asdict(b))
            for i, rows in enumerate(data_rows[1:]):
                engine.backward(engine(rows[:, :-1], rows[:, 1:]))
                engine.step()
                if log is not None:
                    log.write(f"  recorded step {i + 1}/{b.steps}\n")
                    log.flush()
            engine.accel.synchronize()  # what the last step left running is in the window too
            graph.mark("end")
        data = graph.to_json()
    finally:
        graph.stop()
        engine.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return data


def summary(data: dict[str, Any]) -> str:
    """What a schedule file holds, in a line."""
    lanes = data["lanes"]
    n = sum(len(v) for v in lanes.values())
    return (f"{n} items on {len(lanes)} lanes ({', '.join(f'{k} {len(v)}' for k, v in lanes.items())}), "
            f"{data['meta'].get('tokens')} tokens/step recorded")


def run_replay(path: Path, machine: Machine, tokens: int | None, out: Path | None, stream: TextIO,
               free: frozenset[str] = frozenset()) -> Replay:
    data = step_graph.load(path)
    result = replay(data, machine, tokens, free)
    stream.write(f"schedule {path}: {summary(data)}\n")
    print_replay(result, stream)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: v for k, v in asdict(result).items() if k != "spans"}, indent=1))
        plot_replay(result, out.with_suffix(".png"), str(path))
        stream.write(f"the step's lanes drawn in {out.with_suffix('.png')}\n")
    return result


KIND_COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "gather": "tab:gray", "reduce": "tab:gray",
               "h2d": "tab:orange", "d2h": "tab:red", "adam": "tab:green", "accumulate": "tab:olive",
               "norm": "tab:purple", "hook_forward": "tab:brown", "hook_backward": "tab:brown",
               "hook_step": "tab:brown"}


def plot_replay(r: Replay, path: Path, title: str = "") -> None:
    """The replayed steps as one row per lane (stream or thread), each item a bar coloured by its kind, those on
    the critical path outlined: where a person would rather look than read which lane sets the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    lanes = list(r.spans)
    fig, ax = plt.subplots(figsize=(13, 0.5 * len(lanes) + 1.8))
    for row, lane in enumerate(lanes):
        spans = r.spans[lane]
        ax.broken_barh([(s, d) for s, d, _, _ in spans], (row - 0.4, 0.8),
                       facecolors=[KIND_COLORS.get(k, "tab:pink") for _, _, k, _ in spans],
                       edgecolors=["black" if c else "none" for *_, c in spans], linewidth=0.6)
    for start in r.step_starts_ms:
        ax.axvline(start, color="black", linewidth=0.8, linestyle=":")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms (dotted: each step's forward begins; outlined: the critical path)")
    kinds = sorted({k for spans in r.spans.values() for _, _, k, _ in spans})
    ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "tab:pink"), label=k) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.18), ncol=min(len(kinds), 7), fontsize=8)
    ax.set_title(f"{title + ': ' if title else ''}{r.step_ms:.1f} ms/step on {r.machine['name']} at {r.tokens} "
                 "tokens/step", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

