"""Cutting a module tree into units: groups of parameters gathered and released together.

A subtree whose (not yet claimed) parameters fit the byte target is one unit, anchored
at its root module, whose forward is when the unit is gathered. A larger subtree gives
its own direct parameters a unit anchored at itself and recurses into its children;
consecutive small children are packed into one unit up to the target, each of them an
anchor. A parameter shared by several modules (tied embeddings) belongs to the first
unit that reaches it; every other module that holds it directly "borrows" that unit,
so the unit is gathered around that module's forward too.

A run of small children that is tiny beside a unit (at most ``fold_below`` elements and a
sixteenth of the target: a LayerNorm between two large layers) is not a unit of its own:
it folds into the next unit made (its first anchors), or, at the end of its parent's
children, into the last unit its parent made (its last anchors). A unit costs hooks,
reductions, copies and an optimizer call per step whatever its size; the tiny ones were a
third of the units of a GPT cut at 4 MiB.

Some modules read their children's parameters in their own forward without calling
the children (``nn.MultiheadAttention`` reads ``out_proj.weight``; the fast path of
``nn.TransformerEncoderLayer`` reads every child's). Such a module is *atomic*: it is
never split, whatever its size. The defaults below cover torch's own; a Hugging Face
model's ``_no_split_modules`` (its block classes) are atomic too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ATOMIC_MODULES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer (element offsets)."""

    name: str  # the first qualified name it was reached by
    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class UnitPlan:
    index: int
    name: str
    slots: list[ParamSlot]
    anchors: list[str]  # module names whose forward gathers the unit
    borrowers: list[str] = field(default_factory=list)  # modules outside the anchors that hold one of its params

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def plan_units(model: nn.Module, unit_bytes: int, element_bytes: int,
               atomic: tuple[type[nn.Module] | str, ...] = (), fold_below: int = 0) -> list[UnitPlan]:
    """Units in module order; every parameter of ``model`` lands in exactly one.

    ``atomic`` adds modules that must not be split: classes, class names (bare or qualified by their module),
    module names in ``model``, or ``"*suffix"`` for the modules whose name ends so; runs of at most ``fold_below``
    elements (and a sixteenth of a unit) fold into a neighbouring unit (0: none do).
    """
    for name, p in model.named_parameters():
        if getattr(p, "ds_numel", p.numel()) != p.numel():  # see [Note: a released parameter] in zero/unit.py
            raise sharded_elsewhere(name)
    target = max(1, unit_bytes // element_bytes)  # in elements
    fold = min(fold_below, target // 16)
    words = {a for a in atomic if isinstance(a, str)} | set(getattr(model, "_no_split_modules", None) or ())
    suffixes = tuple(a[1:] for a in words if a.startswith("*"))
    atomic_types = ATOMIC_MODULES + tuple(a for a in atomic if isinstance(a, type))

    def is_atomic(module: nn.Module, name: str) -> bool:
        kind = type(module)
        return (isinstance(module, atomic_types) or kind.__name__ in words
                or f"{kind.__module__}.{kind.__qualname__}" in words or bool(name) and name in words
                or bool(suffixes) and name.endswith(suffixes) or compiled(module) and bool(name))
    claimed: set[int] = set()
    units: list[UnitPlan] = []
    held: tuple[list[str], list[tuple[str, nn.Parameter]]] = ([], [])  # a tiny run waiting for the next unit

    def unclaimed(module: nn.Module, prefix: str, recurse: bool) -> list[tuple[str, nn.Parameter]]:
        out, seen = [], set()
        for name, p in module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=False):
            if id(p) not in claimed and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def add(anchors: list[str], params: list[tuple[str, nn.Parameter]]) -> None:
        unique: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in params:  # a weight tied between siblings of one run is listed by each of them
            unique.setdefault(id(p), (name, p))
        if not unique:
            return
        if held[0]:  # a tiny run before this one folds into it (see the module docstring)
            anchors = held[0] + [a for a in anchors if a not in held[0]]
            unique = {**{id(p): (n, p) for n, p in held[1]}, **unique}
            held[0].clear()
            held[1].clear()
        slots, offset = [], 0
        for name, p in unique.values():
            claimed.add(id(p))
            slots.append(ParamSlot(name, p, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        label = anchors[0] if len(anchors) == 1 else f"{anchors[0]}..{anchors[-1]}"
        units.append(UnitPlan(len(units), label or "<root>", slots, list(anchors)))

    def add_run(anchors: list[str], params: list[tuple[str, nn.Parameter]], made_from: int, last: bool) -> None:
        """A run of small children: its own unit, or folded into a neighbour when tiny. ``made_from``: the first
        unit its parent made; ``last``: no sibling follows."""
        size = sum(p.numel() for _, p in params)
        if not anchors or not fold or size > fold or held[0]:
            add(anchors, params)
            return
        if last and len(units) > made_from:  # the parent's last unit takes it, as its last anchors: made again
            before = units.pop()
            add(before.anchors + anchors, [(s.name, s.param) for s in before.slots] + params)
            return
        if last:
            add(anchors, params)
            return
        held[0].extend(anchors)
        held[1].extend(params)

    def visit(module: nn.Module, name: str) -> None:
        params = unclaimed(module, name, recurse=True)
        if sum(p.numel() for _, p in params) <= target or is_atomic(module, name):
            add([name], params)
            return
        made_from = len(units)
        add([name], unclaimed(module, name, recurse=False))
        run: list[str] = []
        run_params: list[tuple[str, nn.Parameter]] = []
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            child_params = unclaimed(child, full, recurse=True)
            size = sum(p.numel() for _, p in child_params)
            if size == 0:
                continue
            alone = size > target or is_atomic(child, full) and size > target // 2
            if alone or sum(p.numel() for _, p in run_params) + size > target:
                add_run(run, run_params, made_from, last=False)
                run, run_params = [], []
            if alone:
                visit(child, full)
            else:
                run.append(full)
                run_params.extend(child_params)
        add_run(run, run_params, made_from, last=True)

    visit(model, "")
    if held[0]:  # nothing came after it
        anchors, params = list(held[0]), list(held[1])
        held[0].clear()
        held[1].clear()
        add(anchors, params)
    _find_borrowers(model, units)
    return units


def compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code (``module.compile()``, or the wrapper ``torch.compile``
    returns). A compiled module below the root is atomic: a unit inside it would put our hooks in its graph (see
    [Note: hooks outside compiled code] in zero/runtime.py)."""
    return getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule"


def sharded_elsewhere(name: str) -> ValueError:
    """A parameter whose values an engine's shards hold, not the parameter: its model cannot start another."""
    return ValueError(f"parameter {name!r} has no memory of its own: it is sharded by an offload engine (open or "
                      "closed). Build a fresh model and load engine.full_state_dict() into it to start another engine")


ENGINE = "_offload_engine"  # a sharded parameter's weak reference to its engine (set by the engine)


def engine_of(param: torch.Tensor) -> Any:
    """The engine that shards ``param``, while it exists (None: no engine's, or one that is gone)."""
    ref = getattr(param, ENGINE, None)
    return ref() if ref is not None else None


EXTERNAL = "_offload_external_params"  # a module's registered external parameters, by id


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's ``zero.register_external_parameter``: ``module``'s forward reads ``parameter``, which another
    module owns, without calling that module (``F.linear(x, self.child.weight)``). Its unit is then gathered around
    ``module``'s forward too, as it is for a weight tied into the module. Call it before ``offload.initialize``
    (in the module's ``__init__``), where the units are planned."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter takes an nn.Parameter, got {type(parameter).__name__}")
    if hasattr(parameter, "ds_shape"):
        raise ValueError("register_external_parameter after offload.initialize: the units are planned by then; call "
                         "it before (in the module's __init__), or name the reading module's class in "
                         "offload.atomic_modules")
    module.__dict__.setdefault(EXTERNAL, {})[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    module.__dict__.get(EXTERNAL, {}).pop(id(parameter), None)


def _find_borrowers(model: nn.Module, units: list[UnitPlan]) -> None:
    owner = {id(s.param): u for u in units for s in u.slots}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        held = [p for _, p in module.named_parameters(recurse=False)]
        for p in held + list(module.__dict__.get(EXTERNAL, {}).values()):
            unit = owner.get(id(p))
            if unit is None:
                raise ValueError(f"module {mod_name or '<root>'!r} registered an external parameter that is not "
                                 "in the model given to offload.initialize")
            inside = any(a == "" or mod_name == a or mod_name.startswith(a + ".") for a in unit.anchors)
            if not inside and mod_name not in unit.borrowers:
                unit.borrowers.append(mod_name)
