"""Lion and Adagrad by the config's optimizer type (DeepSpeed's CPU kernels for them, the optimizer offloaded), each
over a whole warm-up-then-decay schedule from the config, one engine after the other in one script."""
import argparse
import json

import deepspeed
import torch
from common import Net, data, report, train_scheduled

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
with open(args.deepspeed_config) as f:
    base = json.load(f)
runs = {"Lion": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
        "Adagrad": {"lr": 0.05, "weight_decay": 0.01}}
observed = {}
for name, params in runs.items():
    torch.manual_seed(0)
    config = dict(base, optimizer={"type": name, "params": params},
                  scheduler={"type": "WarmupDecayLR",
                             "params": {"warmup_min_lr": 0.0, "warmup_max_lr": params["lr"], "warmup_num_steps": 3,
                                        "total_num_steps": 8, "warmup_type": "linear"}})
    engine, _, _, _ = deepspeed.initialize(model=Net(), config=config)
    losses, lrs = train_scheduled(engine, data(32).split(4))
    observed[name] = {"losses": losses, "lrs": lrs}
report(**observed)
