"""`offload demo`: the small walk-through of the engine (the main job is `offload train`) on a small model.

It loads the embedded default config (or yours), and trains a small byte-level GPT
on embedded text through ``offload.initialize``: ZeRO-3 units gathered around each
block, gradients reduce-scattered and streamed to the host, the native CPU Adam
step with clipping. Under torchrun each rank trains on its own windows of the text.
The loss falls visibly within seconds; the summary says where the step's time went.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from typing import TextIO

import torch

from offload.config import Config
from offload.engine import initialize
from offload.machine import native
from offload.models import GPT, GPTConfig

TEXT = (
    "offload keeps the parameters, gradients and optimizer state of a model on the tier "
    "its budget allows: accelerator memory, pinned host memory or swap files on NVMe. "
    "Units of parameters are gathered before they are used and released after; their "
    "gradients are reduced into one shard per rank and stream to the host, where a "
    "vectorized Adam updates the fp32 master weights. A prefetcher reads ahead so the "
    "copies hide under compute, and every budget is a hard limit. "
)


def default_config_text() -> str:
    return resources.files("offload").joinpath("defaults/demo.json").read_text()


@dataclass
class DemoResult:
    first_loss: float
    last_loss: float
    steps: int
    kernel: str
    units: int
    peak_live: int
    skipped_steps: int


def run_demo(config: Config | str | None = None, steps: int = 150, seed: int = 0, out: TextIO | None = None,
             trace: str | None = None) -> DemoResult:
    def say(msg: str) -> None:
        if out is not None and engine.group.rank == 0:
            print(msg, file=out, flush=True)

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, context=64, hidden_size=64, layers=2, heads=4))
    engine, _, _, _ = initialize(model=model, config=config if config is not None else default_config_text())
    cfg = engine.config
    say(f"config: micro batch {cfg.train_micro_batch_size_per_gpu}, accumulation {cfg.gradient_accumulation_steps}, "
        f"clip {cfg.gradient_clipping}, ZeRO stage {cfg.zero_optimization.stage}, optimizer on "
        f"{cfg.zero_optimization.offload_optimizer.device}, world {engine.group.world}")
    for note in cfg.notes:
        say(f"config note: {note}")
    params = sum(u.numel for u in engine.units)  # a released parameter is empty: the units hold the counts
    say(f"model: {params:,} parameters in {len(engine.units)} units "
        f"({sum(u.persistent for u in engine.units)} persistent); native kernels: {native.active_variant()}")

    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed + engine.group.rank)
    micro, accum = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    assert isinstance(micro, int) and isinstance(accum, int)  # the engine's config is resolved: numbers
    context = model.config.context
    first = last = math.nan
    if trace is not None:
        engine.telemetry.start_trace()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss_sum = 0.0
        for _ in range(accum):
            starts = torch.randint(0, len(data) - context - 1, (micro,), generator=gen)
            window = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).to(engine.accel.device)
            loss = engine.backward(engine(window[:, :-1], window[:, 1:]))
            engine.step()
            loss_sum += loss.item() / accum
        first = loss_sum if step == 1 else first
        last = loss_sum
        if step == 1 or step % cfg.progress_every == 0 or step == steps:
            say(f"step {step:4d}  loss {loss_sum:7.4f}  grad norm {engine.last_grad_norm:8.4f}  "
                f"lr {engine.get_lr()[0]:.2e}  {time.perf_counter() - start:6.1f}s")
    elapsed = time.perf_counter() - start
    snap = engine.telemetry.snapshot()
    say(f"loss {first:.3f} -> {last:.3f} in {steps} steps ({elapsed:.1f}s); peak gathered parameters "
        f"{engine.peak_live_parameters:,} of {sum(u.numel for u in engine.units):,}")
    say("time per step: " + ", ".join(f"{k} {v / steps * 1e3:.1f} ms" for k, v in sorted(snap.seconds.items())))
    if trace is not None:
        path = engine.telemetry.export_chrome_trace(trace, engine.group.rank)
        share = engine.telemetry.overlap_share()
        say(f"timeline: {path} (open in https://ui.perfetto.dev); "
            f"{'no background copies' if share is None else f'{share:.0%} of the background copies'} ran during "
            "forward/backward")
    say(engine.memory_report())
    result = DemoResult(first, last, steps, native.active_variant(), len(engine.units), engine.peak_live_parameters,
                        engine.skipped_steps)
    engine.close()
    return result
