"""Muon by the config's optimizer type (DeepSpeed's MuonWithAuxAdam: Muon on the hidden matrices, Adam on the
rest), over a whole warm-up-then-decay schedule from the config; what the loss did, and the rate each step read."""
import argparse
import json

import deepspeed
import torch
from common import Net, data, report, train_scheduled

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
with open(args.deepspeed_config) as f:
    config = json.load(f)
config["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed: "Muon and reduce scatter cannot be used together"
config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}}
config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                           "warmup_num_steps": 3, "total_num_steps": 8,
                                                           "warmup_type": "linear"}}
torch.manual_seed(0)
engine, _, _, _ = deepspeed.initialize(model=Net(), config=config)
losses, lrs = train_scheduled(engine, data(32).split(4))
report(losses=losses, lrs=lrs)
