"""Argument types for the command line: each checks its value where it is parsed, so a bad one is argparse's
one-line usage error (exit 2) naming the flag, never a traceback from deep inside the work."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """Decimal K/M/G/T (10M = 10**7 parameters) and binary Ki/Mi/Gi/Ti (1Gi = 2**30 bytes); ValueError if not."""
    text = text.strip()
    for suffix, mult in _UNITS.items():
        if text.endswith(suffix):
            number, unit = text[: -len(suffix)], mult
            break
    else:
        number, unit = text, 1
    value = float(number) * unit
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def _checked(convert: Callable[[str], float | int], ok: Callable[[float], bool], what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value  # type: ignore[return-value]
    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _checked(int, lambda v: v > 0, "a positive whole number")
non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
positive_size = _checked(parse_size, lambda v: v > 0, "a positive size (e.g. 8Mi, 1Gi, 10M)")
non_negative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def directory_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be a directory to write into (it, or the nearest part of it that exists, is a file or
    not writable), or None: it is one, or it can be created."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file" + ("" if probe == Path(path) else ", so the directory cannot be created there")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable, so nothing could be saved there"
    try:  # permissions can pass where no file can be made (/proc, a read-only mount, a full inode table)
        with tempfile.TemporaryFile(dir=probe, prefix=".offload-probe-"):
            pass
    except OSError as e:
        return f"no file can be created in {probe} ({e.strerror or e})"
    return None


def output_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be written at ``path`` (it is a directory, or its directory cannot be one to write into),
    or None."""
    target = Path(path)
    if target.is_dir():
        return f"{target} is a directory, not a file"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{target} exists and is not writable"
    return directory_problem(target.parent if str(target.parent) else Path("."))


def positive_sizes(text: str) -> list[int]:
    """A comma-separated list of positive sizes."""
    return [positive_size(part) for part in text.split(",")]


def positive_ints(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]
