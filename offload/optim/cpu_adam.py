"""CPUAdam: a torch.optim.Optimizer over CPU fp32 params, running the native fused kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from offload.machine import prefetch as host_prefetch
from offload.machine.cpus import default_threads
from offload.optim.adam import AdamHyper, adam_step


class HostOptimizer(torch.optim.Optimizer):
    """A torch optimizer over CPU tensors whose update is one native pass a parameter: ``step`` runs the closure
    and hands each parameter with a gradient (dense, made contiguous) to ``_update``, with what ``_group`` read of its
    group first (Adam's hyperparameters, checked once a group). Shared by CPUAdam and the one-state optimizers
    (offload/optim/one_state.py)."""

    kind = ""  # the class's name in its errors

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            read = self._group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{self.kind} does not take sparse gradients")
                self._update(read, p, p.grad if p.grad.is_contiguous() else p.grad.contiguous())
        return loss

    def _group(self, group: dict[str, Any]) -> Any:
        return group

    def _update(self, read: Any, p: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError


class CPUAdam(HostOptimizer):
    """Adam/AdamW on CPU tensors; a drop-in for torch.optim.AdamW there and for DeepSpeedCPUAdam.

    State (``step``, ``exp_avg``, ``exp_avg_sq``) has torch's names and layout, so state dicts
    move between this and torch.optim.Adam/AdamW both ways; LR schedulers work through
    ``param_groups`` as usual. ``threads`` defaults to the machine's physical cores; ``prefetch`` (auto, on, off)
    as offload.host_prefetch (see [Note: prefetch by measurement] in offload/machine/prefetch.py).
    """

    kind = "CPUAdam"

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, bias_correction: bool = True, *, threads: int | None = None,
                 prefetch: str = "auto") -> None:
        # validates (betas of another length too: AdamHyper unpacks two)
        AdamHyper(lr=lr, betas=cast(tuple[float, float], tuple(betas)), eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        host_prefetch.choose(prefetch, threads or default_threads())
        self._check_params()

    def _check_params(self) -> None:
        """The params this steps in place: fp32, contiguous, on the CPU; a clear error naming the first that is not."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                if p.device.type != "cpu":
                    raise ValueError(f"CPUAdam updates CPU tensors; {where} is on {p.device}. Keep a CPU fp32 "
                                     "master copy, or use torch.optim.AdamW on the device")
                if p.dtype != torch.float32:
                    raise ValueError(f"CPUAdam needs float32 params (the master weights); {where} is {p.dtype}")
                if not p.is_contiguous():
                    raise ValueError(f"CPUAdam needs contiguous params; {where} is not")

    def _group(self, group: dict[str, Any]) -> AdamHyper:
        if group.get("amsgrad", False):
            raise ValueError("CPUAdam does not implement amsgrad (a loaded state dict asks for it)")
        if group.get("maximize", False):
            raise ValueError("CPUAdam does not implement maximize (a loaded state dict asks for it)")
        # A group loaded from torch's AdamW lacks our keys; torch's AdamW is decoupled and bias-corrected.
        return AdamHyper(lr=float(group["lr"]), betas=(float(group["betas"][0]), float(group["betas"][1])),
                         eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                         adamw_mode=bool(group.get("adamw_mode", group.get("decoupled_weight_decay", True))),
                         bias_correction=bool(group.get("bias_correction", True)))

    def _update(self, hyper: AdamHyper, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["step"] += 1
        adam_step(p, grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), hyper,
                  threads=self.threads)
