"""The README's first command until `offload train` exists: a real config, a real model, real kernels.

It loads the embedded default config (or yours), resolves its "auto" keys for the
model, and trains a small byte-level causal transformer on embedded text. The
global gradient norm, the clip and the non-finite check run through offload's
native kernel (and are checked against torch's), and the step is offload's
native CPUAdam with the config's hyperparameters. The ZeRO engine is not here
yet: this runs in one process, unsharded.
The loss falls visibly within seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from typing import TextIO

import torch
from torch import nn

from offload import native
from offload.config import Config
from offload.optim import CPUAdam

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


class TinyGPT(nn.Module):
    """A pre-LN causal transformer over bytes."""

    def __init__(self, vocab: int = 256, width: int = 64, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.hidden_size = width
        self.context = context
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 ties them
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.embed(tokens) + self.pos[:t]
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


@dataclass
class DemoResult:
    first_loss: float
    last_loss: float
    steps: int
    kernel: str
    max_norm_rel_error: float
    skipped_steps: int


def clip_with_native_norm(params: list[nn.Parameter], max_norm: float) -> native.SqNorm:
    """Global gradient norm in one native read per gradient; scale in place when above max_norm."""
    total = native.SqNorm(0.0, 0)
    for p in params:
        part = native.grad_sq_norm(p.grad)
        total = native.SqNorm(total.sum_sq + part.sum_sq, total.nonfinite + part.nonfinite)
    if max_norm > 0 and total.nonfinite == 0:
        coef = max_norm / (total.norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef)
    return total


def run_demo(config: Config | str | None = None, steps: int = 150, seed: int = 0, out: TextIO | None = None
             ) -> DemoResult:
    def say(msg: str) -> None:
        if out is not None:
            print(msg, file=out, flush=True)

    torch.manual_seed(seed)
    model = TinyGPT()
    cfg = Config.load(config if config is not None else default_config_text())
    cfg = cfg.resolve(world_size=1, hidden_size=model.hidden_size)
    opt_cfg = cfg.optimizer.params if cfg.optimizer else None
    say(f"config: micro batch {cfg.train_micro_batch_size_per_gpu}, accumulation {cfg.gradient_accumulation_steps}, "
        f"clip {cfg.gradient_clipping}, zero stage {cfg.zero_optimization.stage}, "
        f"reduce_bucket_size {cfg.zero_optimization.reduce_bucket_size} (auto from hidden size {model.hidden_size})")
    for note in cfg.notes:
        say(f"config note: {note}")
    say(f"native kernels: {native.active_variant()} (runs here: {', '.join(native.supported_variants())})")
    params = [p for p in model.parameters() if p.requires_grad]
    say(f"model: {sum(p.numel() for p in params):,} parameters; optimizer: offload CPUAdam "
        f"({'AdamW' if not opt_cfg or opt_cfg.adam_w_mode else 'Adam with L2'})")
    optimizer = CPUAdam(
        params, lr=opt_cfg.lr if opt_cfg else 1e-3, betas=opt_cfg.betas if opt_cfg else (0.9, 0.999),
        eps=opt_cfg.eps if opt_cfg else 1e-8, weight_decay=opt_cfg.weight_decay if opt_cfg else 0.0,
        adamw_mode=opt_cfg.adam_w_mode if opt_cfg else True,
        bias_correction=opt_cfg.bias_correction if opt_cfg else True)

    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    micro, accum = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    first = last = math.nan
    worst_rel = 0.0
    skipped = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):
            starts = torch.randint(0, len(data) - model.context - 1, (micro,), generator=gen)
            window = torch.stack([data[s:s + model.context + 1] for s in starts.tolist()])
            logits = model(window[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            (loss / accum).backward()
            loss_sum += loss.item() / accum
        reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
        norm = clip_with_native_norm(params, float(cfg.gradient_clipping))
        worst_rel = max(worst_rel, abs(norm.norm - reference) / max(reference, 1e-30))
        if norm.nonfinite:
            skipped += 1
            say(f"step {step}: {norm.nonfinite} non-finite gradient values; step skipped")
            continue
        optimizer.step()
        first = loss_sum if step == 1 else first
        last = loss_sum
        if step == 1 or step % cfg.steps_per_print == 0 or step == steps:
            say(f"step {step:4d}  loss {loss_sum:7.4f}  grad norm {norm.norm:8.4f} (torch {reference:8.4f})  "
                f"{time.perf_counter() - start:6.1f}s")
    say(f"loss {first:.3f} -> {last:.3f} in {steps} steps; native norm within {worst_rel:.1e} of torch's")
    return DemoResult(first, last, steps, native.active_variant(), worst_rel, skipped)
