"""ZeRO-3: units cut from the module tree, flat shards over the group, gather/release hooks, reduce-scatter."""

from offload.zero.gathered import GatheredParameters
from offload.zero.init import Init, materialize_unit
from offload.zero.plan import (
                               ParamSlot,
                               UnitPlan,
                               plan_units,
                               register_external_parameter,
                               unregister_external_parameter,
)
from offload.zero.runtime import LiveLimitError, ZeroRuntime
from offload.zero.unit import Unit, UnitState

__all__ = ["GatheredParameters", "Init", "LiveLimitError", "materialize_unit", "ParamSlot", "Unit", "UnitPlan",
           "UnitState", "ZeroRuntime", "plan_units", "register_external_parameter", "unregister_external_parameter"]
