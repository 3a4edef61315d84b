"""The models `offload train` and `offload estimate` build by name: the built-in GPT, or a Hugging Face GPT-2 or
Llama (transformers) of the named size, which --layers/--hidden/--heads override."""

from __future__ import annotations

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


def build_model(name: str, vocab: int, seq: int, layers: int | None = None, hidden: int | None = None,
                heads: int | None = None) -> nn.Module:
    """Model ``name`` for ``vocab`` tokens and ``seq``-token samples, with any size given overriding its own."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} (and --layers/--hidden/"
                         "--heads for other sizes)")
    family, default_layers, default_hidden, default_heads = MODELS[name]
    layers, hidden, heads = layers or default_layers, hidden or default_hidden, heads or default_heads
    if hidden % heads:
        raise ModelError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    if family == "builtin":
        from offload.models.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=vocab, context=seq, hidden_size=hidden, layers=layers, heads=heads))
    try:
        import transformers
    except ImportError:
        raise ModelError(f"model {name!r} needs the transformers package (pip install transformers), or use "
                         "a built-in model (gpt-tiny, gpt-small)") from None
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                                         n_head=heads)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      max_position_embeddings=seq)
    return transformers.LlamaForCausalLM(config)
