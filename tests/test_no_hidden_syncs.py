"""No hidden device syncs in the rooms a training step runs through (see [Note: sync ledger]).

A ``.item()``, ``float(tensor)``, ``.cpu()``, ``.tolist()`` or an event's ``synchronize()`` in a hook blocks the
thread that feeds the GPU, and on a CPU box costs nothing, so nothing else would catch it. In these rooms every
host-blocking wait goes through the accelerator (``accel.wait``, ``accel.drain``, ``accel.read_scalars``), which the
ledger counts; the few other calls are listed here with the reason they are not on the step's path.
"""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

HOT_ROOMS = ["offload/zero/runtime.py", "offload/zero/unit.py", "offload/optim/sharded.py",
             "offload/store/param_store.py", "offload/engine/core.py", "offload/prefetch.py"]
SYNCING_METHODS = {"item", "tolist", "cpu", "synchronize", "wait"}
LEDGER_CALLS = {"wait", "drain", "read_scalars"}  # on the accelerator: counted by the ledger

ALLOWED = {
    ("offload/zero/runtime.py", "ZeroRuntime._reduce", ".wait()"): "overlap_comm off: a collective's wait, a "
                                                                      "stream wait on NCCL",
    ("offload/zero/unit.py", "Unit.finish_unshard", ".wait()"): "an all-gather's wait, a stream wait on NCCL",
    ("offload/optim/sharded.py", "ShardedAdam.hyper", "float()"): "Python numbers from param_groups",
    ("offload/optim/sharded.py", "ShardedAdam.close", ".synchronize()"): "closing",
    ("offload/store/param_store.py", "ParamStore.add", ".cpu()"): "start-up",
    ("offload/store/param_store.py", "ParamStore.overwrite", ".cpu()"): "a checkpoint load or repair",
    ("offload/engine/core.py", "Engine.__init__", "int()"): "config values",
    ("offload/engine/core.py", "Engine.__init__", "float()"): "config values",
    ("offload/engine/core.py", "Engine._global_grad_sq_norm", "float()"): "a Python count",
    ("offload/engine/core.py", "Engine._global_grad_sq_norm", "int()"): "a Python float from read_scalars",
    ("offload/engine/core.py", "Engine.get_lr", "float()"): "Python numbers from param_groups",
}


def syncing_calls(path: str, root: pathlib.Path = REPO) -> set[tuple[str, str, str]]:
    """(room, enclosing qualname, call) for every call in ``path`` that may read a device tensor into the host."""
    tree = ast.parse((root / path).read_text())
    found: set[tuple[str, str, str]] = set()
    scope: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in SYNCING_METHODS:
                receiver = ast.unparse(f.value)
                if not (f.attr in LEDGER_CALLS and receiver.split(".")[-1] == "accel"):
                    found.add((path, ".".join(scope), f".{f.attr}()"))
            elif isinstance(f, ast.Name) and f.id in ("float", "int") and node.args \
                    and not isinstance(node.args[0], ast.Constant):
                found.add((path, ".".join(scope), f"{f.id}()"))
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def test_the_step_rooms_sync_only_through_the_ledger():
    found = set().union(*(syncing_calls(path) for path in HOT_ROOMS))
    new = sorted(found - set(ALLOWED))
    assert not new, "calls that may sync the device outside the ledger (go through accel.wait / accel.drain / " \
                    "accel.read_scalars, or allow-list one with its reason):\n" + "\n".join(map(str, new))
    stale = sorted(set(ALLOWED) - found)
    assert not stale, "allow-list entries that no longer match a call (remove them):\n" + "\n".join(map(str, stale))


def test_the_check_sees_a_hidden_sync(tmp_path):
    (tmp_path / "hot.py").write_text("class Hook:\n    def run(self, t):\n        self.accel.wait(t, 'ok')\n"
                                     "        return t.sum().item() + float(t.max())\n")
    assert syncing_calls("hot.py", tmp_path) == {("hot.py", "Hook.run", ".item()"), ("hot.py", "Hook.run", "float()")}
