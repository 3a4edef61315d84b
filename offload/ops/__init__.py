"""DeepSpeed's ``deepspeed.ops``: the optimizer classes its scripts import by name (``deepspeed.ops.adam``,
``deepspeed.ops.adagrad``, ``deepspeed.ops.lion``)."""

from offload.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
