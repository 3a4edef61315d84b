"""One rank of the smallest run that shows the exit abort: torch's DDP over gloo, a few backward passes, then the
script ends without destroying its group, as most training scripts do. Started two at a time by
tools/exit_abort_stress.py (cases ddp-pinned, ddp-pinned-held) under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 tools/exit_abort_ddp.py [--hold] [--steps 3]

Each rank pins itself, every thread, to one core (rank modulo the cores it may use), as a container with one CPU per
rank does: gloo's worker then often runs only after the main thread has gone on, and it is the last holder of the
backward's context more often (see [Note: the backward's context] in offload/machine/backward_context.py).
--hold installs offload's hold first. Nothing is measured or asserted here; the stress tool counts exit codes.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", action="store_true", help="install offload's hold of the backward's context")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})  # before torch starts its threads: they inherit it
    torch.set_num_threads(1)
    if args.hold:
        from offload.machine.backward_context import hold_on_main_thread
        hold_on_main_thread()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    model = torch.nn.parallel.DistributedDataParallel(layers, bucket_cap_mb=0.001)  # a bucket per layer
    for _ in range(args.steps):
        model(torch.randn(4, 64)).sum().backward()


if __name__ == "__main__":
    main()
