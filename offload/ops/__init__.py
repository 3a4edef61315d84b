"""DeepSpeed's ``deepspeed.ops``: the optimizer classes its scripts import by name (``deepspeed.ops.adam``)."""

from offload.ops import adam

__all__ = ["adam"]
