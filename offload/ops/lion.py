"""DeepSpeed's ``deepspeed.ops.lion`` name: ``DeepSpeedCPULion`` is offload's host Lion (offload/optim/one_state.py)
with DeepSpeed's arguments and defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offload.optim.one_state import CPULion


class DeepSpeedCPULion(CPULion):
    """DeepSpeed's CPU Lion signature over offload's native kernel."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False): Lion's momentum is float32 here; leave "
                             "fp32_optimizer_states True")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
