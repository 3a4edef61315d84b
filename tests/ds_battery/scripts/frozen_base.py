"""A LoRA-style fine-tune: the base frozen, only the head trained; the frozen weights must not move."""
import argparse

import deepspeed
import torch
from common import Net, data, report, train

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
for name, p in model.named_parameters():
    p.requires_grad = name.startswith("head.")
base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
engine, *_ = deepspeed.initialize(args=args, model=model,
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])
losses = train(engine, data(16).split(4))
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    moved = [n for n, p in engine.module.named_parameters() if n in base and not torch.equal(p.detach(), base[n])]
report(losses=losses, moved=moved)
