"""A model with a head the loss never uses, under ZeRO-3 (ignore_unused_parameters left at its default)."""
import argparse

import deepspeed
import torch
from common import Net, data, report, train

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net(unused_head=True)
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
losses = train(engine, data(16).split(4))
report(losses=losses, steps=engine.global_steps)
