"""A process that imports what a test module's cases need once and forks a fresh child (or W ranks) for each case.

TRL, transformers and datasets cost seconds of CPU to import, and the DeepSpeed switch (offload.as_deepspeed) must
never be installed in a pytest worker (other modules' tests import DeepSpeed's own, and transformers decides at its
import whether DeepSpeed exists). multiprocessing's forkserver is one per process and offload.machine.launch
already owns it, so these tests keep their own: a spawned server that imports the preload list, then forks per case.
Each case runs in a process of its own (no trainer or accelerate state leaks from one case into the next), and the
import is paid once per module.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import runpy
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# what torchrun sets beside the rank variables; Lightning and Fabric read TORCHELASTIC_RUN_ID as "launched from
# outside" and then start no processes of their own
_TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID")


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The rank variables torchrun gives rank ``rank`` of ``world`` on this host (the rendezvous on ``port``)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0"}


def _rank(fn: Callable[..., Any], rank: int, world: int, port: int, env: dict[str, str], kwargs: dict[str, Any],
          write: int) -> None:
    os.environ.update(env)
    os.environ.update(torchrun_env(rank, world, port))
    try:
        result: tuple[str, Any] = ("ok", fn(rank, world, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the test
        result = ("error", f"rank {rank} failed:\n{traceback.format_exc()}")
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - a result that does not pickle is the case's defect
        data = pickle.dumps(("error", f"rank {rank} returned what does not pickle:\n{traceback.format_exc()}"))
    with os.fdopen(write, "wb") as f:
        f.write(data)


@dataclass(frozen=True)
class Ran:
    """One rank's run of a script: its exit code (0; 1 for an exception; SystemExit's own) and its stdout and
    stderr together, as a test of a subprocess would read them."""

    code: int
    output: str


def succeeded(ran: list[Ran]) -> str:
    """Every rank's output, once each has exited 0 (else the failing rank's code and output's tail)."""
    for rank, one in enumerate(ran):
        assert one.code == 0, f"rank {rank} exited with {one.code}:\n{one.output[-8000:]}"
    return "".join(one.output for one in ran)


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit("message"): printed, exit status 1, as the interpreter does
    return 1


def _run_script(rank: int, world: int, path: str, argv: list[str], cwd: str, torchrun: bool) -> Ran:
    """``python path *argv`` in cwd, in this forked rank: with torchrun's variables and TORCHELASTIC_RUN_ID (as
    under torchrun), or without them (a plain ``python script.py``)."""
    if torchrun:
        os.environ["TORCHELASTIC_RUN_ID"] = "zygote"
    else:
        for name in _TORCHRUN:
            os.environ.pop(name, None)
    os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        faulthandler.enable()  # a rank that hangs or aborts prints every thread's stack into its output
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # noqa: BLE001 - the traceback goes to the output, as the interpreter's would
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        log.seek(0)
        return Ran(code, log.read().decode(errors="replace"))


def _serve(conn: Any, preload: list[str]) -> None:
    os.setsid()  # the test kills the whole group (server and children) on a timeout
    import importlib
    for name in preload:
        importlib.import_module(name)
    from offload.machine.launch import _free_port  # after the preload, which may need to come first (the switch)
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        fn, world, env, kwargs = task
        port = _free_port()
        children = []
        for rank in range(world):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                code = 0
                try:
                    _rank(fn, rank, world, port, env, kwargs, write)
                except BaseException:  # noqa: BLE001
                    code = 1
                finally:
                    os._exit(code)
            os.close(write)
            children.append((pid, read))
        results = []
        for rank, (pid, read) in enumerate(children):
            with os.fdopen(read, "rb") as f:
                data = f.read()
            _, status = os.waitpid(pid, 0)
            if data:
                results.append(pickle.loads(data))
            else:
                results.append(("error", f"rank {rank} died without a result (wait status {status})"))
        conn.send(("done", results))


class Zygote:
    """``run(fn, world)`` is ``[fn(rank, world, **kwargs) for rank in range(world)]``, each rank a process forked
    from a server that imported ``preload`` (in order) once; ranks get torchrun's environment variables."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, preload), daemon=True)
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            self._process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._receive(600.0, "importing " + ", ".join(preload))

    def _receive(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the zygote died while {what} (exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"no answer in {timeout:.0f}s while {what}")
        try:
            return self._conn.recv()[1]
        except EOFError:
            raise RuntimeError(f"the zygote died while {what} (exit code {self._process.exitcode})") from None

    def run(self, fn: Callable[..., Any], world: int = 1, timeout: float = 300.0, env: dict[str, str] | None = None,
            **kwargs: Any) -> list[Any]:
        self._conn.send((fn, world, dict(env or {}), kwargs))
        answers = self._receive(timeout, f"running {fn.__name__} on {world} rank(s)")
        errors = [value for status, value in answers if status != "ok"]
        if errors:
            raise RuntimeError("\n".join(errors))
        return [value for _, value in answers]

    def script(self, path: str | os.PathLike[str], *argv: str, world: int = 1, cwd: str | os.PathLike[str] = ".",
               timeout: float = 300.0, env: dict[str, str] | None = None, torchrun: bool | None = None) -> list[Ran]:
        """What ``python path *argv`` does, or ``torchrun --nproc-per-node world`` (``torchrun``: by default at
        several ranks), each rank forked from the imports already made: its exit code and output, one per rank."""
        return self.run(_run_script, world, timeout, env, path=str(path), argv=list(argv), cwd=str(cwd),
                        torchrun=world > 1 if torchrun is None else torchrun)

    def close(self) -> None:
        if self._process.is_alive() and self._process.pid is not None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._process.join(timeout=5)
