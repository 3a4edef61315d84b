"""A step timed from outside, as a user's script would: #44's CPU row without offload's own bench.

The GPT-2-small shape of #44 (12 x 768, vocabulary 50304, seq 256, micro-batch 4, bf16, W = 1, no clipping),
offload.initialize on the plain model with params and optimizer on the host (`host`) or both on NVMe (`nvme`),
beside plain PyTorch on bf16 weights with torch's AdamW (`plain`: the same compute; its forward + backward is the
floor). Forward, backward and step are each timed with perf_counter around the calls a script makes, two warm-up
steps then four timed; one process a side, so run the sides alternately for a comparison:

  for r in 1 2 3; do for s in plain host nvme; do python tools/outside_step.py $s --out out.jsonl; done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import offload
from offload.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=["plain", "host", "nvme"])
    parser.add_argument("--out", default=None, help="append one JSON line here")
    parser.add_argument("--nvme-path", default="/tmp", help="where the nvme side's swap directory goes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=50304, context=256, hidden_size=768, layers=12, heads=12)
    tokens = torch.randint(0, shape.vocab_size, (args.warmup + args.steps, 4, shape.context + 1))

    def loss_of(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
        logits = model(rows[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))

    times = []
    if args.side == "plain":
        model = GPT(shape).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for rows in tokens:
            t0 = time.perf_counter()
            loss = loss_of(model, rows)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    else:
        zero: dict = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
        if args.side == "nvme":
            path = tempfile.mkdtemp(dir=args.nvme_path)
            zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                    "offload_optimizer": {"device": "nvme", "nvme_path": path}}
        config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
        engine = offload.initialize(model=GPT(shape), config=config)[0]
        for rows in tokens:
            t0 = time.perf_counter()
            loss = loss_of(engine, rows)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        engine.close()
    timed = times[args.warmup:]
    out = {"side": args.side, **{name: round(statistics.median(t[k] for t in timed), 3)
                                 for k, name in enumerate(("forward", "backward", "step"))},
           "total": round(statistics.median(sum(t) for t in timed), 3)}
    print(json.dumps(out))
    if args.out:
        with Path(args.out).open("a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
