"""DeepSpeed's ``deepspeed.ops.adagrad`` name: ``DeepSpeedCPUAdagrad`` is offload's host Adagrad
(offload/optim/one_state.py) with DeepSpeed's arguments and defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offload.optim.one_state import CPUAdagrad


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """DeepSpeed's CPU Adagrad signature over offload's native kernel (torch.optim.Adagrad's update)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant; use amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad(fp32_optimizer_states=False): the sum of squares is float32 here; "
                             "leave fp32_optimizer_states True")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
