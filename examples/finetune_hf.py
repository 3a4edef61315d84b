"""Fine-tune a local Hugging Face checkpoint with offload.hf.Trainer, on one process or under torchrun.

    torchrun --nproc-per-node 2 examples/finetune_hf.py --model /models/Llama-3.2-1B --data corpus.txt \
        --config configs/zero3_cpu_offload_hf.json --out finetuned

The text is tokenized with the checkpoint's own tokenizer and cut into blocks of --block
tokens; the model is built on the meta device and its pretrained weights read straight
into each rank's shards; the Trainer's loop runs on offload's engine. At the end the
model is saved in Hugging Face's format (from_pretrained loads --out/final).
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoTokenizer, TrainingArguments, default_data_collator

import offload.hf


def blocks(path: str, tokenizer, block: int) -> list[dict[str, torch.Tensor]]:
    """The text's token ids cut into ``block``-token samples whose labels are their inputs (causal LM)."""
    with open(path, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long)
    n = ids.numel() // block
    if n == 0:
        raise SystemExit(f"{path}: {ids.numel()} tokens, fewer than one block of {block}; lower --block")
    return [{"input_ids": row, "labels": row} for row in ids[:n * block].view(n, block)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a local checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--data", required=True, help="a UTF-8 text file")
    p.add_argument("--config", default="configs/zero3_cpu_offload_hf.json", help="the DeepSpeed-format config")
    p.add_argument("--out", default="finetuned", help="output directory: checkpoints, then final/")
    p.add_argument("--block", type=int, default=512, help="tokens per sample")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per micro-batch")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--bf16", action="store_true", help="train in bf16 (where the hardware has it)")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    train = blocks(args.data, tokenizer, args.block)
    trainer = offload.hf.Trainer(
        model=offload.hf.meta_model(args.model), weights=args.model, offload_config=args.config,
        args=TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.batch,
                               gradient_accumulation_steps=args.accumulation, num_train_epochs=args.epochs,
                               learning_rate=args.lr, max_grad_norm=1.0, bf16=args.bf16, logging_steps=1,
                               save_strategy="epoch", report_to=[], use_cpu=not torch.cuda.is_available()),
        train_dataset=train, processing_class=tokenizer,
        data_collator=default_data_collator)  # equal-length blocks: nothing to pad
    trainer.train()
    trainer.save_model(os.path.join(args.out, "final"))


if __name__ == "__main__":
    main()
