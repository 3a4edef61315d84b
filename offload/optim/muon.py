"""Muon's update, as torch.optim.Muon runs it on a whole matrix: its hyperparameters, the Newton-Schulz
orthogonalisation op for op, and the step size by shape. The engine runs it over sharded state in two passes (see
[Note: Muon over shards] in offload/optim/muon_pass.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
ADJUST_LR = ("original", "match_rms_adamw")


@dataclass(frozen=True, slots=True)
class MuonHyper:
    """One Muon param group's hyperparameters, in torch.optim.Muon's meaning."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str | None = None  # None: "original"
    rule: str = field(default="muon", init=False)

    def __post_init__(self) -> None:
        for name, value, ok in (("lr", self.lr, self.lr >= 0), ("weight_decay", self.weight_decay,
                                                                self.weight_decay >= 0),
                                ("momentum", self.momentum, 0 <= self.momentum < 1), ("eps", self.eps, self.eps > 0)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ValueError(f"invalid Muon {name}: {value!r} (lr >= 0, weight_decay >= 0, 0 <= momentum < 1, "
                                 "eps > 0)")
        if not 0 < self.ns_steps < 100:
            raise ValueError(f"Muon's ns_steps is 1 to 99, not {self.ns_steps!r}")
        if self.adjust_lr_fn not in (None, *ADJUST_LR):
            raise ValueError(f"Muon's adjust_lr_fn is one of {', '.join(ADJUST_LR)} (or None), not "
                             f"{self.adjust_lr_fn!r}")

    @classmethod
    def of(cls, group: dict[str, Any]) -> MuonHyper:
        """A param group's, as the step reads it now (an LR schedule changes ``lr``)."""
        return cls(lr=float(group["lr"]), weight_decay=float(group["weight_decay"]),
                   momentum=float(group["momentum"]), nesterov=bool(group["nesterov"]),
                   ns_coefficients=tuple(group["ns_coefficients"]), ns_steps=int(group["ns_steps"]),
                   eps=float(group["eps"]), adjust_lr_fn=group["adjust_lr_fn"])

    def scaled_lr(self, shape: tuple[int, ...]) -> float:
        """The step size of a matrix of ``shape``: torch's adjustment for its aspect, so that the orthogonalised
        update's RMS is alike across shapes."""
        rows, cols = shape[:2]
        if self.adjust_lr_fn == "match_rms_adamw":
            return self.lr * 0.2 * math.sqrt(max(rows, cols))
        return self.lr * math.sqrt(max(1, rows / cols))


def orthogonalized(update: torch.Tensor, hyper: MuonHyper) -> torch.Tensor:
    """The Newton-Schulz iteration torch.optim.Muon runs on a matrix (bf16, the wide orientation, normalised by
    its Frobenius norm first), op for op, so that the result is bitwise the reference's on the same device."""
    a, b, c = hyper.ns_coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=hyper.eps))
    for _ in range(hyper.ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
