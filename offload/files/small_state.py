"""A rank's small state in a checkpoint, as plain data that loads without running code.

[Note: checkpoints run no code] Checkpoints travel: people download them and run
``offload inspect`` on one because they do not know what is in it. A pickle can name any
callable to run as it loads, and the checksums in meta.json guard against damage, not
against a writer (whoever writes a file can write its checksum). So everything offload
writes in ``rank<r>.pt`` is plain data (tensors, numbers, strings, bytes, None, lists,
tuples and dicts of them: the RNG states, numpy's as a tensor, the loss scale, the
schedule, the param groups, the buffers, the training record), written by ``torch.save``
and read only by torch's restricted unpickler (``weights_only=True``), which refuses any
other object before building it. ``client_state`` is the script's: a value that is not
plain data (an ``argparse.Namespace``, say) goes to ``client_state.pt``, named with its
type in meta.json, and is unpickled only when the caller says it trusts the checkpoint
(``load_checkpoint(..., trust_client_state=True)``). What this does not promise: a
checkpoint's weights can still be anything its writer chose.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.files.training_checkpoint import CheckpointError

PICKLED_CLIENT_STATE = "client_state.pt"  # the script's values that are not plain data (see the Note)
_LEAVES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def not_plain(obj: Any, where: str) -> Iterator[tuple[str, str]]:
    """(path, type) of each value under ``obj`` that the restricted unpickler would refuse."""
    if isinstance(obj, _LEAVES) or type(obj) in (torch.Tensor, torch.nn.Parameter, torch.Size):
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from not_plain(v, f"{where}[{i}]")
    elif type(obj) is dict:
        for k, v in obj.items():
            if not isinstance(k, _LEAVES):
                yield f"{where} (a key)", _type_name(k)
            yield from not_plain(v, f"{where}[{k!r}]")
    else:
        yield where, _type_name(obj)


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_plain(obj: Any, where: str, fix: str) -> None:
    """Refuse (at save, before anything is written) a value offload itself must store as plain data."""
    for path, kind in not_plain(obj, where):
        raise ValueError(f"{path} is a {kind}, which a checkpoint cannot hold without letting its loading run code; "
                         f"{fix}")


def split_client_state(client_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(plain values, the others, the others' types by key)."""
    plain, pickled, kinds = {}, {}, {}
    for key, value in client_state.items():
        found = next(not_plain(value, f"client_state[{key!r}]"), None)
        if found is None and isinstance(key, _LEAVES):
            plain[key] = value
        else:
            pickled[key], kinds[str(key)] = value, found[1] if found else _type_name(key)
    return plain, pickled, kinds


def numpy_state_plain(state: Any = None) -> dict[str, Any]:
    """numpy's global RNG state (or ``state``, its tuple) as plain data: the key array as a tensor."""
    full: Any = np.random.get_state() if state is None else state  # numpy's stubs type it as a union
    name, keys, pos, has_gauss, cached = full
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_state(state: Any) -> None:
    if isinstance(state, dict):
        state = (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                 state["cached_gaussian"])
    np.random.set_state(state)  # a format-1 checkpoint's tuple, read with numpy's arrays allowed


# What format-1 checkpoints hold besides plain data: numpy's RNG state, an array of uint32. Rebuilding an array
# runs no code of the file's choosing; torch's documentation lists these for exactly this.
_RECONSTRUCT = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
_NUMPY_ARRAYS: list[Any] = [(_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
                            (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),  # written by numpy 1
                            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read(path: Path) -> dict[str, Any]:
    """A rank's small state, by the restricted unpickler: an object it does not know stops the load, unbuilt."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAYS):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects that only an unrestricted unpickler can build, which would run code the file "
            f"chooses ({str(e).splitlines()[0] if str(e) else 'refused'}); offload loads checkpoints without running "
            "their code. If you trust where this checkpoint came from (one written by an offload before version "
            f"0.9, say), convert it on a trusted machine: offload convert-checkpoint {path.parent}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a rank's state")
    return state


def read_trusted(path: Path) -> Any:
    """Unpickle ``path`` as it is: only for a file the caller has said they trust (it can run code)."""
    return torch.load(path, weights_only=False, map_location="cpu")


def unsafe_content(path: Path, meta: dict[str, Any]) -> list[str]:
    """What in a checkpoint only an unrestricted unpickler could read, file by file (``offload inspect``)."""
    found = []
    for name in sorted(meta.get("files", {})):
        if name == PICKLED_CLIENT_STATE:
            kinds = meta.get("client_state_pickled", {})
            found.append(f"{name}: client_state values pickled as objects ("
                         + ", ".join(f"{k!r}: {v}" for k, v in kinds.items())
                         + "); loaded only with load_checkpoint(..., trust_client_state=True)")
        elif name.endswith(".pt"):
            try:
                read(path / name)
            except CheckpointError as e:
                found.append(f"{name}: {str(e.__cause__ or e).splitlines()[0]}")
    return found


def convert(path: Path) -> list[str]:
    """Rewrite an older (or foreign-written) checkpoint's small files as plain data, on a machine that trusts it:
    each is unpickled as it is (which can run its code), numpy's RNG state becomes a tensor, client_state values
    that are not plain data move to ``client_state.pt``; meta.json (last) gets the new checksums. Returns what
    changed, one line a file."""
    import json

    from offload.files.training_checkpoint import FORMAT, read_meta, save_small, verify, write_atomic
    meta = read_meta(path)
    verify(path, meta, sorted(meta["files"]))  # damage first: a damaged file is not converted
    done, pickled, kinds = [], {}, dict(meta.get("client_state_pickled", {}))
    for name in sorted(n for n in meta["files"] if n.endswith(".pt") and n != PICKLED_CLIENT_STATE):
        state = read_trusted(path / name)
        rng = state.get("rng", {})
        if "numpy" in rng and not isinstance(rng["numpy"], dict):
            rng["numpy"] = numpy_state_plain(rng["numpy"])
        if "client_state" in state:
            state["client_state"], moved, moved_kinds = split_client_state(state["client_state"])
            pickled.update(moved)
            kinds.update(moved_kinds)
        check_plain(state, name, "this checkpoint needs offload's own writer")
        tmp = path / f".{name}.convert"
        meta["files"][name] = save_small(tmp, state)
        tmp.replace(path / name)
        done.append(f"{name}: rewritten as plain data")
    if pickled:
        old = path / PICKLED_CLIENT_STATE
        if old.is_file():
            pickled = {**read_trusted(old), **pickled}
        tmp = path / f".{PICKLED_CLIENT_STATE}.convert"
        meta["files"][PICKLED_CLIENT_STATE] = save_small(tmp, pickled)
        tmp.replace(old)
        meta["client_state_pickled"] = kinds
        done.append(f"{PICKLED_CLIENT_STATE}: client_state {', '.join(map(repr, kinds))} kept pickled (loaded with "
                    "trust_client_state=True)")
    meta["format"] = FORMAT
    write_atomic(path / "meta.json", json.dumps(meta, indent=1).encode())
    return done
