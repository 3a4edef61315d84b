"""Count the rare abort at a rank's exit ("terminate called without an active exception", SIGABRT) over many runs
of the two-process cases that have shown it, with and without a CPU hog beside them, and keep what each abort left.

    .venv/bin/python tools/exit_abort_stress.py --runs 100 --hog 0,2 --out stress-out

Each run is one case, in turn: accelerate's two-process loop (tests/accelerate_scripts/loop.py under `accelerate
launch`) and Lightning's two-device fit (tests/lightning_scripts/fit.py), each saving its state as the tests do, on
offload's engine and on plain DDP (the tests' references); and the smallest run that shows it, torch's DDP with each
rank pinned to one core (tools/exit_abort_ddp.py), without and with offload's hold of the backward's context
(ddp-pinned, ddp-pinned-held). Runs are not tests (no timing, nothing
asserted): the script prints a table of runs and aborts per case and hog, and writes it to <out>/counts.json. For
each abort it keeps the process's stderr (every thread's Python stack: PYTHONFAULTHANDLER) and, where the kernel
writes core files (root: it points /proc/sys/kernel/core_pattern at <out>/cores for the run and puts it back), the
native stacks of every thread from `gdb -batch -ex "thread apply all bt"` on the core.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ABORT = "terminate called without an active exception"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CASES = ("accelerate", "accelerate-plain", "lightning", "lightning-ddp", "ddp-pinned", "ddp-pinned-held")


def case_command(case: str, work: Path) -> list[str]:
    """One case's command: offload's side, or the same script on plain DDP (the tests' references, which run beside
    it: an abort there is torch's or the framework's, not the engine's)."""
    if case in ("accelerate", "accelerate-plain"):
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", str(_free_port()), str(REPO / "tests" / "accelerate_scripts" / "loop.py"),
                "offload" if case == "accelerate" else "plain", str(work / "out.pt"), "--save", str(work / "state")]
    if case in ("lightning", "lightning-ddp"):
        strategy = "offload_stage_3_offload" if case == "lightning" else "ddp"
        return [sys.executable, str(REPO / "tests" / "lightning_scripts" / "fit.py"), strategy, str(work / "out"),
                "--devices", "2", "--save", str(work / "saved")]
    if case in ("ddp-pinned", "ddp-pinned-held"):  # the smallest run, each rank on one core; held or not
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port()), str(REPO / "tools" / "exit_abort_ddp.py"),
                *(["--hold"] if case == "ddp-pinned-held" else [])]
    raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")


def _hog() -> None:  # a busy core, as another test worker or job on a shared CI machine
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _unlimited_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(case: str, cores: Path | None) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
        proc = subprocess.run(case_command(case, Path(tmp)), capture_output=True, text=True, cwd=tmp, env=env,
                              timeout=600, preexec_fn=_unlimited_core if cores is not None else None)
        return proc.returncode, proc.stderr


def native_stacks(cores: Path, since: float, out: Path) -> list[str]:
    """gdb's every-thread backtrace of each core written since ``since``, into ``out``."""
    kept = []
    for core in sorted(cores.glob("core.*")):
        if core.stat().st_mtime < since:
            continue
        # every rank is this Python (the core is named after the thread that aborted, not the program)
        bt = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt", sys.executable, str(core)],
                            capture_output=True, text=True, timeout=600)
        target = out / f"{core.name}.bt.txt"
        target.write_text(bt.stdout + bt.stderr)
        kept.append(str(target))
        core.unlink()
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs of each case at each hog level")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--hog", default="0,2", help="busy processes beside the runs, comma-separated levels")
    ap.add_argument("--out", default="exit-abort-stress")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = out / "cores"
    pattern = Path("/proc/sys/kernel/core_pattern")
    old_pattern = None
    if os.geteuid() == 0 and pattern.exists():
        cores.mkdir(exist_ok=True)
        old_pattern = pattern.read_text()
        pattern.write_text(f"{cores}/core.%e.%p")
    counts: dict[str, dict[str, int]] = {}
    try:
        for hog in [int(h) for h in args.hog.split(",")]:
            hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(hog)]
            for h in hogs:
                h.start()
            try:
                for case in args.cases.split(","):
                    key = f"{case}, hog {hog}"
                    tally = counts.setdefault(key, {"runs": 0, "aborts": 0, "other_failures": 0})
                    for i in range(args.runs):
                        since = time.time()
                        rc, err = run_once(case, cores if old_pattern is not None else None)
                        tally["runs"] += 1
                        if ABORT in err or rc in (-6, 134):
                            tally["aborts"] += 1
                            stem = out / f"abort-{case}-hog{hog}-{i}"
                            stem.with_suffix(".stderr.txt").write_text(err)
                            stacks = native_stacks(cores, since, out) if old_pattern is not None else []
                            print(f"{key} run {i}: ABORT (rc {rc}); stderr {stem}.stderr.txt; native stacks: "
                                  f"{', '.join(stacks) or 'no core'}", flush=True)
                        elif rc != 0:
                            tally["other_failures"] += 1
                            (out / f"failed-{case}-hog{hog}-{i}.stderr.txt").write_text(err)
                            print(f"{key} run {i}: failed (rc {rc}), not the abort", flush=True)
                        (out / "counts.json").write_text(json.dumps(counts, indent=1))
                    print(f"{key}: {tally['aborts']} aborts in {tally['runs']} runs "
                          f"({tally['other_failures']} other failures)", flush=True)
            finally:
                for h in hogs:
                    h.kill()
    finally:
        if old_pattern is not None:
            pattern.write_text(old_pattern)
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
