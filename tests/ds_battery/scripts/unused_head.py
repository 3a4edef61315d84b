"""A model with a head the loss never uses, under ZeRO-3 (ignore_unused_parameters left at its default)."""
import argparse

import deepspeed
import torch
from common import Net, data, report

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net(unused_head=True)
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
losses = []
for tokens in data(16).split(4):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report(losses=losses, steps=engine.global_steps)
