"""Lion and Adagrad on the host: the native one-state kernel (see [Note: one state] in native/kernels.cpp) and the
torch optimizers over CPU float32 params that run it, drop-ins for DeepSpeed's ``DeepSpeedCPULion`` and
``DeepSpeedCPUAdagrad`` (offload/ops/lion.py, offload/ops/adagrad.py) and, for Adagrad, for torch.optim.Adagrad.

State has the reference's names (Lion ``exp_avg``; Adagrad ``sum``, with ``step``), so state dicts move between
these and torch.optim.Adagrad both ways. What the engine's own step runs is Adam (its Lion and Adagrad are #70's
next slice)."""

from __future__ import annotations

import math
from typing import Any

import torch

from offload.machine import native
from offload.machine.cpus import default_threads
from offload.optim.adam import AdamHyper
from offload.optim.cpu_adam import HostOptimizer
from offload.store.state_format import StateSlot, mix_seed

# The AdamHyper.rule values this module's update runs, each with the state slot's buffer it keeps
# (offload/store/state_format.py): Lion's momentum, Adagrad's sum (DeepSpeed's CPU Adagrad names it exp_avg_sq).
ONE_STATE_HELD = {"lion": ("exp_avg",), "adagrad": ("exp_avg_sq",)}
ONE_STATE_RULES = tuple(ONE_STATE_HELD)


def _finite(name: str, value: float, ok: bool, rule: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        raise ValueError(f"invalid {name}: {value!r} ({rule})")


def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
              betas: tuple[float, float], weight_decay: float = 0.0, grad_scale: float = 1.0,
              out16: torch.Tensor | None = None, threads: int | None = None, master_lo: torch.Tensor | None = None,
              stochastic: native.Stochastic | None = None) -> None:
    """One Lion step in place: decoupled decay, then ``param -= lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m = beta2 * m + (1 - beta2) * g`` (the paper's Lion, in torch's fp32 order; DeepSpeed's CPU kernel rounds its
    constants to float first and so differs in the last places). The master and the momentum may be held as Adam's
    state is (``master_lo``, ``stochastic``: see ``adam_step``)."""
    native.one_state_kernel(param, grad, exp_avg, out16, rule=native.LION, grad_scale=grad_scale,
                            decay=1.0 - lr * weight_decay, lr=lr, beta1=betas[0], beta2=betas[1], threads=threads,
                            param_lo=master_lo, stochastic=stochastic)


def adagrad_step(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, step: int, *, lr: float,
                 eps: float = 1e-10, weight_decay: float = 0.0, lr_decay: float = 0.0, grad_scale: float = 1.0,
                 out16: torch.Tensor | None = None, threads: int | None = None,
                 master_lo: torch.Tensor | None = None, stochastic: native.Stochastic | None = None) -> None:
    """One Adagrad step in place, as torch.optim.Adagrad's: ``step`` counts from 1. Held as ``lion_step``'s."""
    native.one_state_kernel(param, grad, state_sum, out16, rule=native.ADAGRAD, grad_scale=grad_scale,
                            l2=weight_decay, lr=lr / (1 + (step - 1) * lr_decay), eps=eps, threads=threads,
                            param_lo=master_lo, stochastic=stochastic)


class _HostOptimizer(HostOptimizer):
    """What Lion and Adagrad share: CPU float32 contiguous params checked at the start, the threads."""

    def __init__(self, params: Any, defaults: dict[str, Any], threads: int | None) -> None:
        super().__init__(params, defaults)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads or default_threads()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(f"{self.kind} updates contiguous CPU float32 params (the master weights); "
                                     f"{where} is {p.dtype} on {p.device}")


class CPULion(_HostOptimizer):
    """Lion on CPU tensors (DeepSpeedCPULion's arguments)."""

    kind = "CPULion"

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, threads: int | None = None) -> None:
        _finite("lr", lr, lr >= 0, "lr >= 0")
        _finite("weight_decay", weight_decay, weight_decay >= 0, "weight_decay >= 0")
        for i, beta in enumerate(betas):
            _finite(f"betas[{i}]", beta, 0 <= beta < 1, "0 <= betas < 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), threads)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        lion_step(p, grad, state["exp_avg"], lr=float(group["lr"]), betas=tuple(group["betas"]),
                  weight_decay=float(group["weight_decay"]), threads=self.threads)


class CPUAdagrad(_HostOptimizer):
    """Adagrad on CPU tensors: torch.optim.Adagrad's update and state (DeepSpeedCPUAdagrad's arguments too)."""

    kind = "CPUAdagrad"

    def __init__(self, params: Any, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, threads: int | None = None) -> None:
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value)):
            _finite(name, value, value >= 0, f"{name} >= 0")
        _finite("eps", eps, eps >= 0, "eps >= 0")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                                      initial_accumulator_value=initial_accumulator_value), threads)
        for group in self.param_groups:  # as torch.optim.Adagrad: the state exists from the start
            for p in group["params"]:
                self.state[p]["step"] = torch.tensor(0.0)
                self.state[p]["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                                       memory_format=torch.contiguous_format)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
        if group.get("maximize", False) or group.get("foreach") or group.get("fused"):
            raise ValueError("CPUAdagrad runs its own kernel: maximize, foreach and fused are not taken (a loaded "
                             "state dict asks for them)")
        state = self.state[p]
        state["step"] += 1
        adagrad_step(p, grad, state["sum"], int(state["step"].item()), lr=float(group["lr"]), eps=float(group["eps"]),
                     weight_decay=float(group["weight_decay"]), lr_decay=float(group["lr_decay"]), threads=self.threads)


def one_state_step(slot: StateSlot, grad: torch.Tensor, step: int, hyper: AdamHyper, grad_scale: float,
                   out16: torch.Tensor | None, threads: int | None, stochastic: native.Stochastic | None,
                   on_device: bool) -> None:
    """One segment of a Lion or Adagrad step as the engine's update runs it (offload/optim/update.py), over the
    state slot's views of it: Lion's momentum is exp_avg, Adagrad's sum exp_avg_sq (the other buffer not held:
    ``ONE_STATE_HELD``). Host state runs the native kernel; state on a discrete device (a GPU) torch's ops, in the
    reference's order, widened to float32 and stored back as held (as ``device_adam_step_held``)."""
    state = slot.exp_avg if hyper.rule == "lion" else slot.exp_avg_sq
    if not on_device:
        if hyper.rule == "lion":
            lion_step(slot.master, grad, state, lr=hyper.lr, betas=hyper.betas, weight_decay=hyper.weight_decay,
                      grad_scale=grad_scale, out16=out16, threads=threads, master_lo=slot.master_lo,
                      stochastic=stochastic)
        else:
            adagrad_step(slot.master, grad, state, step, lr=hyper.lr, eps=hyper.eps,
                         weight_decay=hyper.weight_decay, grad_scale=grad_scale, out16=out16, threads=threads,
                         master_lo=slot.master_lo, stochastic=stochastic)
        return
    exact = slot.master.dtype == torch.float32 and state.dtype == torch.float32
    master, s = (slot.master, state) if exact else (slot.master_fp32(), state.float())
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if hyper.rule == "lion":
        beta1, beta2 = hyper.betas
        master.mul_(1 - hyper.lr * hyper.weight_decay)
        master.add_(s.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-hyper.lr)
        s.mul_(beta2).add_(g, alpha=1 - beta2)
    else:
        if hyper.weight_decay:
            g = g.add(master, alpha=hyper.weight_decay)
        s.addcmul_(g, g, value=1)
        master.addcdiv_(g, s.sqrt().add_(hyper.eps), value=-hyper.lr)
    if not exact:
        state.copy_(s)
        slot.set_master(master, None if stochastic is None else mix_seed(stochastic.seed, stochastic.index0))
    if out16 is not None:
        out16.copy_(slot.master)
