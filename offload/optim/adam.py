"""The flat-buffer Adam step the engine calls per sub-group, and its hyperparameters.

[Note: Adam on a discrete device] State kept on a GPU (a partial offload, or no offload) is
stepped there with torch's fused Adam/AdamW, one multi-tensor kernel over a shard's segments:
what plain PyTorch runs there with ``fused=True``, reading each element once. (It used to be
torch's unfused ops, seven kernels and three temporaries per segment: 48 ms a step for the
state of a 1.3B model on an H100.) The clip/unscale factor multiplies the gradient first, as
``clip_grad_norm_`` does before torch's optimizer runs. torch's kernels always correct for
bias, so ``bias_correction: false`` takes the unfused ops. The gradients' norm there is
likewise one multi-tensor kernel in float32, as ``clip_grad_norm_`` takes it
(``ShardedAdam.device_grad_sq_norm``; it was a float64 copy of every segment). Host state
and a CPU compute device keep the native kernels (``adam_step``), so their tiers stay
bitwise alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from offload.machine import native
from offload.store.state_format import mix_seed

RULES = ("adam", "lion", "adagrad")


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """Adam/AdamW hyperparameters, in torch.optim.Adam's meaning."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True  # decoupled weight decay (AdamW); False: L2 added to the gradient (Adam)
    bias_correction: bool = True
    # the update: Adam's, or Lion's or Adagrad's over the same fields (Lion: lr, betas, weight_decay; Adagrad: lr,
    # eps, weight_decay as L2), with one state buffer (offload/optim/one_state.py)
    rule: str = "adam"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"the update is one of {', '.join(RULES)}, not {self.rule!r}")
        beta1, beta2 = self.betas
        for name, value, ok in (("lr", self.lr, self.lr >= 0), ("eps", self.eps, self.eps > 0),
                                ("weight_decay", self.weight_decay, self.weight_decay >= 0),
                                ("betas[0]", beta1, 0 <= beta1 < 1), ("betas[1]", beta2, 0 <= beta2 < 1)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ValueError(f"invalid Adam {name}: {value!r} (lr >= 0, eps > 0, weight_decay >= 0, "
                                 "0 <= betas < 1)")


def _check_step(step: int, grad_scale: float) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number >= 1 (the step being taken), got {step!r}")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale!r}")


def device_adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], step: int, hyper: AdamHyper, grad_scale: float = 1.0) -> None:
    """One Adam step over flat fp32 buffers on the compute device, in place (see [Note: Adam on a discrete
    device]); ``step`` counts from 1."""
    _check_step(step, grad_scale)
    if not params:
        return
    if grad_scale != 1.0:
        grads = list(torch._foreach_mul(grads, grad_scale))  # torch returns a tuple
    if not hyper.bias_correction:
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
            _uncorrected_adam(p, g, m, v, hyper)
        return
    # The kernel counts the step itself: it reads these after adding one.
    steps = list(torch.full((len(params),), float(step - 1), dtype=torch.float32, device=params[0].device).unbind())
    functional = torch_adamw if hyper.adamw_mode else torch_adam
    functional(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False, beta1=hyper.betas[0],
               beta2=hyper.betas[1], lr=hyper.lr, weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)


def device_adam_step_held(slots: list[Any], grads: list[torch.Tensor], step: int, hyper: AdamHyper,
                          grad_scale: float, stochastic: native.Stochastic | None) -> None:
    """The device step of state held in fewer bytes (``slots``: StateSlot views, offload/store/state_format.py):
    widened to fp32, stepped as ``device_adam_step``, stored back as held (moments and a bf16 master to nearest, a
    16+16 master split, a stochastic master by torch's generator from the stream's seed)."""
    masters = [slot.master_fp32() for slot in slots]
    exp_avgs = [slot.exp_avg.float() for slot in slots]
    exp_avg_sqs = [slot.exp_avg_sq.float() for slot in slots]
    device_adam_step(masters, grads, exp_avgs, exp_avg_sqs, step, hyper, grad_scale)
    for i, (slot, master, m, v) in enumerate(zip(slots, masters, exp_avgs, exp_avg_sqs, strict=True)):
        slot.exp_avg.copy_(m)
        slot.exp_avg_sq.copy_(v)
        slot.set_master(master, None if stochastic is None else mix_seed(stochastic.seed, stochastic.index0, i))


def _uncorrected_adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: AdamHyper) -> None:
    """The native kernel's update without bias correction, in torch ops (torch's fused kernel always corrects)."""
    beta1, beta2 = h.betas
    if not h.adamw_mode and h.weight_decay:
        g = g.add(p, alpha=h.weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if h.adamw_mode and h.weight_decay:
        p.mul_(1 - h.lr * h.weight_decay)
    p.addcdiv_(m, v.sqrt().add_(h.eps), value=-h.lr)


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: int, hyper: AdamHyper, grad_scale: float = 1.0, out16: torch.Tensor | None = None,
              threads: int | None = None, pre_scale: float = 1.0,
              into: tuple[torch.Tensor, ...] | None = None, master_lo: torch.Tensor | None = None,
              stochastic: native.Stochastic | None = None) -> None:
    """One fused pass: unscale/clip the gradient by ``grad_scale``, update master/exp_avg/exp_avg_sq
    in place (or write the new ones ``into`` another three buffers, bitwise the same values, the old ones left as
    they were), and (optionally) write the new params as bf16/fp16 into ``out16``. ``pre_scale`` multiplies the
    gradient first, rounded to float32 on its own: a landed 16-bit gradient read as its accumulation would be.

    ``step`` counts from 1, as torch's optimizers do after incrementing. Scalars are computed here
    in double and rounded once, the way torch.optim.Adam passes Python floats to its kernels.

    The state may be held in fewer bytes (see [Note: state formats] in native/kernels.cpp): moments in bfloat16; the
    master in bfloat16 with ``master_lo`` (16+16, exact), rounded to nearest, or ``stochastic``ally.
    """
    _check_step(step, grad_scale)
    beta1, beta2 = hyper.betas
    bc1 = 1.0 - beta1 ** step if hyper.bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if hyper.bias_correction else 1.0
    native.adam_kernel(
        master, grad, exp_avg, exp_avg_sq, out16, grad_scale=grad_scale, pre_scale=pre_scale,
        decay=1.0 - hyper.lr * hyper.weight_decay if hyper.adamw_mode else 1.0,
        l2=0.0 if hyper.adamw_mode else hyper.weight_decay,
        one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2, bc2_sqrt=math.sqrt(bc2),
        eps=hyper.eps, step_size=hyper.lr / bc1, threads=threads, into=into, param_lo=master_lo,
        stochastic=stochastic)
