"""torch.optim optimizers other than Adam handed to initialize with the optimizer offloaded (DeepSpeed steps them
on its CPU partitions where ``zero_force_ds_cpu_optimizer`` is false and untested optimizers are allowed), each
over the same batches, one engine after the other."""
import argparse
import json

import deepspeed
import torch
from common import Net, data, report, train

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
with open(args.deepspeed_config) as f:
    base = json.load(f)
config = {k: v for k, v in base.items() if k != "optimizer"}
config.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True)
runs = {"SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.005, momentum=0.5),
        "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
        "Rprop": lambda p: torch.optim.Rprop(p, lr=0.005)}
observed = {}
for name, make in runs.items():
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make(model.parameters()), config=config)
    observed[name] = train(engine, data(32).split(4))
report(**observed)
