"""`offload bench formats`: does training with the optimizer state in fewer bytes end where fp32 state ends?

The convergence A/B of offload/store/state_format.py's formats, on a task this CPU trains in minutes: the
built-in GPT learns the bytes of offload's own source (a few hundred KB of Python, held out in its last tenth),
bf16 compute, AdamW with warmup and a cosine decay to a tenth of the peak rate, which ends at the small updates
that a bf16 master rounded to nearest loses. Several seeds of the fp32 state make the band (the spread that seed
alone gives); each format's held-out loss at the end is inside it or not. The bf16 master rounded to nearest is
the negative control: it should end outside, which shows that the comparison can fail.

Writes the curves and the verdicts as JSON, and a plot of the held-out loss beside it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

import offload
from offload.models import GPT, GPTConfig
from offload.store import state_format

FORMATS = state_format.FORMATS  # every format the engine holds, by its name
CONTROL = "bf16 master nearest"  # expected outside the band


@dataclass(kw_only=True)
class FormatsBench:
    steps: int = 2000
    seeds: int = 3  # of the fp32 band; every other format runs the first seed
    hidden: int = 96
    layers: int = 3
    heads: int = 4
    seq: int = 64
    micro: int = 16
    lr: float = 1e-3  # where the negative control ends outside the band (3e-3 left it inside: docs/performance.md)
    warmup: int = 100
    final_ratio: float = 0.1  # the cosine decays to this fraction of lr
    eval_every: int = 100
    eval_batches: int = 8
    formats: list[str] = field(default_factory=lambda: list(FORMATS))


@dataclass
class Run:
    format: str
    seed: int
    steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # mean over each eval interval
    seconds: float = 0.0
    optimizer_state_bytes: int = 0


def corpus() -> torch.Tensor:
    """The bytes of offload's own Python source, in a fixed order."""
    root = Path(offload.__file__).parent
    text = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.tensor(list(text), dtype=torch.long)


def _config(b: FormatsBench, name: str) -> dict[str, Any]:
    master, moments = FORMATS[name].names()
    return {"train_micro_batch_size_per_gpu": b.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": b.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": b.steps, "warmup_num_steps": b.warmup,
                                     "warmup_type": "linear", "cos_min_ratio": b.final_ratio}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "offload": {"optimizer_state": {"master": master, "moments": moments}}}


def _windows(tokens: torch.Tensor, seq: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq - 1, (rows,), generator=gen)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def train_one(b: FormatsBench, name: str, seed: int, tokens: torch.Tensor) -> Run:
    """One run of ``name`` from ``seed`` (the model's initialisation and the batches' order)."""
    cut = tokens.numel() * 9 // 10
    train, held = tokens[:cut], tokens[cut:]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, context=b.seq, hidden_size=b.hidden, layers=b.layers, heads=b.heads))
    engine, *_ = offload.initialize(model=model, config=_config(b, name))
    gen, eval_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(12345)
    evals = [_windows(held, b.seq, b.micro, eval_gen) for _ in range(b.eval_batches)]  # the same for every run
    run = Run(name, seed, optimizer_state_bytes=engine.memory_summary()["host"].get("optimizer state", 0))
    start, window = time.perf_counter(), []
    try:
        for step in range(1, b.steps + 1):
            batch = _windows(train, b.seq, b.micro, gen)
            window.append(engine.backward(engine(batch[:, :-1], batch[:, 1:])).item())
            engine.step()
            if step % b.eval_every == 0 or step == b.steps:
                engine.eval()
                with torch.no_grad():
                    loss = sum(engine(x[:, :-1], x[:, 1:]).item() for x in evals) / len(evals)
                engine.train()
                run.steps.append(step)
                run.eval_loss.append(loss)
                run.train_loss.append(sum(window) / len(window))
                window = []
    finally:
        engine.close()
    run.seconds = time.perf_counter() - start
    return run


def verdicts(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Each format's final held-out loss against the fp32 seeds' band [min, max]."""
    band = [r.eval_loss[-1] for r in runs if r.format == "fp32"]
    lo, hi = min(band), max(band)
    out = {}
    for r in runs:
        if r.format == "fp32":
            continue
        final = r.eval_loss[-1]
        out[r.format] = {"final": final, "band": [lo, hi], "inside": lo <= final <= hi,
                         "above_band_by": max(0.0, final - hi)}
    return out


def plot(runs: list[Run], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (whole, end) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"fp32": "0.55", "bf16 moments": "tab:blue", "bf16 master stochastic": "tab:green",
              "bf16 master nearest": "tab:red"}
    for r in runs:
        label = f"{r.format} (seed {r.seed})" if r.format == "fp32" else r.format
        for ax in (whole, end):
            ax.plot(r.steps, r.eval_loss, color=colors.get(r.format), label=label,
                    linestyle="--" if r.format == "fp32" else "-", linewidth=1.2)
    tail = max(1, len(runs[0].steps) * 2 // 3)
    end.set_xlim(runs[0].steps[tail - 1], runs[0].steps[-1])
    finals = [r.eval_loss[-1] for r in runs]
    lows = [min(r.eval_loss[tail - 1:]) for r in runs]
    end.set_ylim(min(lows) - 0.02, max(finals + [r.eval_loss[tail - 1] for r in runs]) + 0.02)
    for ax, what in ((whole, "the whole run"), (end, "the last third (the decayed rate)")):
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats a byte)")
        ax.set_title(what)
        ax.grid(alpha=0.3)
    end.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(b: FormatsBench, out: Path, stream: TextIO | None = None) -> dict[str, Any]:
    def say(msg: str) -> None:
        if stream is not None:
            print(msg, file=stream, flush=True)

    tokens = corpus()
    say(f"offload bench formats: GPT {b.layers} x {b.hidden}, seq {b.seq}, {b.micro} sequences a step, {b.steps} "
        f"steps, lr {b.lr} (warmup {b.warmup}, cosine to {b.final_ratio:g} of it), {tokens.numel():,} bytes of "
        f"offload's source (the last tenth held out), bf16 compute")
    plan = [("fp32", s) for s in range(b.seeds)] + [(f, 0) for f in b.formats if f != "fp32"]
    runs = []
    for name, seed in plan:
        r = train_one(b, name, seed, tokens)
        runs.append(r)
        say(f"  {name:<24} seed {seed}: held-out loss {r.eval_loss[0]:.3f} -> {r.eval_loss[-1]:.4f}  "
            f"({r.seconds:.0f} s, optimizer state {r.optimizer_state_bytes / 2**20:.1f} MiB)")
    result: dict[str, Any] = {"bench": asdict(b), "runs": [asdict(r) for r in runs],
              "verdicts": verdicts(runs) if b.seeds and any(r.format != "fp32" for r in runs) else {}}
    for name, v in result["verdicts"].items():
        where = "inside" if v["inside"] else f"OUTSIDE (+{v['above_band_by']:.4f})"
        expected = " (the negative control: expected outside)" if name == CONTROL else ""
        say(f"  {name:<24} final {v['final']:.4f} against the fp32 band [{v['band'][0]:.4f}, {v['band'][1]:.4f}]: "
            f"{where}{expected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = plot(runs, out.with_suffix(".png"), f"offload bench formats: GPT {b.layers} x {b.hidden}, {b.steps} steps, "
                                             f"fp32 band of {b.seeds} seeds")
    say(f"wrote {out} and {png}")
    result["plot"] = str(png)
    if any(math.isnan(r.eval_loss[-1]) for r in runs):
        say("a run diverged (NaN loss)")
    return result
