"""``deepspeed.runtime.zero.offload_config``: the state types and target devices of ``engine.offload_states``
(offload/engine/lending.py)."""

from offload.engine.lending import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
