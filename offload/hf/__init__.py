"""Hugging Face models through offload: pretrained checkpoints read straight into shards, and the Trainer.

Needs ``transformers`` (``pip install offload[hf]``; the Trainer needs ``accelerate`` too); the
rest of offload does not.
"""

from typing import Any

from offload.hf.load import from_pretrained, meta_model

__all__ = ["Trainer", "from_pretrained", "meta_model"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # imported on use: transformers.Trainer pulls in accelerate
        from offload.hf.trainer import Trainer
        return Trainer
    raise AttributeError(f"module 'offload.hf' has no attribute {name!r}")
