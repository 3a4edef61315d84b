"""No hidden device syncs in the rooms a training step runs through (see [Note: sync ledger]).

A ``.item()``, ``float(tensor)``, ``.cpu()``, ``.tolist()`` or an event's ``synchronize()`` in a hook blocks the
thread that feeds the GPU, and on a CPU box costs nothing, so nothing else would catch it. In these rooms every
host-blocking wait goes through the accelerator (``accel.wait``, ``accel.drain``, ``accel.read_scalars``), which the
ledger counts, or comes right after a ``ledger.block(...)`` that names it (an I/O request's wait in the stores); the
few other calls are listed here with the reason they are not on the step's path.
"""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

HOT_ROOMS = ["offload/zero/runtime.py", "offload/zero/unit.py", "offload/optim/sharded.py",
             "offload/store/param_store.py", "offload/engine/core.py", "offload/zero/prefetch.py",
             "offload/store/optimizer_state.py", "offload/store/param_swap.py", "offload/checkpointing.py",
             "offload/optim/speculation_lane.py", "offload/optim/shard_state.py", "offload/optim/landing.py",
             "offload/optim/update.py", "offload/optim/speculation.py", "offload/optim/early_step.py",
             "offload/engine/agreement.py", "offload/engine/step_schedule.py", "offload/engine/accessors.py",
             "offload/engine/persistence.py", "offload/engine/life.py"]
SYNCING_METHODS = {"item", "tolist", "cpu", "synchronize", "wait"}
SYNCING_FUNCTIONS = {"wait_quietly"}  # offload/aio/base.py: an I/O request's wait
LEDGER_CALLS = {"wait", "drain", "read_scalars"}  # on the accelerator: counted by the ledger

ALLOWED = {
    ("offload/zero/runtime.py", "ZeroRuntime._reduce", ".wait()"): "overlap_comm off: a collective's wait, a "
                                                                      "stream wait on NCCL",
    ("offload/zero/unit.py", "Unit.finish_unshard", ".wait()"): "an all-gather's wait, a stream wait on NCCL",
    ("offload/zero/unit.py", "wait_in_flight", ".wait()"): "the process's exit, with gloo",
    ("offload/optim/sharded.py", "ShardedAdam.hyper", "float()"): "Python numbers from param_groups",
    ("offload/optim/sharded.py", "ShardedAdam.close", ".synchronize()"): "closing",
    ("offload/store/param_store.py", "ParamStore.add", ".cpu()"): "start-up",
    ("offload/store/param_store.py", "ParamStore.overwrite", ".cpu()"): "a checkpoint load or repair",
    ("offload/engine/core.py", "Engine.__init__", "int()"): "config values",
    ("offload/engine/core.py", "Engine.__init__", "float()"): "config values",
    ("offload/engine/agreement.py", "global_grad_sq_norm", "float()"): "a Python count",
    ("offload/engine/agreement.py", "global_grad_sq_norm", "int()"): "a Python float from read_scalars",
    ("offload/engine/step_schedule.py", "gated", "float()"): "start-up: a config value",
    ("offload/engine/accessors.py", "DeepSpeedAccessors.get_lr", "float()"): "Python numbers from param_groups",
    ("offload/store/optimizer_state.py", "OptimizerStateStore.init_member", ".wait()"): "start-up: a sub-group's "
                                                                                       "first write",
    ("offload/store/optimizer_state.py", "OptimizerStateStore.read_master", ".wait()"): "after a drain: a repair, "
        "whole weights, or a dropped NVMe speculation (zero_grad, a failed backward)",
    ("offload/store/optimizer_state.py", "OptimizerStateStore.one_at_a_time", ".wait()"): "checkpoints and whole "
                                                                                         "weights, after a drain",
    ("offload/store/optimizer_state.py", "NvmePass.abort", "wait_quietly()"): "a pass that failed",
    ("offload/store/optimizer_state.py", "NvmePass.settle", "wait_quietly()"): "a pass stopped early",
    ("offload/store/optimizer_state.py", "NvmePass._drop_reads", "wait_quietly()"): "reads of a pass stopped early "
    "or abandoned, before their buffers are reused",
    ("offload/store/param_swap.py", "ParamSwap.close", ".synchronize()"): "closing",
    ("offload/store/param_swap.py", "ParamSwap.close", "wait_quietly()"): "closing",
    ("offload/checkpointing.py", "ActivationStore.discard", ".synchronize()"): "only inputs of a forward whose "
        "backward never ran (a forward with grad outside training, a failed backward): a steady step has none",
    ("offload/checkpointing.py", "_Checkpoint.forward", ".synchronize()"): "activation_checkpointing."
        "synchronize_checkpoint_boundary: a sync the user asks for at each block (DeepSpeed's), off by default; "
        "Accelerator.synchronize counts it",
    ("offload/checkpointing.py", "_Checkpoint.backward", ".synchronize()"): "activation_checkpointing."
        "synchronize_checkpoint_boundary, as in forward",
}


def syncing_calls(path: str, root: pathlib.Path = REPO) -> set[tuple[str, str, str]]:
    """(room, enclosing qualname, call) for every call in ``path`` that may read a device tensor into the host."""
    tree = ast.parse((root / path).read_text())
    counted = _counted_calls(tree)
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
            if id(node) in counted:  # named to the ledger right before
                self.generic_visit(node)
                return
            if isinstance(f, ast.Attribute) and f.attr in SYNCING_METHODS:
                receiver = ast.unparse(f.value)
                if not (f.attr in LEDGER_CALLS and receiver.split(".")[-1] == "accel"):
                    found.add((path, ".".join(scope), f".{f.attr}()"))
            elif isinstance(f, ast.Name) and f.id in SYNCING_FUNCTIONS:
                found.add((path, ".".join(scope), f"{f.id}()"))
            elif isinstance(f, ast.Name) and f.id in ("float", "int") and node.args \
                    and not isinstance(node.args[0], ast.Constant):
                found.add((path, ".".join(scope), f"{f.id}()"))
            self.generic_visit(node)

    Visitor().visit(tree)
    return found


def _counted_calls(tree: ast.AST) -> set[int]:
    """ids of the calls in the statement right after a ``ledger.block(...)`` statement: the wait it counts."""
    counted: set[int] = set()
    for node in ast.walk(tree):
        for body in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            for before, stmt in zip(body, body[1:]):
                call = before.value if isinstance(before, ast.Expr) else None
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "block" \
                        and ast.unparse(call.func.value).split(".")[-1] == "ledger":
                    counted.update(id(n) for n in ast.walk(stmt) if isinstance(n, ast.Call))
    return counted


def test_the_step_rooms_sync_only_through_the_ledger():
    found = set().union(*(syncing_calls(path) for path in HOT_ROOMS))
    new = sorted(found - set(ALLOWED))
    assert not new, "calls that may sync the device outside the ledger (go through accel.wait / accel.drain / " \
                    "accel.read_scalars, or allow-list one with its reason):\n" + "\n".join(map(str, new))
    stale = sorted(set(ALLOWED) - found)
    assert not stale, "allow-list entries that no longer match a call (remove them):\n" + "\n".join(map(str, stale))


def test_the_check_sees_a_hidden_sync(tmp_path):
    (tmp_path / "hot.py").write_text("class Hook:\n    def run(self, t, request):\n        self.accel.wait(t, 'ok')\n"
                                     "        wait_quietly(request)\n"
                                     "        return t.sum().item() + float(t.max())\n")
    assert syncing_calls("hot.py", tmp_path) == {("hot.py", "Hook.run", ".item()"), ("hot.py", "Hook.run", "float()"),
                                                 ("hot.py", "Hook.run", "wait_quietly()")}


def test_a_wait_is_counted_only_by_the_ledger_block_right_before_it(tmp_path):
    """An I/O request's wait named to the ledger just before passes (also inside the statement that follows, a
    retry in its ``except``); one before the block, or one statement further on, does not."""
    (tmp_path / "io.py").write_text(
        "def before(self, r):\n    r.wait()\n    self.ledger.block('r')\n"
        "def further_on(self, r, w):\n    self.ledger.block('r')\n    r.wait()\n    w.wait()\n"
        "def right_after(self, r):\n    with self.span():\n        self.ledger.block('r')\n        try:\n"
        "            r.wait()\n        except OSError:\n            r.wait()\n")
    assert syncing_calls("io.py", tmp_path) == {("io.py", "before", ".wait()"), ("io.py", "further_on", ".wait()")}
