"""The swap-file sweep that `offload bench nvme` and `offload tune-nvme` share.

One scratch file on the drive and one buffer, touched once before timing (first touch costs
4-5x on a copy). At each grid point (block size, queue depth) every contender runs once per
round, rounds repeat, and medians compare: the disk under these machines drifts several-fold
within an hour, so contenders measured at different times would not be comparable. fio, where
installed, runs in the same rounds as the ceiling.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from offload.aio import ChecksummedFile, IOEngine, SwapFile, make_engine, probe_io_uring
from offload.machine.buffers import AlignedBuffer

OPS = ("write", "read")
K = TypeVar("K", bound=Hashable)  # what names a contender


def engines_here(directory: Path) -> list[str]:
    """The engines that work on this drive, best last."""
    return ["threads"] + (["io_uring"] if probe_io_uring(str(directory)).ok else [])


@dataclass(frozen=True)
class Contender:
    engine: str  # a make_engine kind
    threads: int = 2  # the thread pool's threads (io_uring ignores it)
    checksums: bool = False  # through ChecksummedFile: CRC-32C of every block, verified on read


@dataclass
class Measured(Generic[K]):
    """One operation at one grid point: each contender's median GB/s and CPU seconds per GB."""
    block_size: int
    queue_depth: int
    op: str
    results: dict[K, tuple[float, float]]
    fio_gbs: float | None  # the median of fio's rounds; None without fio


def run_fio(path: Path, op: str, block: int, depth: int, size: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=offload", f"--filename={path}", f"--rw={op}", f"--bs={block}", f"--iodepth={depth}",
           "--ioengine=io_uring", "--direct=1", f"--size={size}", "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None
    job = json.loads(proc.stdout)["jobs"][0]
    return job["read" if op == "read" else "write"]["bw_bytes"] / 1e9


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def sweep_grid(path: Path, size: int, grid: Iterable[tuple[int, int]], contenders: dict[K, Contender],
               rounds: int, with_fio: bool = True) -> Iterator[Measured[K]]:
    """Every contender (and fio) ``rounds`` times, interleaved, for each op at each (block, depth) in ``grid``:
    a ``size``-byte transfer to or from the scratch file ``path``, which is removed afterwards."""
    buf = AlignedBuffer(size)
    buf.tensor.fill_(7)  # touch every page before timing
    fio_path = path.with_suffix(".fio")
    try:
        with SwapFile.open(path) as f:
            os.posix_fallocate(f.fd, 0, size)
            for block, depth in grid:
                with contextlib.ExitStack() as stack:
                    engines: dict[tuple[str, int], IOEngine] = {}
                    starts: dict[K, Callable[..., Callable[[], None]]] = {}  # op -> its call (engine bound)
                    for key, c in contenders.items():
                        if (c.engine, c.threads) not in engines:
                            engines[c.engine, c.threads] = stack.enter_context(
                                make_engine(c.engine, block_size=block, queue_depth=depth, threads=c.threads))
                        eng = engines[c.engine, c.threads]
                        if c.checksums:
                            checked = stack.enter_context(ChecksummedFile(eng, f))
                            starts[key] = lambda op, cf=checked: lambda: getattr(cf, op)(buf.tensor, 0, size).wait()
                        else:
                            starts[key] = lambda op, e=eng: lambda: getattr(e, op)(f, buf.tensor, 0, size).wait()
                    for op in OPS:
                        times: dict[K, list[tuple[float, float]]] = {key: [] for key in contenders}
                        fio: list[float] = []
                        for _ in range(rounds):
                            for key, start in starts.items():
                                times[key].append(_timed(start(op)))
                            gbs = run_fio(fio_path, op, block, depth, size) if with_fio else None
                            if gbs is not None:
                                fio.append(gbs)
                        results = {key: (size / statistics.median(t for t, _ in ts) / 1e9,
                                         statistics.median(c for _, c in ts) / (size / 1e9))
                                   for key, ts in times.items()}
                        yield Measured(block, depth, op, results, statistics.median(fio) if fio else None)
    finally:
        path.unlink(missing_ok=True)
        fio_path.unlink(missing_ok=True)
