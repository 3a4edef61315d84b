"""DeepSpeed's ZeRO-3 ``optimizer.parameter_offload``, as TRL reaches into it around ``generate``
(``unwrap_model_for_generation`` with ``ds3_gather_for_generation``): it gathers every parameter, takes the
parameter-offload hooks off the module so that generation's many small forwards run on the gathered weights without
them, and puts them back after.

[Note: generation's hooks] offload's gathering hooks are not DeepSpeed's: each is a look at its unit's holders, and
inside ``GatheredParameters`` every unit is held, so a forward finds its weights there and gathers nothing (about
1.7 microseconds a module). So ``forward_hooks`` and ``backward_hooks`` are empty lists here: taking them off is
nothing to do and leaves offload's own in place, which is what keeps the units' accounting right when the block ends.
Without the gather (``ds3_gather_for_generation`` false), the same hooks gather each unit for its forward, unit by
unit, as DeepSpeed's do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from offload.zero.plan import EXTERNAL


class _TraceCoordinator:
    """DeepSpeed's parameter coordinator, for the two questions TRL asks after generation: offload re-records the
    prefetch order on its own whenever the module order changes, so the trace is never stale."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        pass


class ParameterOffload:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward_hooks: list[Any] = []  # see [Note: generation's hooks]
        self.backward_hooks: list[Any] = []
        self.param_coordinator = _TraceCoordinator()
        for p in module.parameters():
            if not hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules = set()  # type: ignore[attr-defined]  # DeepSpeed's, read by TRL
        if "ds_external_parameters" not in module.__dict__:
            module.ds_external_parameters = self.external_parameters  # type: ignore[assignment]

    def external_parameters(self) -> list[tuple[int, nn.Parameter]]:
        """The parameters registered as read by the root's forward (``zero.register_external_parameter``)."""
        return list(self.module.__dict__.get(EXTERNAL, {}).items())

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Putting DeepSpeed's hooks back: offload's never came off (see [Note: generation's hooks])."""
