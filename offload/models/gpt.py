"""A GPT-style causal language model in plain torch: pre-LN blocks, bias-free projections, tied head.

Bias-free q/k/v projections matter for testing: a key bias gets a gradient that is
zero up to rounding, which Adam magnifies into noise of size lr, so no two
implementations agree on it. Without it every parameter has a real gradient and
parity tests can be tight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of heads ({self.heads})")

    @property
    def num_parameters(self) -> int:
        h = self.hidden_size
        block = (4 + 2 * self.mlp_ratio) * h * h + (6 + self.mlp_ratio) * h  # 2 LayerNorms, attention, MLP
        return self.vocab_size * h + self.context * h + self.layers * block + 2 * h


class Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.hidden_size)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, c.mlp_ratio * c.hidden_size), nn.GELU(),
                                 nn.Linear(c.mlp_ratio * c.hidden_size, c.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None, **kwargs: int) -> None:
        super().__init__()
        self.config = c = config or GPTConfig(**kwargs)
        self.hidden_size = c.hidden_size
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        self.wpe = nn.Embedding(c.context, c.hidden_size)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden_size)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation, module by module."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise one module's own parameters (offload.zero.Init materialises unit by unit through this)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.config.layers) if name.endswith(("proj", "mlp.2")) else 0.02
            nn.init.normal_(module.weight, std=std)
            bias = getattr(module, "bias", None)  # an Embedding has none
            if bias is not None:
                nn.init.zeros_(bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when ``targets`` is given."""
        t = tokens.shape[1]
        if t > self.config.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context ({self.config.context})")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
