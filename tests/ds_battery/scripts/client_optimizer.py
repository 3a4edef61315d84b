"""A client optimizer with two parameter groups and a client LR schedule handed to initialize."""
import argparse

import deepspeed
import torch
from common import Net, data, report

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
rest = [p for n, p in model.named_parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=2e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, optimizer=opt, lr_scheduler=sched)
losses, lrs = [], []
for tokens in data(24).split(4):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    lrs.append(engine.get_lr())
report(losses=losses, lrs=lrs, last_lr=scheduler.get_last_lr(), groups=len(optimizer.param_groups))
