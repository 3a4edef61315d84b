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

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from offload.zero.plan import compiled


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
    reasons: tuple[str, ...]  # each graph break's reason, its first line

    def as_dict(self) -> dict[str, Any]:
        return {"compiled": list(self.compiled), "graphs": self.graphs, "graph_breaks": self.graph_breaks,
                "recompiles": self.recompiles, "reasons": list(self.reasons)}

    def summary(self) -> str:
        head = (f"compiled: {len(self.compiled)} module(s) ({', '.join(self.compiled[:3])}"
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
                             tuple(reason.splitlines()[0] for reason, _ in done.breaks))


def compiled_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of the compiled modules in ``model`` (the outermost ones)."""
    names = [name for name, module in model.named_modules() if compiled(module)]
    return tuple(n for n in names if not any(n.startswith(f"{o}.") or (o == "" and n) for o in names if o != n))


def compile_anchors(model: nn.Module, anchors: list[str], backend: Any, options: dict[str, Any]) -> list[str]:
    """Compile each anchor module in place (``module.compile``, so hooks on it still fire around the compiled call).
    Left eager: the root (its forward holds the hooks of every unit), an anchor inside a compiled module, and torch's
    own layers (an embedding, a norm, a lone linear: one kernel each, nothing for a compiler to fuse; plain PyTorch's
    dynamo declines to trace them too). Returns the names compiled now."""
    by_name = dict(model.named_modules())
    done = []
    for name in dict.fromkeys(anchors):
        module = by_name.get(name)
        if (not name or module is None or compiled(module) or type(module).__module__.startswith("torch.")
                or _inside(name, compiled_modules(model))):
            continue
        module.compile(backend=backend, **options)
        done.append(name)
    return done


def _inside(name: str, roots: tuple[str, ...]) -> bool:
    return any(root == "" or name.startswith(f"{root}.") for root in roots)
