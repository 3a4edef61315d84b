"""Built-in models: a small GPT for the demo, tests and benchmarks when transformers is absent."""

from offload.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
