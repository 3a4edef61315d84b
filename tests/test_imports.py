"""The import direction of offload's rooms, read from the source with ast (nothing is imported).

Every ``import`` and ``from ... import`` counts, wherever it stands (a function body, a
TYPE_CHECKING block): a lazy import is still a dependency. A module is a node; a package is
the node of its ``__init__``, which imports what its ``__init__`` imports. Importing
``offload.a.b`` from outside ``offload.a`` also runs ``offload/a/__init__.py``, so it counts as
importing the package ``offload.a`` as well (a room is only a leaf if importing it pulls in
nothing above it). The top package ``offload`` is already being imported whenever any of its
modules is, so only a written ``import offload`` / ``from offload import <name>`` counts as
importing it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "offload"

# Compiled from native/ by the package build; imports no Python module.
EXTENSIONS = {"offload._native"}

# Rooms (a module, or a package with everything in it) from the lowest layer to the highest. A module may import
# its own layer or lower, never higher; a module in no room fails test_every_module_has_a_room (give it one).
LAYERS: list[tuple[str, ...]] = [
    # leaves: nothing from offload above them
    ("offload.observe", "offload.config", "offload.models", "offload.version", "offload.comm",
     "offload.zero.collectives", "offload.zero.plan", "offload.zero.prefetch", "offload.store.budget",
     "offload.store.tier"),
    ("offload.machine",),  # buffers, CPUs, the compiled kernels, local ranks, and the accelerator over them
    ("offload.aio",),
    ("offload.store",),
    ("offload.optim",),
    ("offload.zero",),
    # activation checkpointing; the files of weights and checkpoints; DeepSpeed's optimizer names over optim
    ("offload.checkpointing", "offload.files", "offload.ops"),
    # "offload" is the package's __init__ only: the public API over the engine; utils, DeepSpeed's helpers over it
    ("offload.engine", "offload", "offload.utils", "offload.runtime"),
    ("offload.hf", "offload.accelerate", "offload.lightning"),
    # offload standing in for DeepSpeed (the finder, its module table, `offload launch`) and the one-line switch
    ("offload.stand_in", "offload.as_deepspeed"),
    ("offload.bench",),
    ("offload.commands", "offload.__main__"),  # the command line and its jobs (train uses estimate and demo)
]
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}

# (importer, imported as written): edges allowed against the rules until they are removed. Remove an entry with
# its import; test_known_exceptions_still_exist fails on one that no longer exists, so the list only shrinks.
KNOWN: set[tuple[str, str]] = set()  # edges that break the rules, each with why and how it goes; none now

ENGINE_AND_ABOVE = ("offload.engine", "offload.commands", "offload.bench")


def _in(module: str, room: str) -> bool:
    """Whether ``module`` is ``room`` or inside it (the top package "offload" holds only itself here)."""
    return module == room or (room != "offload" and module.startswith(room + "."))


def room_of(module: str) -> str | None:
    rooms = [room for room in LAYER if _in(module, room)]
    return max(rooms, key=len) if rooms else None


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _module_named(name: str) -> str | None:
    """The module or package ``name`` is, or lies in (``offload.aio.IOEngine`` -> ``offload.aio``)."""
    while name and name not in modules() and name not in EXTENSIONS:
        name = name.rpartition(".")[0]
    return name or None


def written_imports(module: str) -> dict[str, int]:
    """offload's modules that ``module`` imports, each with the first line that does."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` imports the module a.b where there is one, else a name from a.
            names = [f"{base}.{alias.name}" if _module_named(f"{base}.{alias.name}") == f"{base}.{alias.name}"
                     else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "offload":
                continue
            target = _module_named(name)
            if target is not None and target != module and target not in EXTENSIONS:
                targets.setdefault(target, node.lineno)
    return targets


@functools.cache
def edges() -> list[tuple[str, str, str, int]]:
    """(importer, imported, imported as written, line): each written import, and each package it runs."""
    out = []
    for module in modules():
        for written, line in written_imports(module).items():
            out.append((module, written, written, line))
            parts = written.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in modules() and not _in(module, package):
                    out.append((module, package, written, line))
    return out


def _where(importer: str, imported: str, written: str, line: int) -> str:
    path = modules()[importer].relative_to(REPO)
    via = "" if written == imported else f" (importing {written} runs {imported.replace('.', '/')}/__init__.py)"
    return f"{path}:{line}: {importer} imports {imported}{via}"


def _checked_edges() -> list[tuple[str, str, str, int]]:
    return [e for e in edges() if (e[0], e[2]) not in KNOWN]


def test_every_module_has_a_room():
    assert [m for m in modules() if room_of(m) is None] == [], "add these modules to a room in LAYERS"


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for importer, imported, _, _ in _checked_edges():
        graph[importer].add(imported)
    # Tarjan's strongly connected components: any with two or more modules holds a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    problems = []
    for component in components:
        inside = set(component)
        problems.append(" <-> ".join(component) + ":\n    " + "\n    ".join(
            _where(*e) for e in _checked_edges() if e[0] in inside and e[1] in inside))
    assert problems == [], "import cycles among offload's modules:\n" + "\n".join(problems)


def test_each_room_imports_only_its_layer_or_below():
    problems = []
    for importer, imported, written, line in _checked_edges():
        low, high = room_of(importer), room_of(imported)
        if low is not None and high is not None and LAYER[high] > LAYER[low]:
            problems.append(f"{_where(importer, imported, written, line)}: room {high} (layer {LAYER[high]}) is "
                            f"above room {low} (layer {LAYER[low]})")
    assert problems == [], "imports against the layers (tests/test_imports.py LAYERS):\n" + "\n".join(problems)


def test_optim_never_imports_zero():
    problems = [_where(*e) for e in _checked_edges() if _in(e[0], "offload.optim") and _in(e[1], "offload.zero")]
    assert problems == [], "the optimizer must not know the ZeRO runtime:\n" + "\n".join(problems)


def test_nothing_below_the_engine_imports_the_engine_or_what_drives_it():
    engine = LAYER["offload.engine"]
    problems = [_where(*e) for e in _checked_edges() if LAYER[room_of(e[0])] < engine
                and (e[1] == "offload" or any(_in(e[1], top) for top in ENGINE_AND_ABOVE))]
    assert problems == [], ("below the engine, nothing imports offload (the package), offload.engine, "
                            "offload.commands or offload.bench:\n" + "\n".join(problems))


def test_known_exceptions_still_exist():
    written = {(importer, w) for importer, _, w, _ in edges()}
    assert set(KNOWN) - written == set(), "these imports are gone: remove them from KNOWN in tests/test_imports.py"


def test_the_installed_version_is_the_packages_own():
    """pyproject.toml reads the version from offload/version.py at build time: one owner, never two that drift."""
    import importlib.metadata

    import offload
    assert importlib.metadata.version("offload") == offload.__version__


def test_the_engine_package_names_each_of_its_modules():
    """A reader starts at offload/engine/__init__.py: its docstring names every room of the package."""
    listing = ast.get_docstring(ast.parse(modules()["offload.engine"].read_text())) or ""
    unnamed = [m for m, path in modules().items() if _in(m, "offload.engine") and m != "offload.engine"
               and path.name not in listing]
    assert unnamed == [], "offload/engine/__init__.py's docstring does not name these modules"


# The start-up plan and the arithmetic it decides with: pure functions of sizes and the config, importing no store
# (no file, no buffer pool, no I/O) so that the planner sits beside what it configures, not above it.
PURE_PLAN = ("offload.store.placement", "offload.store.sub_groups", "offload.store.param_homes", "offload.store.slots",
             "offload.store.step_cost", "offload.store.state_format", "offload.store.budget", "offload.store.tier")
# the config's errors, and round_up (offload/machine/__init__.py imports nothing)
PLAN_MAY_IMPORT = ("offload.config", "offload.machine.buffers")


def test_the_plan_imports_no_store():
    problems = [_where(*e) for e in edges() if e[0] in PURE_PLAN and e[1] not in ("offload.store", "offload.machine")
                and e[1] not in PURE_PLAN and not any(_in(e[1], ok) for ok in PLAN_MAY_IMPORT)]
    assert problems == [], "the plan imports only its formulas (tests/test_imports.py PURE_PLAN):\n" + "\n".join(
        problems)
