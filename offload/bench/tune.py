"""`offload tune-nvme`: sweep the swap path, print a table, write the best settings as a config fragment.

The sweep is bench/sweep.py, shared with `offload bench nvme`: every engine and thread count
runs once per round at a grid point before the next point (interleaved), because the disk's
speed drifts several-fold within an hour. The fragment (aio + offload.aio_engine) loads into
a config unchanged: ``Config.load({**ds_config, **fragment})``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from offload.bench.sweep import Contender, engines_here, sweep_grid

QUICK: dict[str, Any] = dict(blocks=(1 << 20, 8 << 20), depths=(8, 32), threads=(2,), size=256 << 20, rounds=1)
FULL: dict[str, Any] = dict(blocks=(256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20), depths=(4, 8, 16, 32, 64),
                            threads=(1, 2, 4), size=1 << 30, rounds=2)


@dataclass
class Cell:
    engine: str
    block_size: int
    queue_depth: int
    threads: int
    read_gbs: float
    write_gbs: float
    fio_read_gbs: float | None = None
    fio_write_gbs: float | None = None

    @property
    def score(self) -> float:
        """Harmonic mean of read and write: a setting must be good both ways."""
        return 2 / (1 / self.read_gbs + 1 / self.write_gbs)


def _progress(done: int, total: int, label: str, stream: TextIO) -> None:
    """A bar redrawn in place on a terminal; in a log file, a line per tenth of the sweep (no carriage returns)."""
    width = 30
    filled = width * done // total
    text = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}"
    if getattr(stream, "isatty", lambda: False)():
        stream.write("\r" + text + ("\n" if done == total else ""))
    elif done == total or done * 10 // total != (done - 1) * 10 // total:
        stream.write(text.rstrip() + "\n")
    stream.flush()


def sweep(path: Path, quick: bool = False, size: int | None = None, with_fio: bool = True,
          stream: TextIO = sys.stderr) -> list[Cell]:
    grid = QUICK if quick else FULL
    size = size or grid["size"]
    # Each cell moves the whole file in blocks of its size: a file below the largest block times no transfer there.
    least = max(grid["blocks"])
    if size < least:
        raise ValueError(f"a {size:,}-byte file is smaller than this grid's largest block ({least >> 20} MiB): its "
                         f"cells would time no transfer; give --file-size {least >> 20}Mi or more (the default, "
                         f"{grid['size'] >> 20} MiB, keeps every depth busy)")
    points = [(b, d) for b in grid["blocks"] for d in grid["depths"]]
    contenders = {(e, t): Contender(e, t) for e in engines_here(path)
                  for t in (grid["threads"] if e == "threads" else (1,))}
    total = len(points) * len(contenders)
    cells: list[Cell] = []
    written: dict[tuple[str, int], tuple[float, float]] = {}
    fio_write: float | None = None
    done = 0
    for m in sweep_grid(path / "offload-tune-nvme.bin", size, points, contenders, grid["rounds"], with_fio=with_fio):
        if m.op == "write":  # each point's write comes before its read
            written, fio_write = m.results, m.fio_gbs
            continue
        for (engine, threads), (read_gbs, _) in m.results.items():
            cells.append(Cell(engine, m.block_size, m.queue_depth, threads, read_gbs, written[engine, threads][0],
                              m.fio_gbs, fio_write))
            done += 1
            _progress(done, total, f"{engine} bs {m.block_size >> 10} KiB qd {m.queue_depth} t {threads}", stream)
    return cells


def best(cells: list[Cell]) -> Cell:
    return max(cells, key=lambda c: c.score)


def fragment(cell: Cell) -> dict[str, Any]:
    """The config fragment the runtime loads unchanged."""
    return {
        "aio": {"block_size": cell.block_size, "queue_depth": cell.queue_depth,
                "intra_op_parallelism": cell.threads, "single_submit": False, "overlap_events": True},
        "offload": {"aio_engine": cell.engine},
    }


def table(cells: list[Cell]) -> str:
    lines = [f"{'engine':<9} {'block':>8} {'depth':>5} {'thr':>3} {'read GB/s':>9} {'write GB/s':>10} "
             f"{'read/fio':>8} {'write/fio':>9}"]
    for c in sorted(cells, key=lambda c: (c.engine, c.block_size, c.queue_depth, c.threads)):
        rf = f"{c.read_gbs / c.fio_read_gbs:8.2f}" if c.fio_read_gbs else f"{'-':>8}"
        wf = f"{c.write_gbs / c.fio_write_gbs:9.2f}" if c.fio_write_gbs else f"{'-':>9}"
        lines.append(f"{c.engine:<9} {c.block_size >> 10:>6}Ki {c.queue_depth:>5} {c.threads:>3} "
                     f"{c.read_gbs:9.2f} {c.write_gbs:10.2f} {rf} {wf}")
    return "\n".join(lines)


def heatmap(cells: list[Cell], out: Path) -> None:
    """GB/s over block size x queue depth, one panel per engine and direction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    engines = sorted({c.engine for c in cells})
    blocks = sorted({c.block_size for c in cells})
    depths = sorted({c.queue_depth for c in cells})
    fig, axes = plt.subplots(len(engines), 2, figsize=(10, 3.6 * len(engines)), squeeze=False)
    vmax = max(max(c.read_gbs, c.write_gbs) for c in cells)
    for row, engine in enumerate(engines):
        for col, op in enumerate(("read", "write")):
            grid = np.zeros((len(blocks), len(depths)))
            for c in cells:
                if c.engine == engine:
                    value = c.read_gbs if op == "read" else c.write_gbs
                    i, j = blocks.index(c.block_size), depths.index(c.queue_depth)
                    grid[i, j] = max(grid[i, j], value)  # best thread count for the pool
            ax = axes[row][col]
            im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=vmax, origin="lower", aspect="auto")
            for i in range(len(blocks)):
                for j in range(len(depths)):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=9,
                            color="black" if grid[i, j] > 0.6 * vmax else "white")
            ax.set_xticks(range(len(depths)), [str(d) for d in depths])
            ax.set_yticks(range(len(blocks)), [f"{b >> 10} KiB" for b in blocks])
            ax.set_xlabel("queue depth")
            ax.set_ylabel("block size")
            ax.set_title(f"{engine} {op} GB/s")
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run(path: Path, out_dir: Path, quick: bool = False, size: int | None = None, with_fio: bool = True,
        stream: TextIO = sys.stdout) -> dict[str, Any]:
    path.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"offload tune-nvme: sweeping {path} ({'quick' if quick else 'full'} grid)", file=stream, flush=True)
    cells = sweep(path, quick=quick, size=size, with_fio=with_fio)
    winner = best(cells)
    frag = fragment(winner)
    (out_dir / "results.json").write_text(json.dumps([{**asdict(c), "score": c.score} for c in cells], indent=2))
    (out_dir / "aio_fragment.json").write_text(json.dumps(frag, indent=2) + "\n")
    heatmap(cells, out_dir / "heatmap.png")
    print(table(cells), file=stream)
    print(f"best: {winner.engine}, block {winner.block_size >> 10} KiB, depth {winner.queue_depth}, "
          f"threads {winner.threads}: read {winner.read_gbs:.2f} GB/s, write {winner.write_gbs:.2f} GB/s", file=stream)
    print(f"wrote {out_dir / 'aio_fragment.json'} (merge it into your ds_config), results.json, heatmap.png",
          file=stream)
    return frag
