"""A config that leaves gradient_clipping out (DeepSpeed clips at 1.0 by default) with a high learning rate."""
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
for tokens in data(24).split(4):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report(losses=losses, clip=engine.gradient_clipping(), norm=float(engine.get_global_grad_norm()))
