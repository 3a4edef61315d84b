"""engine.zero_grad() before every micro-batch, with gradient accumulation (ZeRO-2)."""
import argparse

import deepspeed
import torch
from common import Net, data, report

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
losses = []
for tokens in data(16).split(2):
    engine.zero_grad()
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report(losses=losses, steps=engine.global_steps)
