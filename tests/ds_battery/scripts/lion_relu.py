"""Lion as DeepSpeed's docs configure it, on a small MLP twice: with ReLU (units dead on a batch give gradients and
momenta that are exactly zero, where the paper's sign(0) = 0 and DeepSpeed's CPU Lion's -lr part) and with tanh
(no exact zeros: the two updates agree but for the last place)."""
import argparse

import deepspeed
import torch
from common import report
from torch import nn

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(20, 8, 16, generator=g), torch.randn(20, 8, 1, generator=g)
observed = {}
for name, act in (("relu", nn.ReLU), ("tanh", nn.Tanh)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), act(), nn.Linear(64, 64), act(), nn.Linear(64, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    losses = []
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    observed[name] = losses
report(**observed)
