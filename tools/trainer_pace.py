"""A Llama-shaped model fine-tuned through a Hugging Face Trainer on one GPU: offload's, DeepSpeed's, or plain.

#44's row "a model larger than the GPU": the same Llama-3-shaped model (random weights, the same seed), the same
synthetic tokens and the same DeepSpeed-format config on every side, activation checkpointing on as a user sets it
(``gradient_checkpointing=True``), bf16. One side a process, so a side that runs out of memory (plain PyTorch: the
state alone is 16 bytes a parameter) shows its error as it happened and the next side starts clean:

  offload    offload.hf.Trainer(offload_config=CONFIG), the model built under offload.zero.Init (never whole in memory)
  switch     `import offload.as_deepspeed`, then exactly the deepspeed side: offload behind transformers' DeepSpeed path
  deepspeed  transformers.Trainer with TrainingArguments(deepspeed=CONFIG), its own zero.Init through the arguments
  plain      transformers.Trainer without either: everything on the GPU (fp32 weights, bf16 autocast, AdamW)

``--trainer sft`` runs TRL's SFTTrainer (SFTConfig, the same tokens as a pretokenized data set) in place of
transformers' Trainer on the switch, deepspeed and plain sides: #83's row, TRL beside DeepSpeed with one config file.

Each side writes one JSON line: tokens/s over the timed steps (median step time, after the warm-up), the GPU's high
water, the process's peak RSS, the losses, or the error. ``--tiny`` shrinks the model for a CPU smoke run.

  python tools/trainer_pace.py --side offload --config CONFIG --out trainer-offload.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, max_position_embeddings=256)


class Tokens(torch.utils.data.Dataset):
    """Random token rows (fixed seed): labels are the inputs, as causal-LM fine-tuning feeds them."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["offload", "switch", "deepspeed", "plain"], required=True)
    p.add_argument("--trainer", choices=["hf", "sft"], default="hf", help="transformers' Trainer, or TRL's SFTTrainer")
    p.add_argument("--config", required=True, help="a DeepSpeed-format config, read as it is by both engines")
    p.add_argument("--out", required=True, help="the JSON result")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on this machine's device: a smoke run")
    args = p.parse_args()
    if args.trainer == "sft" and args.side == "offload":
        p.error("--trainer sft runs on the switch, deepspeed and plain sides (offload.hf.Trainer is not TRL's)")
    return record(args.out, {"side": args.side, "trainer": args.trainer, "seq": args.seq, "config": args.config},
                  lambda: train(args))


def record(path: str, out: dict[str, Any], work: Callable[[], dict[str, Any]],
           unprinted: tuple[str, ...] = ("traceback",)) -> int:
    """Run ``work`` into ``out`` and write it to ``path`` as JSON, with the wall time, the process's peak RSS and
    the GPU's high water; a failure (out of memory included) is written as it happened instead of a figure. Prints
    the result but ``unprinted``; returns the exit status (1: it failed)."""
    started = time.perf_counter()
    try:
        out |= work()
    except BaseException as e:  # out of memory included: shown as it happened
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        out["traceback"] = traceback.format_exc()[-4000:]
    out["wall_s"] = time.perf_counter() - started
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available():
        out["gpu_peak"] = torch.cuda.max_memory_allocated()
    Path(path).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in unprinted}))
    return 0 if "error" not in out else 1


def sft_parts(rows: torch.Tensor, vocab: int) -> tuple[Any, Any]:
    """The tokens as a pretokenized data set and a word-level tokenizer of the model's vocabulary (no hub)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    words = {f"t{i}": i for i in range(vocab - 1)} | {"<pad>": vocab - 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="<pad>")
    return Dataset.from_dict({"input_ids": rows.tolist()}), tokenizer


def train(args: argparse.Namespace) -> dict[str, Any]:
    if args.side == "switch":
        import offload.as_deepspeed  # noqa: F401 - before transformers: it decides at import whether DeepSpeed is here
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    shape = TINY if args.tiny else LLAMA3_8B
    seq = min(args.seq, shape["max_position_embeddings"])
    model_config = LlamaConfig(**shape, torch_dtype="bfloat16")
    total = args.warmup + args.steps
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    common = dict(output_dir="/tmp/trainer-pace", per_device_train_batch_size=1, gradient_accumulation_steps=1,
                  max_steps=total, learning_rate=1e-5, bf16=True, gradient_checkpointing=True,
                  logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                  use_cpu=not torch.cuda.is_available())
    data = Tokens(total, seq, shape["vocab_size"])
    torch.manual_seed(0)
    built = time.perf_counter()
    if args.side == "offload":
        import offload
        import offload.hf
        with offload.zero.Init():
            model = LlamaForCausalLM(model_config)
        trainer: Any = offload.hf.Trainer(model=model, args=TrainingArguments(**common), offload_config=args.config,
                                          train_dataset=data, callbacks=[Clock()])
    elif args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer
        deepspeed = args.config if args.side != "plain" else None
        targs = SFTConfig(**common, deepspeed=deepspeed, max_length=seq, packing=False)  # before the model: zero.Init
        if args.side == "plain":  # built where it trains, as the plain side below
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = transformers.AutoModelForCausalLM.from_config(model_config)
        else:  # under the engine's zero.Init, through the arguments made first
            model = transformers.AutoModelForCausalLM.from_config(model_config)
        dataset, tokenizer = sft_parts(data.ids, shape["vocab_size"])
        trainer = SFTTrainer(model=model, args=targs, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[Clock()])
    elif args.side in ("deepspeed", "switch"):
        targs = TrainingArguments(**common, deepspeed=args.config)  # before the model: its zero.Init applies
        model = transformers.AutoModelForCausalLM.from_config(model_config)
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
    else:
        # built where it trains: the host's generator draws one value at a time, twice a weight (16 s for a
        # one-layer 1.27B slice on a 2-core Xeon, so about 100 s for the 8B), for a side whose 16 bytes a parameter
        # do not fit on the GPU anyway
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(model_config)
        trainer = transformers.Trainer(model=model, args=TrainingArguments(**common), train_dataset=data,
                                       callbacks=[Clock()])
    build_s = time.perf_counter() - built
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # a released one is empty
    result = trainer.train()
    timed = times[args.warmup:] or times
    step = statistics.median(timed)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"params": params, "build_s": build_s, "step_s": step, "spread_s": [min(timed), max(timed)],
            "tokens_per_s": seq / step, "steps": times, "losses": losses, "train_loss": result.training_loss}


if __name__ == "__main__":
    sys.exit(main())
