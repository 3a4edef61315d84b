"""Run a function on W local ranks (spawned processes joined in a gloo group) and collect what each returns.

For tests and benchmarks on one machine; real jobs launch with torchrun. A rank that
raises sends its traceback back; a rank that hangs (a collective mismatch) is killed
after ``timeout`` seconds, and the caller gets an error saying which ranks.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A rank failed or hung; the message carries its traceback, ``cause`` the first failed rank's exception
    itself where it crossed the process boundary (so a caller can tell a user's config error from a crash)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def _context() -> Any:
    """Ranks fork from a server that imported torch and offload once, instead of importing them each (seconds of
    CPU per rank); torch._dynamo too, which every torch.optim.Optimizer's constructor imports on its first call
    (800 modules, sympy among them: over a second a rank, half a two-rank test's time on a 2-core machine). The
    server imports and never computes, so no OpenMP team or thread exists to be lost in the fork;
    OFFLOAD_RANKS_START=spawn starts every rank from nothing."""
    if os.environ.get("OFFLOAD_RANKS_START", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "offload.engine"])
    return ctx


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, env: dict[str, str], threads: int, out: Any,
           kwargs: dict[str, Any]) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        # Plain pickle bytes: torch's queue reductions would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        out.put((rank, "ok", pickle.dumps(fn(rank, world, **kwargs))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", (traceback.format_exc(), _pickled(e))))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _pickled(error: BaseException) -> bytes | None:
    """The exception as bytes the parent can load, or None where it does not survive the round trip."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - an exception whose arguments do not rebuild it stays text only
        return None
    return data


def _unpickled(data: bytes | None) -> BaseException | None:
    """A rank's exception, where the parent can rebuild it (it may name a class only the child imported)."""
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - the traceback text still says what happened
        return None


def run_ranks(fn: Callable[..., Any], world: int, timeout: float = 180.0, env: dict[str, str] | None = None,
              threads: int = 1, **kwargs: Any) -> list[Any]:
    """``[fn(rank, world, **kwargs) for rank in range(world)]``, each in its own process with ``threads``
    intra-op threads; ``fn`` must be importable (a module-level function).

    Several ranks join a gloo group, whose collectives are CPU-only, so they run on the
    CPU with GPUs hidden from them; one rank alone keeps the machine's GPU.
    """
    env = dict(env or {})
    if world > 1:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    ctx = _context()
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, env, threads, out, kwargs), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    cause: BaseException | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, value = out.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead and out.empty():
                    time.sleep(0.5)  # a result put just before exiting may still be in the pipe
                    if out.empty():
                        errors.append("; ".join(f"rank {r} died without a result (exit code {code})"
                                                for r, code in dead))
                elif time.monotonic() > deadline:
                    errors.append(f"ranks {sorted(set(range(world)) - set(results))} gave no result in {timeout}s")
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                text, pickled = value
                errors.append(f"rank {rank} failed:\n{text}")
                cause = _unpickled(pickled) if cause is None else cause
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankError("\n".join(errors), cause)
    return [results[r] for r in range(world)]
