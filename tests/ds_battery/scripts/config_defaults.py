"""A config that leaves gradient_clipping out (DeepSpeed clips at 1.0 by default) with a high learning rate."""
import argparse

import deepspeed
import torch
from common import Net, data, report, train

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
losses = train(engine, data(24).split(4))
report(losses=losses, clip=engine.gradient_clipping(), norm=float(engine.get_global_grad_norm()))
