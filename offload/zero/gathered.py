"""DeepSpeed's ``zero.GatheredParameters``: the named ZeRO-3 parameters whole inside a block, what
``modifier_rank`` writes there kept on every rank. The parameters lead to their engine (each carries a weak
reference to it); the engine gathers just the units that hold them (offload/engine/weights.py: [Note: writing
through gathered parameters]). Parameters no engine partitions (a model not yet given to ``initialize``, or
``enabled=False``) are whole already: the block runs with nothing to do, as under DeepSpeed; one still on the meta
device (built under ``zero.Init``) gets its plain-construction values first, so that what the block writes is
kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from offload.zero.init import materialize_param
from offload.zero.plan import engine_of


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                       fwd_module: Any = None, enabled: bool = True) -> Iterator[None]:  # noqa: N802 - DeepSpeed's name
    """A collective: every rank enters with the same parameters. ``fwd_module`` (DeepSpeed's external-parameter
    registration while inside) needs nothing here: the named units stay gathered for the whole block."""
    named = [params] if isinstance(params, torch.Tensor) else list(params)
    if enabled:
        for param in named:  # built under zero.Init and not yet sharded: whole from here on, so writes are kept
            if param.is_meta:
                materialize_param(param)
    engines = {id(e): e for e in map(engine_of, named) if e is not None}
    if not enabled or not engines:
        yield
        return
    if len(engines) > 1:
        raise ValueError("GatheredParameters was given parameters of more than one offload engine: gather each "
                         "engine's in a block of its own")
    engine = next(iter(engines.values()))
    with engine.gathered_parameters(modifier_rank, params=named):
        yield
