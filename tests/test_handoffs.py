"""Hand-offs between rooms are named methods on named objects, not callables passed in or patched on.

A lambda or a bound method handed to a constructor of one of offload's classes, to a method of another object, or
stored on another object, is a call that climbs back up the layers unseen: a reader (or a tool following a value
through calls) loses the trail there. Each such hand-off takes an interface (a Protocol the receiving room names)
instead. Work handed to a lane that runs it in order (a stream, a host queue, the speculation lane, an I/O
submission: EXECUTORS) is the caller's own, run elsewhere, not a hand-off. The few left are listed in ALLOWED with
why; an entry that no longer exists fails, so the list only shrinks.
"""

from __future__ import annotations

import ast
import functools

from conftest import REPO

PACKAGE = REPO / "offload"

# (module, enclosing function, what receives the callable): each with why it stays.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("offload.zero.parameter_offload", "__init__", "module.ds_external_parameters"):
        "DeepSpeed's method on the root module, which TRL calls around generate; it answers from the module's own "
        "registered parameters and runs no work of offload's",
}

# Methods that run the caller's own work on a lane of theirs, in order: a callable handed to one is not a hand-off.
EXECUTORS = {
    "run": "a copy stream or host queue (offload/machine/accelerator.py) runs the caller's work in its order",
    "hand_over": "the speculation lane (offload/optim/speculation_lane.py) runs the speculation's own Adam",
    "submit": "an I/O request's completion work, run by the engine that reaps it (offload/aio/checksum.py)",
}


@functools.cache
def _sources() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return found


@functools.cache
def _classes_and_methods() -> tuple[frozenset[str], frozenset[str]]:
    """The names of offload's classes, and of the plain methods defined in any of them (a name that is also a
    property, a field or an attribute somewhere is left out: ``x.start`` may be data)."""
    classes, methods, data = set(), set(), set()
    for tree in _sources().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
                for f in node.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        plain = not any(_name(d) in ("property", "cached_property", "setter") for d in f.decorator_list)
                        (methods if plain else data).add(f.name)
                    elif isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
                        data.add(f.target.id)
                    elif isinstance(f, ast.Assign):
                        data |= {t.id for t in f.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute):
                            data.add(leaf.attr)
    return frozenset(classes), frozenset(methods - data)


def _callable_value(node: ast.AST) -> bool:
    """A lambda, or a method named without being called (a bound method), or either chosen by a condition."""
    _, methods = _classes_and_methods()
    if isinstance(node, ast.IfExp):
        return _callable_value(node.body) or _callable_value(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_callable_value(v) for v in node.values)
    return isinstance(node, ast.Lambda) or (isinstance(node, ast.Attribute) and node.attr in methods)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return type(node).__name__


def handoffs() -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, receiver, line) of each callable handed to an offload class, to a method of
    another object (not ``self``, not an executor), or to another object's attribute."""
    classes, methods = _classes_and_methods()
    out = []
    for module, tree in _sources().items():
        def visit(node: ast.AST, where: str, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
                if isinstance(child, ast.Call) and _name(child.func) in classes:
                    args = list(child.args) + [k.value for k in child.keywords]
                    if any(_callable_value(a) for a in args):
                        out.append((module, where, _name(child.func), child.lineno))
                elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                      and child.func.attr in methods and child.func.attr not in EXECUTORS
                      and not (isinstance(child.func.value, ast.Name) and child.func.value.id == "self")):
                    args = list(child.args) + [k.value for k in child.keywords]
                    if any(_callable_value(a) for a in args):
                        out.append((module, where, f"{_name(child.func.value)}.{child.func.attr}", child.lineno))
                if isinstance(child, ast.Assign) and _callable_value(child.value):
                    for target in child.targets:
                        if isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                                      and target.value.id == "self"):
                            out.append((module, where, f"{_name(target.value)}.{target.attr}", child.lineno))
                visit(child, inner)
        visit(tree, "<module>")
    return out


def test_the_check_sees_a_hand_off():
    tree = ast.parse("class Sink:\n    def take(self): ...\n\ndef f(other, sink, vote):\n    other.cb = sink.take\n"
                     "    Sink(after=lambda: None)\n    sink.take(vote.take if vote else None)\n"
                     "    sink.run(lambda: None)\n")
    _sources()["offload._probe"] = tree
    _classes_and_methods.cache_clear()
    try:
        found = {(w, r) for m, w, r, _ in handoffs() if m == "offload._probe"}
    finally:
        del _sources()["offload._probe"]
        _classes_and_methods.cache_clear()
    assert found == {("f", "other.cb"), ("f", "Sink"), ("f", "sink.take")}  # run: an executor


def test_no_callable_carries_a_hand_off_between_rooms():
    found = [h for h in handoffs() if h[:3] not in ALLOWED]
    assert found == [], ("callables handed to another room (give the receiver a Protocol and pass the object, or "
                         "add the place to ALLOWED with why):\n" + "\n".join(
                             f"{m.replace('.', '/')}.py:{line}: in {w}, to {r}" for m, w, r, line in found))


def test_allowed_hand_offs_still_exist():
    seen = {h[:3] for h in handoffs()}
    assert [k for k in ALLOWED if k not in seen] == [], "remove these from ALLOWED: they are gone"


MUTATORS = {"add", "clear", "discard", "append", "extend", "update", "pop", "remove", "insert"}


# Classes whose state only their own methods change: (module, class) -> the names their values go by elsewhere.
OWNERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("offload.zero.unit", "Unit"): ("unit", "other", "u"),
    ("offload.optim.shard_state", "ShardState"): ("state", "shard", "s", "st"),
}


def _fields(module: str, name: str) -> frozenset[str]:
    """The attributes class ``name`` of ``module`` gives itself: ``self.x = ...`` in its methods, and its
    dataclass fields."""
    tree = _sources()[module]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    own = {t.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    own |= {f.target.id for f in cls.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    return frozenset(own)


def _written(target: ast.AST, fields: frozenset[str], receivers: tuple[str, ...]) -> str | None:
    """``r.f`` (or deeper, ``r.f.g``: a record the owner holds) where ``r`` is a receiver and ``f`` a field."""
    chain = []
    while isinstance(target, ast.Attribute):
        chain.append(target.attr)
        target = target.value
    if chain and isinstance(target, ast.Name) and target.id in receivers and chain[-1] in fields:
        return ".".join([target.id, *reversed(chain)])
    return None


def owner_writes(module: str, name: str, receivers: tuple[str, ...]) -> list[str]:
    """Places outside ``module`` that assign or mutate a field of its class ``name`` (a value named as its values
    are)."""
    fields = _fields(module, name)
    found = []
    for other, tree in _sources().items():
        if other == module:
            continue
        for node in ast.walk(tree):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                targets = [node.func.value]
            for t in targets:
                for leaf in ast.walk(t) if isinstance(t, ast.Tuple) else [t]:
                    written = _written(leaf, fields, receivers)
                    if written is not None:
                        found.append(f"{other.replace('.', '/')}.py:{node.lineno}: {written}")
    return found


def test_the_write_check_sees_a_write():
    assert {"holders", "use", "grads_seen", "persistent"} <= _fields("offload.zero.unit", "Unit")
    assert {"phase", "events", "landed", "guessed"} <= _fields("offload.optim.shard_state", "ShardState")
    _sources()["offload._probe"] = ast.parse("def f(unit, state):\n    unit.holders += 1\n    unit.grads_seen.add(3)\n"
                                             "    state.events.free = None\n    state.landed, x = None, 1\n")
    try:
        assert owner_writes("offload.zero.unit", "Unit", ("unit",)) == [
            "offload/_probe.py:2: unit.holders", "offload/_probe.py:3: unit.grads_seen"]
        assert owner_writes("offload.optim.shard_state", "ShardState", ("state",)) == [
            "offload/_probe.py:4: state.events.free", "offload/_probe.py:5: state.landed"]
    finally:
        del _sources()["offload._probe"]


def test_units_and_shards_change_only_their_own_state():
    """A unit's life reads in zero/unit.py and a shard's phase in optim/shard_state.py: every other room calls
    their transitions."""
    for (module, name), receivers in OWNERS.items():
        assert owner_writes(module, name, receivers) == [], f"{name}'s fields written outside {module}"


# Constructors of more than seven parameters (self aside): a policy travels whole as a dataclass instead. Those
# left, with why; the list only shrinks.
WIDE_CONSTRUCTORS: dict[str, str] = {
    "offload.ops.adam.DeepSpeedCPUAdam": "DeepSpeed's public signature, keyword for keyword",
    "offload.ops.adam.FusedAdam": "DeepSpeed's public signature, keyword for keyword",
    "offload.optim.cpu_adam.CPUAdam": "torch.optim's AdamW signature, as a drop-in",
    "offload.zero.init.Init": "deepspeed.zero.Init's public signature",
}


def wide_constructors(limit: int = 7) -> set[str]:
    found = set()
    for module, tree in _sources().items():
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                for f in cls.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                        if len(f.args.args) - 1 + len(f.args.kwonlyargs) > limit:
                            found.add(f"{module}.{cls.name}")
    return found


def test_constructors_take_their_policies_whole():
    assert sorted(wide_constructors() - set(WIDE_CONSTRUCTORS)) == [], (
        "these constructors take more than seven parameters: group what travels together in a dataclass")
    assert sorted(set(WIDE_CONSTRUCTORS) - wide_constructors()) == [], "remove these from WIDE_CONSTRUCTORS"
