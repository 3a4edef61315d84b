"""`offload bench step`: a ZeRO-3 training step with the CPU optimizer beside plain single-process PyTorch.

Both train the same GPT on the same global batch: offload on W ranks over gloo (each
rank a process with cores/W threads, so both sides use the whole machine), torch in
one process with torch.optim.AdamW. Runs alternate (torch, offload, torch, ...) so
drift of the shared machine falls on both alike; each figure is a median.

The offload step is split by the engine's telemetry into gather, reduce-scatter,
waiting for gradients to reach the host, and the optimizer (norm + Adam); compute is
what remains. The copy and host threads' busy time (d2h, accumulate, h2d) runs beside
the step and is reported as background time. The ratio offload/torch is what
sharding costs on this machine: on one host the "device" is CPU memory, so every
gather and copy is overhead that a GPU job would spend on other buses.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from offload.launch import run_ranks
from offload.telemetry import BACKGROUND, FOREGROUND


@dataclass(kw_only=True)
class StepBench:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 4096
    seq: int = 128
    micro: int = 4
    world: int = 2
    steps: int = 5
    warmup: int = 2
    repeats: int = 2
    dtype: str = "fp32"

    def model_config(self) -> Any:
        from offload.models import GPTConfig
        return GPTConfig(vocab_size=self.vocab, context=self.seq, hidden_size=self.hidden, layers=self.layers,
                         heads=self.heads)


@dataclass
class StepResult:
    bench: dict[str, Any]
    params: int
    torch_step_s: float
    offload_step_s: float
    ratio: float
    phases_s: dict[str, float] = field(default_factory=dict)  # per step, training thread
    background_s: dict[str, float] = field(default_factory=dict)  # per step, copy/host threads
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)


def _batches(b: StepBench, n: int, rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, b.vocab, (rows, b.seq + 1), generator=gen) for _ in range(n)]


def _engine_rank(rank: int, world: int, bench: dict[str, Any]) -> dict[str, Any]:
    import offload
    from offload.models import GPT
    b = StepBench(**bench)
    torch.manual_seed(0)
    model = GPT(b.model_config())
    config = {"train_micro_batch_size_per_gpu": b.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "bf16": {"enabled": b.dtype == "bf16"},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
              "offload": {"unit_bytes": 4 << 20}}
    engine, *_ = offload.initialize(model=model, config=config)
    times = []
    for i, tokens in enumerate(_batches(b, b.warmup + b.steps, b.micro * world)):
        rows = tokens[rank * b.micro:(rank + 1) * b.micro]
        if i == b.warmup:
            engine.telemetry.reset()
        t0 = time.perf_counter()
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
        if i >= b.warmup:
            times.append(time.perf_counter() - t0)
    snap = engine.telemetry.snapshot()
    engine.close()
    return {"times": times, "seconds": snap.seconds, "bytes": snap.bytes}


def _torch_steps(b: StepBench) -> list[float]:
    from offload.models import GPT
    torch.manual_seed(0)
    model = GPT(b.model_config())
    if b.dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    times = []
    for i, tokens in enumerate(_batches(b, b.warmup + b.steps, b.micro * b.world)):
        t0 = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= b.warmup:
            times.append(time.perf_counter() - t0)
    return times


def run(b: StepBench, out_path: Path | None = None, log: TextIO | None = None) -> StepResult:
    cores = os.cpu_count() or 1
    torch_times: list[float] = []
    offload_times: list[float] = []
    phase_runs: list[dict[str, Any]] = []
    for r in range(b.repeats):
        torch_times += _torch_steps(b)
        ranks = run_ranks(_engine_rank, b.world, timeout=1800, threads=max(1, cores // b.world), bench=asdict(b))
        offload_times += [max(ts) for ts in zip(*(rank["times"] for rank in ranks))]  # a step ends on the last rank
        phase_runs.append(ranks[0])
        if log:
            print(f"  round {r + 1}/{b.repeats}: torch {statistics.median(torch_times):.3f} s/step, "
                  f"offload {statistics.median(offload_times):.3f} s/step", file=log, flush=True)
    steps = b.steps * b.repeats
    seconds = {k: sum(run["seconds"].get(k, 0.0) for run in phase_runs) / steps for k in FOREGROUND + BACKGROUND}
    t_off, t_torch = statistics.median(offload_times), statistics.median(torch_times)
    phases = {k: seconds[k] for k in FOREGROUND}
    phases["compute"] = max(0.0, t_off - sum(phases.values()))
    result = StepResult(
        bench=asdict(b), params=b.model_config().num_parameters, torch_step_s=t_torch, offload_step_s=t_off,
        ratio=t_off / t_torch, phases_s=phases, background_s={k: seconds[k] for k in BACKGROUND},
        bytes_per_step={k: sum(run["bytes"].get(k, 0) for run in phase_runs) / steps
                        for k in ("all_gather", "reduce_scatter", "d2h", "h2d")},
        samples={"torch": torch_times, "offload": offload_times})
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(asdict(result), indent=2))
    return result


def print_table(result: StepResult, out: TextIO) -> None:
    b = result.bench
    print(f"GPT {result.params / 1e6:.1f}M params, {b['layers']} layers x {b['hidden']}, seq {b['seq']}, "
          f"global batch {b['micro'] * b['world']} ({b['dtype']})", file=out)
    print(f"  plain torch, 1 process:       {result.torch_step_s * 1e3:8.1f} ms/step", file=out)
    print(f"  offload ZeRO-3, W={b['world']} (gloo): {result.offload_step_s * 1e3:8.1f} ms/step  "
          f"= {result.ratio:.2f}x torch", file=out)
    for name, s in result.phases_s.items():
        print(f"    {name:15s} {s * 1e3:8.1f} ms  {s / result.offload_step_s:6.1%}", file=out)
    print("  beside it (copy/host threads): " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in result.background_s.items()), file=out)
    print("  bytes per step per rank: " + ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in result.bytes_per_step.items()), file=out)
