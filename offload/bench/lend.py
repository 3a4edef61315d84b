"""`offload bench lend`: what ``engine.offload_states()`` gives the device back and how long the round trip takes.

An RLHF loop (OpenRLHF, verl, DeepSpeed-Chat) lends the trained engines' device memory to generation between steps:
``offload_states()``, generate, ``reload_states()``. Each side runs in a process of its own (one rank): the model
built (seed 0) and trained one step, so its optimizer state and gradients exist, then ``rounds`` round trips, each
timed from a synchronized device: ``offload_states`` (pinned host memory, blocking: DeepSpeed's defaults), then
``reload_states``. What the device frees is torch's allocated bytes before it minus after (on a GPU; the caching
allocator's reserve aside), beside the engine's own count of the bytes it lent. The sides: offload; the bus (one
buffer of the bytes offload lent copied to pinned host memory and back: the time no round trip can beat); and,
where DeepSpeed is installed and a GPU is there, DeepSpeed's ``offload_states`` on the same model and config (the
one file both engines read). On a machine without a GPU the emulated discrete device's copies are host memory
copies: the bench runs, and its times say nothing of a bus.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.bench.step import StepBench, batches, sync
from offload.bench.versus import PLACEMENTS, deepspeed_engine, deepspeed_version, shared_config
from offload.machine.launch import run_ranks
from offload.models.catalog import lm_loss

SIDES = ("offload", "bus", "deepspeed")


@dataclass
class Trips:
    """One side's round trips: seconds each way per round, the bytes the device freed and the bytes lent."""

    side: str
    name: str = ""
    out_s: list[float] = field(default_factory=list)
    back_s: list[float] = field(default_factory=list)
    freed: int = 0  # torch's allocated bytes before offload_states minus after (0 without a GPU)
    lent: int = 0  # the bytes the engine says it moved (the bus side: the bytes it copied)
    returned: bool = True  # after reload_states the device holds what it held before (allocated bytes)
    skipped: str = ""  # why the side did not run

    @property
    def round_trip_s(self) -> float:
        return statistics.median(o + b for o, b in zip(self.out_s, self.back_s, strict=True))

    def spread_s(self) -> tuple[float, float]:
        trips = [o + b for o, b in zip(self.out_s, self.back_s, strict=True)]
        return min(trips), max(trips)


@dataclass
class LendReport:
    bench: dict[str, Any]
    placement: str
    rounds: int
    sides: dict[str, Trips]
    machine: str = ""


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _side_rank(rank: int, world: int, side: str, bench: dict[str, Any], config_path: str, rounds: int
               ) -> dict[str, Any]:
    """One side's process: its engine trained one step, then ``rounds`` timed round trips."""
    b = StepBench(**bench)
    torch.manual_seed(0)
    model = b.build_model()
    if side == "deepspeed":
        engine, _ = deepspeed_engine(model, b, config_path)
        name = f"DeepSpeed {deepspeed_version()} offload_states"
    else:
        import offload
        engine, *_ = offload.initialize(model=model, config=config_path)
        name = "offload offload_states"
    rows = batches(b, 1, b.micro)[0].to(engine.device if side == "deepspeed" else engine.accel.device)
    engine.backward(lm_loss(model, engine, rows))
    engine.step()
    trips = Trips(side, name)
    for _ in range(rounds):
        sync(b.device)
        before = _allocated(b.device)
        t0 = time.perf_counter()
        engine.offload_states(pin_memory=True, non_blocking=False)
        sync(b.device)
        t1 = time.perf_counter()
        trips.freed = before - _allocated(b.device)
        trips.lent = engine.states_offloaded if side == "offload" else trips.freed
        engine.reload_states(non_blocking=False)
        sync(b.device)
        trips.out_s.append(t1 - t0)
        trips.back_s.append(time.perf_counter() - t1)
        trips.returned = trips.returned and _allocated(b.device) == before
    if side == "offload":
        engine.close()
    return asdict(trips)


def _bus_rank(rank: int, world: int, device: str, nbytes: int, rounds: int) -> dict[str, Any]:
    """The bytes offload lent, as one buffer, to pinned host memory and back."""
    trips = Trips("bus", "one buffer to pinned host memory and back (torch copies)", lent=nbytes)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        host.copy_(on_device)
        sync(device)
        t1 = time.perf_counter()
        on_device.copy_(host)
        sync(device)
        trips.out_s.append(t1 - t0)
        trips.back_s.append(time.perf_counter() - t1)
    return asdict(trips)


def run(b: StepBench, placement: str = "device", rounds: int = 5, out: Path | None = None,
        log: TextIO | None = None) -> LendReport:
    """Every side's round trips (see the module's docstring); JSON to ``out``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"no placement {placement!r}: choose from {', '.join(PLACEMENTS)}")
    bench = asdict(b)
    # the emulated discrete device stands in for a GPU where there is none: offload_states then has something to move
    env = {} if b.device == "cuda" else {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
    sides: dict[str, Trips] = {}
    with tempfile.TemporaryDirectory() as d:
        config_path = os.path.join(d, "config.json")
        Path(config_path).write_text(json.dumps(shared_config(b, PLACEMENTS[placement])))
        sides["offload"] = Trips(**run_ranks(_side_rank, 1, timeout=1800.0, env=env, side="offload", bench=bench,
                                             config_path=config_path, rounds=rounds)[0])
        sides["bus"] = Trips(**run_ranks(_bus_rank, 1, timeout=600.0, env=env, device=b.device,
                                         nbytes=max(sides["offload"].lent, 1), rounds=rounds)[0])
        if b.device != "cuda":
            sides["deepspeed"] = Trips("deepspeed", skipped="no GPU: DeepSpeed's offload_states moves device memory")
        elif deepspeed_version() is None:
            sides["deepspeed"] = Trips("deepspeed", skipped="DeepSpeed is not installed")
        else:
            try:  # its refusal (DeepSpeed 0.19.8 lends optimizer states only beside its FusedAdam) is a row too
                sides["deepspeed"] = Trips(**run_ranks(_side_rank, 1, timeout=1800.0, side="deepspeed", bench=bench,
                                                       config_path=config_path, rounds=rounds)[0])
            except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raised, reported, the other rows kept
                lines = [line for line in str(e).strip().splitlines() if line.strip()]
                why = lines[-1][:300] if lines else repr(e)
                sides["deepspeed"] = Trips("deepspeed", skipped=f"DeepSpeed failed: {why}")
    report = LendReport(bench, placement, rounds, sides,
                        torch.cuda.get_device_name() if b.device == "cuda" else "CPU (the emulated discrete device)")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(report) | {"summary": summary(report)}, indent=1) + "\n")
    if log is not None:
        print_table(report, log)
    return report


def summary(report: LendReport) -> dict[str, Any]:
    """Each side's median round trip, its spread, GB/s each way, and the ratio to the bus's and to offload's."""
    out: dict[str, Any] = {}
    bus, ours = report.sides["bus"], report.sides["offload"]
    for side, t in report.sides.items():
        if t.skipped:
            out[side] = {"skipped": t.skipped}
            continue
        trip = t.round_trip_s
        out[side] = {"round_trip_s": trip, "spread_s": t.spread_s(), "freed_bytes": t.freed, "lent_bytes": t.lent,
                     "out_gbps": t.lent / statistics.median(t.out_s) / 1e9,
                     "back_gbps": t.lent / statistics.median(t.back_s) / 1e9,
                     "x_bus": trip / bus.round_trip_s, "x_offload": trip / ours.round_trip_s, "returned": t.returned}
    return out


def print_table(report: LendReport, out: TextIO) -> None:
    rows = summary(report)
    print(f"offload bench lend on {report.machine}, {report.placement} ({PLACEMENTS[report.placement].describe()}), "
          f"{report.rounds} round trips a side:", file=out)
    for side, row in rows.items():
        if "skipped" in row:
            print(f"  {side:<10} skipped: {row['skipped']}", file=out)
            continue
        lo, hi = row["spread_s"]
        print(f"  {side:<10} {row['round_trip_s'] * 1e3:9.1f} ms a round trip ({lo * 1e3:.1f}-{hi * 1e3:.1f}), "
              f"{row['lent_bytes'] / 2**30:7.2f} GiB lent, {row['freed_bytes'] / 2**30:7.2f} GiB freed, "
              f"{row['out_gbps']:6.1f} GB/s out, {row['back_gbps']:6.1f} back, {row['x_bus']:5.2f}x the bus"
              + ("" if row["returned"] else "; the device did NOT hold what it held before"), file=out)
