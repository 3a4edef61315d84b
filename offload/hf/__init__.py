"""Hugging Face models through offload: pretrained checkpoints read straight into shards.

Needs ``transformers`` (``pip install offload[hf]``); the rest of offload does not.
"""

from offload.hf.load import from_pretrained, meta_model

__all__ = ["from_pretrained", "meta_model"]
