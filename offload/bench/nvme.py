"""`offload bench nvme`: sequential swap read/write GB/s of each engine (and fio), interleaved.

The disk under these machines drifts several-fold within an hour, so every contender
runs once per round, rounds repeat, and medians compare. Buffers are allocated and
touched once before timing (first touch costs 4-5x on a copy).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from offload.aio import AlignedBuffer, ChecksummedFile, SwapFile, make_engine, probe_io_uring


@dataclass
class NvmeRow:
    op: str
    impl: str
    block_size: int
    queue_depth: int
    file_bytes: int
    gb_per_s: float
    cpu_s_per_gb: float | None
    ratio_vs_best_other: float | None = None


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


CRC = " + crc32c"


def _baseline(name: str, results: dict[str, tuple[float, float | None]]) -> tuple[float, str] | None:
    """What a row is compared with: io_uring with the best of the others, a checksummed
    engine with the same engine without checksums; other rows are baselines themselves."""
    if name.endswith(CRC):
        return results[name.removesuffix(CRC)][0], "without checksums"
    if name == "io_uring":
        others = [gbs for n, (gbs, _) in results.items() if n != name and not n.endswith(CRC)]
        return (max(others), "best other") if others else None
    return None


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def run(directory: Path, size: int = 1 << 30, blocks: tuple[int, ...] = (1 << 20, 8 << 20),
        depths: tuple[int, ...] = (8, 32), rounds: int = 3, threads: int = 2, out: Path | None = None,
        stream: TextIO | None = None) -> list[NvmeRow]:
    def say(msg: str) -> None:
        if stream is not None:
            print(msg, file=stream, flush=True)

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "offload-bench-nvme.bin"
    buf = AlignedBuffer(size)
    buf.tensor.fill_(7)  # touch every page before timing
    engines = ["threads"] + (["io_uring"] if probe_io_uring(str(directory)).ok else [])
    rows: list[NvmeRow] = []
    say(f"offload bench nvme: {size / 2**30:.2f} GiB file in {directory}, engines {', '.join(engines)}"
        f"{', fio' if shutil.which('fio') else ' (fio not installed)'}, median of {rounds} interleaved rounds")
    try:
        with SwapFile.open(path) as f:
            os.posix_fallocate(f.fd, 0, size)
            for block in blocks:
                for depth in depths:
                    engines_here = {name: make_engine(name, block_size=block, queue_depth=depth, threads=threads)
                                    for name in engines}
                    best_engine = engines_here[engines[-1]]
                    checked = ChecksummedFile(best_engine, f)
                    contenders = {name: (lambda op, e=eng: getattr(e, op)(f, buf.tensor, 0, size))
                                  for name, eng in engines_here.items()}
                    # The same engine with CRC-32C on every block: the cost of never reading back wrong.
                    contenders[engines[-1] + CRC] = lambda op: getattr(checked, op)(buf.tensor, 0, size)
                    for op in ("write", "read"):
                        times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
                        fio: list[float] = []
                        for _ in range(rounds):
                            for name, start in contenders.items():
                                times[name].append(_timed(lambda s=start: s(op).wait()))
                            gbs = run_fio(path.with_suffix(".fio"), op, block, depth, size)
                            if gbs is not None:
                                fio.append(gbs)
                        results = {name: (size / statistics.median(t for t, _ in ts) / 1e9,
                                          statistics.median(c for _, c in ts) / (size / 1e9))
                                   for name, ts in times.items()}
                        if fio:
                            results["fio (io_uring, direct=1)"] = (statistics.median(fio), None)
                        for name, (gbs, cpu) in results.items():
                            base = _baseline(name, results)
                            ratio = gbs / base[0] if base else None
                            rows.append(NvmeRow(op, name, block, depth, size, gbs, cpu, ratio))
                            say(f"  {op:<5} bs {block >> 20:>2} MiB  qd {depth:>3}  {name:<26} {gbs:5.2f} GB/s"
                                + (f"  {cpu:5.3f} CPU s/GB" if cpu is not None else "")
                                + (f"  {ratio:4.2f}x {base[1]}" if base else ""))
                    checked.close()
                    for eng in engines_here.values():
                        eng.close()
    finally:
        path.unlink(missing_ok=True)
        path.with_suffix(".fio").unlink(missing_ok=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
        say(f"wrote {out}")
    return rows
