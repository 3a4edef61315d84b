"""`offload bench nvme`: sequential swap read/write GB/s of each engine (and fio), interleaved.

The sweep itself (interleaved rounds, medians, fio beside) is bench/sweep.py, shared with
`offload tune-nvme`; here each engine also runs with CRC-32C checksums, and each row is
compared with its baseline.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from offload.bench.sweep import Contender, engines_here, sweep_grid


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


def run(directory: Path, size: int = 1 << 30, blocks: tuple[int, ...] = (1 << 20, 8 << 20),
        depths: tuple[int, ...] = (8, 32), rounds: int = 3, threads: int = 2, out: Path | None = None,
        stream: TextIO | None = None) -> list[NvmeRow]:
    def say(msg: str) -> None:
        if stream is not None:
            print(msg, file=stream, flush=True)

    directory.mkdir(parents=True, exist_ok=True)
    engines = engines_here(directory)
    contenders = {name: Contender(name, threads) for name in engines}
    # The best engine with CRC-32C on every block: the cost of never reading back wrong.
    contenders[engines[-1] + CRC] = Contender(engines[-1], threads, checksums=True)
    rows: list[NvmeRow] = []
    file = f"{size / 2**30:.2f} GiB" if size >= 1 << 30 else f"{size / 2**20:.0f} MiB"
    say(f"offload bench nvme: {file} file in {directory}, engines {', '.join(engines)}"
        f"{', fio' if shutil.which('fio') else ' (fio not installed)'}, median of {rounds} interleaved rounds")
    grid = [(block, depth) for block in blocks for depth in depths]
    for m in sweep_grid(directory / "offload-bench-nvme.bin", size, grid, contenders, rounds):
        results: dict[str, tuple[float, float | None]] = dict(m.results)
        if m.fio_gbs is not None:
            results["fio (io_uring, direct=1)"] = (m.fio_gbs, None)
        for name, (gbs, cpu) in results.items():
            base = _baseline(name, results)
            ratio = gbs / base[0] if base else None
            rows.append(NvmeRow(m.op, name, m.block_size, m.queue_depth, size, gbs, cpu, ratio))
            say(f"  {m.op:<5} bs {m.block_size >> 20:>2} MiB  qd {m.queue_depth:>3}  {name:<26} {gbs:5.2f} GB/s"
                + (f"  {cpu:5.3f} CPU s/GB" if cpu is not None else "")
                + (f"  {ratio:4.2f}x {base[1]}" if base else ""))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
        say(f"wrote {out}")
    return rows
