"""ZeRO-3: units cut from the module tree, flat shards over the group, gather/release hooks, reduce-scatter."""

from offload.zero.plan import ParamSlot, UnitPlan, plan_units
from offload.zero.runtime import LiveLimitError, ZeroRuntime
from offload.zero.unit import Unit, UnitState

__all__ = ["LiveLimitError", "ParamSlot", "Unit", "UnitPlan", "UnitState", "ZeroRuntime", "plan_units"]
