"""The largest model `offload estimate` says this machine trains, trained: #44's last GPU row.

`offload estimate`'s table of the largest model per offload choice (host memory available now, the free disk
under --nvme-path as NVMe, the GPU's memory) picks the choice that trains the most parameters; a Llama-shaped model
of --fraction of that size (layers of Llama-3-70B's width, 8 KV heads, its vocabulary; built under
offload.zero.Init, so it is never whole in memory) then trains --warmup + --steps steps at --seq with every block
checkpointed, bf16, ratio auto. One JSON: the choice, the estimate's bytes per tier for this model, each tier's
peak as the engine accounted it (the GPU's from torch's allocator), tokens/s, and the error if one stopped it.

  python tools/largest_pace.py --nvme-path /tmp/nvme --out largest.json
  python tools/largest_pace.py --params 2e6 --hidden 64 --out smoke.json   # a smoke run's size
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from trainer_pace import record  # this folder's: the same JSON, error and peaks as the Trainer row

WIDE = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
            vocab_size=128256)  # Llama-3-70B's layer and vocabulary


def layer_params(shape: dict[str, int]) -> int:
    """Elements of one decoder layer: attention (q, o whole; k, v by the KV heads), the MLP, two norms."""
    h, kv = shape["hidden_size"], shape["hidden_size"] * shape["num_key_value_heads"] // shape["num_attention_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate_size"] + 2 * h


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--nvme-path", default=None, help="where NVMe swap goes (default: a new folder under /tmp)")
    p.add_argument("--fraction", type=float, default=0.9, help="of the largest size (default 0.9: the estimate "
                                                               "leaves out the CUDA context and allocator slack)")
    p.add_argument("--params", type=float, default=None, help="this size instead of the estimate's largest")
    p.add_argument("--hidden", type=int, default=None, help="a narrower layer (a smoke run's): heads hidden/64")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    return record(args.out, {}, lambda: run(args), unprinted=("traceback", "estimate"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import offload
    from offload.commands.estimate import CHOICES, Machine, choice_config, estimate, largest_trainable, model_units
    from offload.config import Config

    if not 0 < args.fraction <= 1:
        raise ValueError(f"--fraction {args.fraction} must be in (0, 1]: a size the estimate says fits")
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="largest-", dir="/tmp")
    Path(nvme_path).mkdir(parents=True, exist_ok=True)  # its free space is what the estimate counts
    base: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
                            "offload": {"checkpoint_blocks": True}}
    machine = Machine.here(nvme_path)
    largest = largest_trainable(base, machine)
    name = max(largest, key=lambda k: largest[k][0])
    raw = choice_config(base, CHOICES[name], nvme_path)
    if raw["zero_optimization"]["offload_optimizer"]["device"] != "none":
        raw["zero_optimization"]["offload_optimizer"]["ratio"] = "auto"
    target = int(args.params or args.fraction * largest[name][0])
    shape = dict(WIDE)
    if args.hidden:
        shape.update(hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                     num_key_value_heads=max(1, args.hidden // 512), intermediate_size=args.hidden * 7 // 2,
                     vocab_size=512)
    embeddings = 2 * shape["vocab_size"] * shape["hidden_size"]
    layers = max(1, (target - embeddings) // layer_params(shape))
    model_config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=max(args.seq, 256),
                               torch_dtype="bfloat16")
    torch.manual_seed(0)
    with offload.zero.Init():
        model = LlamaForCausalLM(model_config)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    config = Config.load(raw).resolve(world_size=1, hidden_size=shape["hidden_size"])
    est = estimate(model_units(model, config), config, 1, discrete=torch.cuda.is_available(),
                   device_free=machine.device_bytes)
    engine = offload.initialize(model=model, config=raw)[0]
    device = engine.accel.device
    tokens = torch.randint(0, shape["vocab_size"], (args.warmup + args.steps, 1, args.seq))
    times, losses = [], []
    for rows in tokens:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = rows.to(device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    summary = engine.memory_summary()
    engine.close()
    step = statistics.median(times[args.warmup:] or times)
    peaks = {tier: parts.get("peak", sum(v for k, v in parts.items() if k not in ("budget", "total")))
             for tier, parts in summary.items()}
    if torch.cuda.is_available():
        peaks["device"] = torch.cuda.max_memory_allocated()
    return {"machine": {"device_bytes": machine.device_bytes, "host_bytes": machine.host_bytes,
                        "nvme_bytes": machine.nvme_bytes, "nvme_path": machine.nvme_path},
            "largest": {k: {"params": n, "limited_by": t} for k, (n, t) in largest.items()}, "choice": name,
            "params": params, "layers": layers, "seq": args.seq, "step_s": step, "steps": times,
            "tokens_per_s": args.seq / step, "losses": losses, "peaks": peaks,
            "estimate": {t: est.total(t) for t in est.tiers}, "memory": summary}


if __name__ == "__main__":
    sys.exit(main())
