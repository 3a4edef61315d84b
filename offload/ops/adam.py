"""DeepSpeed's ``deepspeed.ops.adam`` names, so that a script which builds its own optimizer runs unchanged after the
import swap: ``DeepSpeedCPUAdam`` is offload's CPU Adam (offload/optim/cpu_adam.py) with DeepSpeed's arguments, and
``FusedAdam`` torch's Adam with DeepSpeed's (its AdamW mode is torch's decoupled weight decay). Handed to
``initialize``, either is read for its hyperparameters and the engine steps them, as any client Adam."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from offload.optim.cpu_adam import CPUAdam


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam signature over offload's native kernel."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam(amsgrad=True): AMSGrad is not supported; use amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): moments in bf16 are the engine's "
                             "(bf16.bf16_optimizer_states, or offload.optimizer_state.moments \"bf16\", in the "
                             "config); leave fp32_optimizer_states True here")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                         bias_correction=bias_correction)

    def _check_params(self) -> None:
        """Not at construction: as DeepSpeed's, this is built over the model's (bf16) params to be handed to
        ``initialize`` (accelerate's DeepSpeed path does so with optimizer offload), which steps fp32 masters of
        its own. Stepped by itself, the params are checked first (``step``)."""

    def step(self, closure: Any = None) -> Any:
        CPUAdam._check_params(self)
        return super().step(closure)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam signature over torch's Adam (fused where torch fuses it): ``adam_w_mode`` is
    decoupled weight decay (AdamW), the default as DeepSpeed's."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise ValueError("FusedAdam(amsgrad=True): AMSGrad is not supported; use amsgrad=False")
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False): torch's Adam always corrects for bias; use "
                             "DeepSpeedCPUAdam(bias_correction=False), or an optimizer section with "
                             "\"bias_correction\": false")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.set_grad_none = set_grad_none
