"""Blocks recomputed in backward through deepspeed.checkpointing.checkpoint."""
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
losses = train(engine, data(16).split(4), checkpoint=deepspeed.checkpointing.checkpoint)
report(losses=losses)
