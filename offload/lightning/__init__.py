"""PyTorch Lightning on offload's engine: ``import offload.lightning`` registers the ``offload_*`` strategy names
(DeepSpeed's, with ``offload`` for ``deepspeed``) for the Trainer and for Fabric. See docs/lightning.md."""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from offload.lightning import fabric
from offload.lightning.trainer import OffloadStrategy

OffloadStrategy.register_strategies(StrategyRegistry)
fabric.OffloadStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["OffloadStrategy", "fabric"]
