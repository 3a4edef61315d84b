"""PyTorch Lightning on offload's engine: ``import offload.lightning`` registers the ``offload_*`` strategy names
(DeepSpeed's, with ``offload`` for ``deepspeed``) for the Trainer. See docs/lightning.md."""

from lightning.pytorch.strategies import StrategyRegistry

from offload.lightning.trainer import OffloadStrategy

OffloadStrategy.register_strategies(StrategyRegistry)

__all__ = ["OffloadStrategy"]
