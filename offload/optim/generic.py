"""Any elementwise torch.optim optimizer over sharded state: torch's own step, run on each parameter's piece.

[Note: a torch optimizer's own step] An optimizer whose update is elementwise gives a flat slice of a parameter what
it gives that slice as part of the whole, so each parameter's piece of a shard can be stepped by the optimizer's own
implementation (one piece per parameter, not per run of a group: torch's CPU kernels round a tensor's last, partial
vector otherwise than the rest, so a whole parameter, one rank's, rounds as the reference): a throwaway instance
over the master slice (an fp32 leaf), its gradient the widened, clipped one, and its per-parameter state the slot's
views. What torch keeps per parameter maps onto the slot: up to two tensors of the parameter's size (in the order
torch creates them: ``exp_avg``, then ``exp_avg_sq``), the ``step`` count (the engine's), and scalars alike for
every parameter of a group (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), kept in the group under ``SCALARS``
(so checkpoints hold them as plain numbers). On the first step the optimizer makes its own state, as it would (SGD's
momentum starts as the gradient, Rprop's step sizes at lr), and it is copied into the slot; later steps hand it the
slot's views. Every piece of a step reads the scalars as they were before the step (``_before``), so the order
pieces run in, and a retried step, change nothing.

What the probe at start-up finds decides: an optimizer torch lists as elementwise is taken; one that needs the
whole tensor (``WHOLE_TENSOR``) or holds more than two tensors a parameter is refused by name. The step runs
torch's single-tensor code (no foreach) in whichever schedule and lane the native kernels would (not the
speculative step: nothing writes a second slot): slower than the native kernels, and said so once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# torch.optim's optimizers whose update is elementwise (Adam, AdamW and Adagrad run offload's own kernels)
ELEMENTWISE = ("SGD", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "Adam", "AdamW",
               "Adagrad")
WHOLE_TENSOR = {"LBFGS": "it re-evaluates the loss through a closure and searches along a line over every "
                         "parameter at once",
                "SparseAdam": "it steps sparse gradients, which offload's shards never hold",
                "Adafactor": "it factors each matrix's second moment into row and column sums of the whole matrix",
                "Muon": "it orthogonalises each matrix whole: use the optimizer section's type \"Muon\", which "
                        "gathers them"}
SCALARS = "offload_scalars"  # a group's key for its scalar state (see the note)
NOT_HYPERPARAMETERS = ("foreach", "fused", "capturable", "differentiable")  # how torch runs, not what


@dataclass(frozen=True)
class Layout:
    """What the optimizer keeps per parameter under one group's hyperparameters: the tensors of the parameter's
    size (the slot's exp_avg, exp_avg_sq in this order), the scalars, and whether it counts steps."""

    tensors: tuple[str, ...]
    scalars: tuple[str, ...]
    counts: bool


def probe(cls: type[torch.optim.Optimizer], hyper: dict[str, Any], where: str) -> Layout:
    """Two steps of ``cls`` on a small parameter show its state; refused by name where the slot cannot hold it."""
    name = cls.__name__
    if name in WHOLE_TENSOR:
        raise ValueError(f"{where}: {name} is not stepped shard by shard here: {WHOLE_TENSOR[name]}")
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or name not in ELEMENTWISE:
        raise ValueError(f"{where}: {cls.__module__}.{name} is not one of torch.optim's elementwise optimizers "
                         f"({', '.join(ELEMENTWISE[:8])}), whose update offload can run on a slice of a parameter "
                         "exactly; pass one of those, or Adam/AdamW/Adagrad/Lion")
    param = torch.zeros(5, requires_grad=True)
    opt = cls([param], **hyper)
    for value in (1.0, -0.5):
        param.grad = torch.full((5,), value)
        opt.step()
    state = opt.state[param]
    tensors = tuple(k for k, v in state.items() if torch.is_tensor(v) and v.shape == param.shape)
    scalars = tuple(k for k, v in state.items() if k != "step" and k not in tensors)
    odd = [k for k in scalars if not (torch.is_tensor(state[k]) and state[k].numel() == 1)]
    if len(tensors) > 2 or odd:
        raise ValueError(f"{where}: {name} with these settings keeps {', '.join(state)} per parameter; offload's "
                         "slot holds two tensors of the parameter's size and scalars beside the master (amsgrad, "
                         "centered with momentum: leave them off)")
    return Layout(tensors, scalars, "step" in state)


@dataclass(frozen=True)
class GenericHyper:
    """One param group of a torch optimizer as the step reads it: the class and its hyperparameters now (an LR
    schedule changes them), the layout of its state, and the group itself, where its scalars are kept."""

    cls: type[torch.optim.Optimizer]
    values: dict[str, Any] = field(compare=False)
    layout: Layout
    group: dict[str, Any] = field(compare=False, repr=False)
    rule: str = field(default="torch", init=False)


def hyperparameters(group: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The keys of ``group`` the optimizer takes (``names``: its defaults'), without how torch runs them."""
    return {k: v for k, v in group.items() if k in names and k not in NOT_HYPERPARAMETERS}


class GenericStep:
    """Each segment of a step through a torch optimizer's own single-tensor code (see [Note: a torch optimizer's
    own step]); ``names``: the keys its constructor takes, ``layouts``: each param group's state, as probed."""

    def __init__(self, cls: type[torch.optim.Optimizer], names: tuple[str, ...], layouts: list[Layout]) -> None:
        self.cls, self.names, self.layouts = cls, names, layouts
        # per unit, each parameter's piece of this rank's shard (``shard_segments(..., per_param=True)``): torch's
        # kernels split a tensor into vectors from its start, so a piece that is the whole parameter (one rank)
        # rounds every element as the reference does
        self.pieces: dict[int, list[Any]] = {}
        self._step: int | None = None  # the step whose scalars ``_before`` holds
        self._before: dict[int, dict[str, float]] = {}

    def hyper(self, index: int, group: dict[str, Any]) -> GenericHyper:
        return GenericHyper(self.cls, hyperparameters(group, self.names), self.layouts[index], group)

    def segment(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad: torch.Tensor, step: int,
                hyper: GenericHyper, out16: torch.Tensor | None) -> None:
        """One segment's step: ``state`` the slot's (master, exp_avg, exp_avg_sq) views of it, ``grad`` fp32,
        clipped and unscaled; ``step`` counts from 1 (before it, the optimizer has no state)."""
        if self._step != step:  # the first segment of a step: the scalars as they were before it
            self._step, self._before = step, {}
        before = self._before.setdefault(id(hyper.group), dict(hyper.group.get(SCALARS, {})))
        master, *buffers = state
        param = master.detach()
        param.grad = grad
        opt = hyper.cls([param], **{**hyper.values, "foreach": False})  # torch's single-tensor code
        if step > 1:
            kept: dict[str, Any] = dict(zip(hyper.layout.tensors, buffers, strict=False))  # 0-2 of 2
            kept |= {k: torch.tensor(v, dtype=torch.float32) for k, v in before.items()}
            if hyper.layout.counts:
                kept["step"] = torch.tensor(float(step - 1), dtype=torch.float32)
            opt.state[param] = kept
        opt.step()
        made = opt.state[param]
        for key, buf in zip(hyper.layout.tensors, buffers, strict=False):
            if made[key].data_ptr() != buf.data_ptr():  # made by the optimizer (its first step), or replaced
                buf.copy_(made[key])
        if hyper.layout.scalars:
            hyper.group[SCALARS] = {k: float(made[k]) for k in hyper.layout.scalars}
        if out16 is not None:
            out16.copy_(master)
