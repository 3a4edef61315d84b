"""The models `offload train` and `offload estimate` build by name: the built-in GPT, or a Hugging Face GPT-2 or
Llama (transformers) of the named size, which --layers/--hidden/--heads override."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# name -> (family, layers, hidden, heads): sizes by name; --layers/--hidden/--heads override.
MODELS: dict[str, tuple[str, int, int, int]] = {
    "gpt-tiny": ("builtin", 2, 64, 4),
    "gpt-small": ("builtin", 6, 256, 8),
    "gpt2": ("gpt2", 12, 768, 12),
    "gpt2-medium": ("gpt2", 24, 1024, 16),
    "gpt2-tiny": ("gpt2", 2, 64, 4),
    "llama-tiny": ("llama", 2, 64, 4),
    "llama-1b": ("llama", 16, 2048, 32),
}


class ModelError(ValueError):
    """A model that cannot be built as asked; the message says what would be right."""


def require(name: str) -> str:
    """``name``'s family, once it is known and what builds it is installed (ModelError: what would be right)."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} (and --layers/--hidden/"
                         "--heads for other sizes)")
    family = MODELS[name][0]
    if family != "builtin":
        try:
            import transformers  # noqa: F401 - only whether it is there
        except ImportError:
            raise ModelError(f"model {name!r} needs the transformers package (pip install transformers), or use "
                             "a built-in model (gpt-tiny, gpt-small)") from None
    return family


def build_model(name: str, vocab: int, seq: int, layers: int | None = None, hidden: int | None = None,
                heads: int | None = None) -> nn.Module:
    """Model ``name`` for ``vocab`` tokens and ``seq``-token samples, with any size given overriding its own."""
    family = require(name)
    _, default_layers, default_hidden, default_heads = MODELS[name]
    layers, hidden, heads = layers or default_layers, hidden or default_hidden, heads or default_heads
    if hidden % heads:
        raise ModelError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    if family == "builtin":
        from offload.models.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=vocab, context=seq, hidden_size=hidden, layers=layers, heads=heads))
    import transformers
    config: transformers.GPT2Config | transformers.LlamaConfig
    if family == "gpt2":
        special = min(50256, vocab - 1)  # GPT-2's end-of-text token, inside a smaller vocabulary
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                                         n_head=heads, bos_token_id=special, eos_token_id=special)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      max_position_embeddings=seq)
    return transformers.LlamaForCausalLM(config)


def lm_loss(model: nn.Module, call: Any, batch: torch.Tensor) -> torch.Tensor:
    """The next-token loss of ``batch`` (rows of seq + 1 tokens) through ``call`` (``model`` itself, or an engine
    around it): the built-in GPT takes inputs and targets; a Hugging Face causal LM gives logits, and the loss is
    taken in float32 as the GPT's is."""
    from offload.models.gpt import GPT
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if isinstance(model, GPT):
        return call(inputs, targets)
    logits = call(input_ids=inputs).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
