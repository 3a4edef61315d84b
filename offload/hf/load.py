"""``offload.hf.from_pretrained``: a local Hugging Face checkpoint to an engine, never whole in memory.

The model is built from the directory's ``config.json`` on the meta device (offload.zero.Init:
only tensors below its threshold, such as rotary frequencies, get memory), and the engine
fills each unit's shard from the safetensors files as it builds it (see [Note: reading a
checkpoint into shards] in offload/files/pretrained.py). Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from offload.files.pretrained import PretrainedError, PretrainedWeights, local_checkpoint
from offload.zero.init import Init


def meta_model(path: str | os.PathLike[str], auto_class: str = "AutoModelForCausalLM",
               min_meta_numel: int = 4096, **config_kwargs: Any) -> nn.Module:
    """The model a local checkpoint directory describes, built by ``transformers.<auto_class>.from_config`` with
    its large tensors on the meta device (no memory, no initialisation cost). ``config_kwargs`` override its
    config.json's values (``num_labels=3`` for a classification head), as in ``AutoConfig.from_pretrained``."""
    try:
        import transformers
    except ImportError:
        raise PretrainedError("loading a Hugging Face checkpoint needs transformers: pip install 'offload[hf]' "
                              "(or pip install transformers)") from None
    where = local_checkpoint(path)
    if not (where / "config.json").is_file():
        raise PretrainedError(f"{where}: no config.json, so the model it holds is unknown; save it with "
                              "save_pretrained, which writes one")
    factory = getattr(transformers, auto_class, None)
    if factory is None or not hasattr(factory, "from_config"):
        raise PretrainedError(f"transformers has no auto class {auto_class!r}; use one such as "
                              "AutoModelForCausalLM or AutoModelForSequenceClassification")
    config = transformers.AutoConfig.from_pretrained(where, local_files_only=True, **config_kwargs)
    with Init(min_meta_numel=min_meta_numel):
        return factory.from_config(config)


def from_pretrained(path: str | os.PathLike[str], config: Any, *, auto_class: str = "AutoModelForCausalLM",
                    strict: bool = True, model_config: dict[str, Any] | None = None,
                    **initialize_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``engine, optimizer, dataloader, lr_scheduler`` (as ``offload.initialize`` returns them) for the checkpoint
    in local directory ``path``, trained with ``config`` (a DeepSpeed-format config: a path, JSON, a dict or a
    Config). Every parameter equals what ``transformers``' ``from_pretrained`` loads (fp32 masters); a key the
    model lacks, a parameter the checkpoint lacks or a shape that differs is an error naming them (``strict``
    false: the model initialises what the checkpoint lacks and skips what it does not read, as from_pretrained
    does for a new head). ``model_config`` overrides config.json's values (``{"num_labels": 3}``)."""
    from offload.engine.initialize import initialize
    model = meta_model(path, auto_class, **(model_config or {}))
    return initialize(model=model, config=config, weights=PretrainedWeights(path, strict=strict),
                      **initialize_kwargs)
