"""A PEFT LoRA fine-tune under ZeRO-3: adapters on the blocks' linears of a small model, only they trained, the
base untouched; the adapter saved with PEFT's own save_pretrained inside GatheredParameters (the weights whole),
loaded into a fresh base with PeftModel.from_pretrained, and that model's loss compared with the engine's."""
import argparse
import json
import os

import deepspeed
import torch
from common import Net, data, report, train
from peft import LoraConfig, PeftModel, get_peft_model

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
torch.manual_seed(0)
lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*blocks\.\d+\.[13]", lora_dropout=0.0, init_lora_weights=False)
model = get_peft_model(Net(), lora)
trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
engine, *_ = deepspeed.initialize(args=args, model=model,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])
losses = train(engine, data(24).split(4))
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    engine.module.save_pretrained("adapter")
    with torch.no_grad():
        engine_loss = float(engine.module(data(4)))
torch.manual_seed(0)
reloaded = PeftModel.from_pretrained(Net(), "adapter")
with torch.no_grad():
    reloaded_loss = float(reloaded(data(4)))
with open(os.path.join("adapter", "adapter_config.json")) as f:
    saved_config = json.load(f)
report(losses=losses, trainable=trainable, files=sorted(os.listdir("adapter")), engine_loss=engine_loss,
       reloaded_loss=reloaded_loss, r=saved_config["r"])
