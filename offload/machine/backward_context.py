"""[Note: the backward's context] The main thread keeps the context of its last backward, so that no gloo worker
releases it while Python finalizes.

torch's ``_engine_run_backward`` stashes a copy of the caller's ``contextvars`` context in the thread's native TLS
for the length of the backward and erases it after. Every collective issued inside the backward (DDP's bucketed
all-reduces, the engine's reduce-scatters) captures that TLS, so the gloo work holds a reference too. After the
backward the main thread has erased its own, and about four works in ten outlive that erase by some 0.1 ms (measured
on the AVX2 EPYC, 2 ranks): gloo's worker thread then drops the last reference, and the release takes the GIL. If a
loaded machine holds that thread off until the interpreter has begun to finalize, Python 3.11 ends it with
``pthread_exit``, the forced unwind meets a noexcept destructor and the rank aborts ("terminate called without an
active exception"): torch's guard there asks ``Py_IsInitialized`` where it needs ``Py_IsFinalizing`` too
(pytorch/pytorch#190489, #117762).

So on the main thread the erase is skipped: the context stays in the TLS until the next backward replaces it (with
the GIL held) or the process's TLS destructors run after finalization (where torch's guard leaks it, as it should).
The works of the last backward are then never the last holders. Other threads keep torch's behaviour, because a
thread that ends with a Python object in its TLS deadlocks (torch's own comment). What it costs: one context, a
snapshot of the context variables, held from one backward to the next. tools/exit_abort_stress.py (cases
ddp-minimal, ddp-minimal-held) shows the abort and its absence with each rank pinned to one core.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

_KEY = "context"  # the key _engine_run_backward stashes under
_ERASE: list[Callable[[str], None]] = []  # torch's own erase, once held


def _erase_off_the_main_thread(key: str) -> None:
    if key == _KEY and threading.current_thread() is threading.main_thread():
        return
    _ERASE[0](key)


def hold_on_main_thread() -> None:
    """Install the hold (idempotent); a torch without the stash has nothing to hold."""
    erase = getattr(torch._C, "_remove_obj_from_tls", None)
    if erase is None or _ERASE:
        return
    _ERASE.append(erase)
    torch._C._remove_obj_from_tls = _erase_off_the_main_thread


def held() -> bool:
    """Whether the hold is installed in this process."""
    return bool(_ERASE)
