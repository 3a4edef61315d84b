"""`offload bench step --baseline floor`: how near the GPU's pace offload trains, beside plain PyTorch and the floor.

A step whose optimizer state is partly on the host cannot be faster than the larger of
two things measured in the same run: the compute (plain PyTorch's forward + backward,
the faster of its two forms: fp32 weights under bf16 autocast, and bf16 weights) and
the host's share of Adam (the elements each variant steps on the host, as its engine
placed them, at the rate of the native host step measured here on the engine's thread
count: bf16 gradient in, norm, fp32 master and moments, bf16 parameter out). That
larger one is the floor: a step that overlaps perfectly takes the floor, one whose
stages run one after another takes their sum. Each variant's row gives its step against
plain PyTorch and against its floor.

The variants (all ZeRO-3, one rank, the config `offload` writes for `bench step`):
``full``, parameters and optimizer state on the host; ``full-overlap``, the same with the
host Adam run during backward (``offload.overlap_step: on``); ``auto``, the same with
``offload_optimizer.ratio: auto`` (the device keeps the state and the parameters of the
units the next forward needs first, as much as it holds); ``auto-params-device``, the
parameters on the device and the state split by ``auto``; ``nvme``, parameters and state
on NVMe; ``stream-half`` and ``stream-all``, ``full`` with that share of the host-homed state stepped on
the device over the bus (``offload.stream_state``). Plain PyTorch runs once a round; a side that
does not fit (out of memory) is shown with its error, as it happened. Rounds alternate the sides, medians over rounds
x steps, with the spread.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.bench.step import StepBench, describe_model, engine_config
from offload.bench.versus import PHASES, PLAIN, side_rank, timed
from offload.machine.launch import RankError, run_ranks
from offload.models.catalog import lm_loss

# Where each variant puts parameters and optimizer state, and what it keeps on the device (the step bench's keys).
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"params": "cpu", "device": "cpu"},  # without clipping the host Adam runs during backward (auto)
    # full with the host Adam after backward (`overlap_step: off`): what a GPU's `auto` ran until the Adam moved to
    # the landing worker, which the H200 measured as backward + Adam in series for a host-bound model
    "full-after": {"params": "cpu", "device": "cpu", "overlap": "off"},
    "full-overlap": {"params": "cpu", "device": "cpu", "overlap": "on"},
    "auto": {"params": "cpu", "device": "cpu", "ratio": "auto"},
    "auto-params-device": {"params": "none", "device": "cpu", "ratio": "auto"},
    "nvme": {"params": "nvme", "device": "nvme", "buffer_count": 4},
    # full with the streamed lane (offload.stream_state): the device steps that share of the host-homed state over
    # the bus; its floor prices both bus directions.
    "stream-half": {"params": "cpu", "device": "cpu", "stream": 0.5},
    "stream-all": {"params": "cpu", "device": "cpu", "stream": 1.0},
    "stream-auto": {"params": "cpu", "device": "cpu", "stream": "auto"},  # the share chosen by measured rates
}
DEFAULT = ("full", "auto", "auto-params-device")
HOST_RATE_ELEMENTS = (1 << 22, 1 << 26)  # the host step is timed on the model's size, clamped to this range


def variants(names: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Variant name -> its keys (ValueError: a name that is not one)."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"no floor variant {', '.join(map(repr, unknown))}: choose from {', '.join(VARIANTS)}")
    return {n: VARIANTS[n] for n in names or DEFAULT}


@dataclass
class PaceResult:
    bench: dict[str, Any]
    params: int
    clip: float
    host_adam_ns_per_element: float  # the native host step measured in this run (see the module's docstring)
    configs: dict[str, str]  # variant -> the engine config it read
    # side (plain or variant) -> {"step_s", "spread_s", "forward_s", "backward_s", "optimizer_s", "peak_device",
    # "host_elements", "device_elements", "mode"}; variants add "floor_s", "compute_s", "host_adam_s",
    # "to_floor", "to_plain"
    table: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # side -> why it did not run (its last line)


def host_step_rate(rank: int, world: int, elements: int, state: tuple[str, str] = ("fp32", "fp32")) -> float:
    """Seconds per element of the native host step (norm + fused AdamW, bf16 gradient in and parameter out) with
    the state held as ``state`` (offload.optimizer_state's master and moments), on the engine's own thread count,
    each call from a cold cache; median of five after one warm-up."""
    from offload.bench.adam import CacheFlush, format_step, interleaved
    from offload.machine import native
    from offload.store.state_format import StateFormat
    threads = native.default_threads()
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(elements, generator=gen)
    g16 = (torch.randn(elements, generator=gen) * 1e-3).to(torch.bfloat16)
    host_step, _ = format_step(StateFormat.named(*state), p, g16, threads, [0])  # the engine's norm pass and step
    return interleaved({"host step": host_step}, repeats=5, before=CacheFlush())["host step"] / elements


def _offload_rank(rank: int, world: int, bench: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    import offload
    b = StepBench(**bench)
    torch.manual_seed(0)
    model = b.build_model()  # on a GPU its high-water mark starts after the build
    engine, *_ = offload.initialize(model=model, config=config)
    opt = engine.optimizer
    sizes = {i: s.numel for i, s in opt.shards.items()}
    host = sum(n for i, n in sizes.items() if opt.steps_on_host(i))
    loss: list[torch.Tensor] = []

    def forward(rows: torch.Tensor) -> None:
        loss[:] = [lm_loss(model, engine, rows)]

    steps, phases = timed(forward, lambda: engine.backward(loss[0]), engine.step, b, world, rank,
                          str(engine.accel.device))
    moved = engine.telemetry.snapshot().bytes
    taken = max(engine.global_steps, 1)
    out = {"step_s": steps, "phases_s": phases, "host_elements": host,
           "device_elements": sum(sizes.values()) - host, "mode": engine.step_mode,
           "streamed_elements": sum(g.numel for g in opt.store.groups if g.streamed),
           # a step's bytes over the bus each way: parameters and gradients, and the streamed lane's state
           "bus_up_bytes": (moved.get("h2d", 0) + moved.get("state_h2d", 0)) // taken,
           "bus_down_bytes": (moved.get("d2h", 0) + moved.get("state_d2h", 0)) // taken,
           "peak_device": torch.cuda.max_memory_allocated() if b.device == "cuda" else 0}
    if b.device == "cuda":  # the bus each way, as start-up measures it for auto
        from offload.engine.rates import _measured
        measured = _measured(engine.accel.device, None)
        out |= {"h2d_gbps": measured.h2d_gbps, "d2h_gbps": measured.d2h_gbps}
    engine.close()
    return out


def run(b: StepBench, out: Path, clip: float, log: TextIO | None = None, names: tuple[str, ...] = ()) -> PaceResult:
    """Alternating rounds of plain PyTorch and offload's variants, each variant against its floor; the result in
    ``out`` and each variant's config beside it."""
    chosen = variants(names)
    out.parent.mkdir(parents=True, exist_ok=True)
    configs: dict[str, dict[str, Any]] = {}
    for name, keys in chosen.items():
        configs[name] = engine_config(replace(b, world=1), keys | {"clip": clip})
        (out.parent / f"config-{name}.json").write_text(json.dumps(configs[name], indent=2))
    params = b.num_parameters()
    elements = min(max(params, HOST_RATE_ELEMENTS[0]), HOST_RATE_ELEMENTS[1])
    rate = run_ranks(host_step_rate, 1, timeout=3600, elements=elements, state=b.state)[0]
    result = PaceResult(asdict(b), params, clip, rate * 1e9,
                        {n: str(out.parent / f"config-{n}.json") for n in chosen})
    plain = tuple(s for s in PLAIN if s != "torch-bf16" or b.dtype == "bf16")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in (*plain, *chosen)}
    for r in range(b.repeats):
        for side in runs:
            if side in result.errors:
                continue
            try:
                if side in plain:
                    ranks = run_ranks(side_rank, 1, timeout=3600, side=side, bench=asdict(b), config_path="",
                                      clip=clip)
                else:
                    ranks = run_ranks(_offload_rank, 1, timeout=3600, bench=asdict(b), config=configs[side])
            except RankError as e:
                result.errors[side] = str(e).strip().splitlines()[-1]
                if log:
                    print(f"  {side} failed: {result.errors[side]}", file=log, flush=True)
                continue
            runs[side].append(ranks[0])
        if log:
            print(f"  round {r + 1}/{b.repeats}: " + ", ".join(
                f"{s} {statistics.median(x for run in done for x in run['step_s']):.3f} s"
                for s, done in runs.items() if done), file=log, flush=True)
    for side, done in runs.items():
        if done:
            result.table[side] = _row(done)
    _floors(result, plain)
    out.write_text(json.dumps(asdict(result), indent=2))
    return result


def _row(done: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [x for run in done for x in run["step_s"]]
    row: dict[str, Any] = {"step_s": statistics.median(steps), "spread_s": [min(steps), max(steps)]}
    row |= {f"{p}_s": statistics.median(x for run in done for x in run["phases_s"][p]) for p in PHASES}
    row["peak_device"] = max(run.get("peak_device", 0) for run in done)
    for key in ("host_elements", "device_elements", "mode", "streamed_elements", "bus_up_bytes", "bus_down_bytes",
                "h2d_gbps", "d2h_gbps"):
        if key in done[0]:
            row[key] = done[0][key]
    return row


def _floors(result: PaceResult, plain: tuple[str, ...]) -> None:
    """Each variant's floor: the longest of its lanes: the compute (the faster plain side's forward + backward;
    none when no plain side fits, then the floor is the others alone, a lower bound), its host Adam share and, on a
    GPU, each bus direction (the bytes the variant moved a step, parameters, gradients and streamed state, at the
    rate measured there)."""
    computes = [result.table[s]["forward_s"] + result.table[s]["backward_s"] for s in plain if s in result.table]
    compute = min(computes) if computes else None
    fastest_plain = min((result.table[s]["step_s"] for s in plain if s in result.table), default=None)
    for side, row in result.table.items():
        if side in plain:
            continue
        host = row["host_elements"] * result.host_adam_ns_per_element * 1e-9
        row["compute_s"], row["host_adam_s"] = compute, host
        lanes = {"compute": compute or 0.0, "host Adam": host}
        if row.get("h2d_gbps") and row.get("d2h_gbps"):
            lanes["bus up"] = row["bus_up_s"] = row["bus_up_bytes"] / (row["h2d_gbps"] * 1e9)
            lanes["bus down"] = row["bus_down_s"] = row["bus_down_bytes"] / (row["d2h_gbps"] * 1e9)
        row["floor_s"] = max(lanes.values())
        row["floor_lane"] = max(lanes, key=lanes.__getitem__)
        row["to_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
        row["to_plain"] = row["step_s"] / fastest_plain if fastest_plain else None


def print_table(result: PaceResult, out: TextIO) -> None:
    b = result.bench
    print(f"{describe_model(b, result.params)}, vocabulary {b['vocab']}, seq {b['seq']}, micro-batch {b['micro']}), "
          f"{b['dtype']}, clipping {result.clip or 'off'}, {b['device']}; the host step measured at "
          f"{result.host_adam_ns_per_element:.2f} ns an element", file=out)
    print(f"  {'side':<20} {'step s':>7} {'spread':>15} {'fwd':>6} {'bwd':>6} {'step()':>6} {'GPU peak':>9} "
          f"{'host elems':>13} {'floor s':>8} {'/floor':>6} {'/plain':>6}", file=out)
    for side, row in result.table.items():
        floor = row.get("floor_s")
        print(f"  {side:<20} {row['step_s']:7.3f} {row['spread_s'][0]:7.3f}-{row['spread_s'][1]:<7.3f} "
              f"{row['forward_s']:6.3f} {row['backward_s']:6.3f} {row['optimizer_s']:6.3f} "
              f"{row['peak_device'] / 2**30:8.1f}G "
              + (f"{row['host_elements']:13,} " if "host_elements" in row else f"{'':13} ")
              + (f"{floor:8.3f} {row['to_floor']:6.2f} " if floor else f"{'':8} {'':6} ")
              + (f"{row['to_plain']:6.2f}" if row.get("to_plain") else ""), file=out)
    for side, why in result.errors.items():
        print(f"  {side:<20} did not run: {why}", file=out)
    for side, row in result.table.items():
        if "bus_up_s" in row:
            print(f"  {side:<20} lanes: compute {row['compute_s'] or 0:.3f} s, host Adam {row['host_adam_s']:.3f} s, "
                  f"bus up {row['bus_up_s']:.3f} s ({row['bus_up_bytes'] / 1e9:.2f} GB), bus down "
                  f"{row['bus_down_s']:.3f} s ({row['bus_down_bytes'] / 1e9:.2f} GB); {row['streamed_elements']:,} "
                  f"elements streamed; the floor is the {row['floor_lane']}", file=out)
    print("  floor = max(compute: the faster plain side's forward + backward, the host's Adam share: host elements "
          "x the measured step per element, and on a GPU each bus direction: the bytes a step moved at the measured "
          "rate)", file=out)
