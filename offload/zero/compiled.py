"""Compiled units: the blocks ``torch.compile`` runs under the engine, and what dynamo made of them.

The engine compiles what torchtitan compiles under FSDP2: each unit's anchor modules (its
blocks), never the hooks between them, which gather and release outside the graphs (see
[Note: hooks outside compiled code] in zero/runtime.py). A block compiled by the user
before ``initialize`` is planned as one unit or inside one (zero/plan.py); ``engine.compile``
compiles the anchors the plan made. What dynamo did (graphs, graph breaks and their reasons,
graphs compiled after the first step) comes from its process-wide counters, read as
differences, so a run can say it and a test can check it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from offload.zero.plan import compiled

logger = logging.getLogger("offload.engine")


@dataclass(frozen=True)
class DynamoCounts:
    """Dynamo's counters at one moment (zero before anything was compiled in this process)."""

    graphs: int = 0
    breaks: tuple[tuple[str, int], ...] = ()  # (reason, count)

    @classmethod
    def now(cls) -> DynamoCounts:
        if "torch._dynamo" not in sys.modules:  # nothing was compiled: not imported for a count of zero
            return cls()
        from torch._dynamo.utils import counters
        return cls(int(counters["stats"]["unique_graphs"]), tuple(sorted(counters["graph_break"].items())))

    def since(self, earlier: DynamoCounts) -> DynamoCounts:
        before = dict(earlier.breaks)
        return DynamoCounts(self.graphs - earlier.graphs,
                            tuple((r, n - before.get(r, 0)) for r, n in self.breaks if n > before.get(r, 0)))

    @property
    def break_count(self) -> int:
        return sum(n for _, n in self.breaks)


@dataclass(frozen=True)
class CompileReport:
    """What dynamo did while the engine trained (the whole process's compiles, the user's own included)."""

    compiled: tuple[str, ...]  # the compiled modules the units run through
    graphs: int
    graph_breaks: int
    recompiles: int  # graphs made after the first step: a guard that failed on a step's own state
    reasons: tuple[str, ...]  # each graph break's reason in a line (``_reason``)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompileReport:
        return cls(tuple(d["compiled"]), d["graphs"], d["graph_breaks"], d["recompiles"], tuple(d["reasons"]))

    def as_dict(self) -> dict[str, Any]:
        return {"compiled": list(self.compiled), "graphs": self.graphs, "graph_breaks": self.graph_breaks,
                "recompiles": self.recompiles, "reasons": list(self.reasons)}

    def summary(self) -> str:
        head = (f"compiled: {len(self.compiled)} module(s) ({', '.join(map(_label, self.compiled[:3]))}"
                f"{' ...' if len(self.compiled) > 3 else ''}); {self.graphs} graph(s), {self.graph_breaks} graph "
                f"break(s), {self.recompiles} recompile(s) after the first step")
        return "\n".join([head] + [f"  graph break: {r}" for r in self.reasons])


class CompileWatch:
    """Dynamo's counters at the engine's start and after its first step, for the report."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._start = DynamoCounts.now()
        self._first_step: DynamoCounts | None = None

    def stepped(self) -> None:
        if self._first_step is None:
            self._first_step = DynamoCounts.now()

    def report(self) -> CompileReport:
        now = DynamoCounts.now()
        done = now.since(self._start)
        after = now.since(self._first_step).graphs if self._first_step is not None else 0
        return CompileReport(compiled_modules(self._model), done.graphs, done.break_count, after,
                             tuple(_reason(text) for text, _ in done.breaks))


def compiled_around_units(model: nn.Module, anchors: list[str]) -> list[str]:
    """The compiled modules that hold a unit's anchor inside them (the whole model, compiled whole): their graphs
    break at each unit's hooks, which stay outside."""
    return [c for c in compiled_modules(model) if any(_within(a, c) for a in anchors)]


def say_compiled_whole(model: nn.Module, anchors: list[str]) -> None:
    """A model compiled whole trains exactly, but its graph breaks at each unit: said once, with what to do."""
    around = compiled_around_units(model, anchors)
    if around:
        logger.warning("%s was compiled whole: its graph breaks at each of its units' gathers, which run outside "
                       "compiled code; for one graph per block compile the blocks instead (engine.compile(), or "
                       "block.compile() on each before offload.initialize)",
                       " and ".join(_label(n) for n in around))


def _label(name: str) -> str:
    return "the model" if not name else repr(name)


def _reason(text: str) -> str:
    """A graph break's reason in a line: dynamo's first line, and its explanation where it names more (the
    function it skipped, the construct it cannot trace)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    explained = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")),
                     "")
    return f"{lines[0]}: {explained}" if lines and explained else (lines[0] if lines else text)


def compiled_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of the compiled modules in ``model`` (the outermost ones)."""
    names = [name for name, module in model.named_modules() if compiled(module)]
    return tuple(n for n in names if not any(_within(n, o) for o in names))


def inside_compiled(model: nn.Module) -> set[str]:
    """The names of the modules strictly inside a compiled one: no hook of ours goes there (see [Note: hooks
    outside compiled code] in zero/runtime.py)."""
    roots = compiled_modules(model)
    return {name for name, _ in model.named_modules(remove_duplicate=False) if any(_within(name, r) for r in roots)}


def compile_anchors(model: nn.Module, anchors: list[str], backend: Any, options: dict[str, Any]) -> list[str]:
    """Compile each anchor module in place (``module.compile``, so hooks on it still fire around the compiled call).
    Left eager: the root (its forward holds the hooks of every unit), an anchor inside a compiled module, and torch's
    own layers (an embedding, a norm, a lone linear: one kernel each, nothing for a compiler to fuse; plain PyTorch's
    dynamo declines to trace them too). Returns the names compiled now."""
    by_name = dict(model.named_modules())
    roots, done = list(compiled_modules(model)), []  # roots: what is compiled so far (an anchor inside one is not)
    for name in dict.fromkeys(anchors):
        module = by_name.get(name)
        if (not name or module is None or compiled(module) or type(module).__module__.startswith("torch.")
                or any(_within(name, r) for r in roots)):
            continue
        module.compile(backend=backend, **options)
        done.append(name)
        roots.append(name)
    return done


def repeated_blocks(model: nn.Module) -> list[str]:
    """The modules a model repeats (the entries of a list of blocks of one class of its own, not torch's): what
    torchtitan and accelerate's regional compilation compile, one graph for all of them."""
    out: list[str] = []
    for name, module in model.named_modules():
        children = list(module.named_children())
        kinds = {type(child) for _, child in children}
        if (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) > 1 and len(kinds) == 1
                and not next(iter(kinds)).__module__.startswith("torch.")
                and not any(_within(name, o) for o in out)):
            out.extend(f"{name}.{child}" if name else child for child, _ in children)
    return out


def compile_blocks(model: nn.Module, backend: Any, options: dict[str, Any]) -> list[str]:
    """Compile the model's repeated blocks in place, before ``initialize``: each is then one unit (or inside one),
    so the units' hooks stay out of its graph."""
    by_name = dict(model.named_modules())
    names = repeated_blocks(model)
    for name in names:
        by_name[name].compile(backend=backend, **options)
    return names


def split_blocks(model: nn.Module, anchors: list[str]) -> list[str]:
    """The repeated blocks whose units are cut inside them (an anchor strictly inside): ``engine.compile`` cannot
    compile those whole, since the units' hooks would land in the graph."""
    return [b for b in repeated_blocks(model) if any(_within(a, b) for a in anchors)]


def _within(name: str, root: str) -> bool:
    """Whether module ``name`` is strictly inside module ``root`` ("" is the model itself)."""
    return name != root and (root == "" or name.startswith(f"{root}."))
