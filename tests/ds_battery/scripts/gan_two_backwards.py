"""A GAN's loop in small: two engines in one process, the discriminator stepped after two backward calls (on real
samples, then on generated ones) and trained on their sum, as plain PyTorch accumulates them. The generator's loss
matches the real samples' moments, so that its step stays apart from the discriminator's gradients."""
import argparse

import deepspeed
import torch
from common import report
from torch import nn

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
g_engine, *_ = deepspeed.initialize(args=args, model=generator, model_parameters=generator.parameters())
d_engine, *_ = deepspeed.initialize(args=args, model=discriminator, model_parameters=discriminator.parameters())
bce = nn.BCEWithLogitsLoss()
samples = torch.Generator().manual_seed(1234)
d_losses, g_losses = [], []
for _step in range(6):
    real = torch.randn(4, 16, generator=samples) * 0.5 + 1.0
    noise = torch.randn(4, 8, generator=samples)
    loss_real = bce(d_engine(real), torch.ones(4, 1))
    d_engine.backward(loss_real)
    with torch.no_grad():
        fake = g_engine(noise)
    loss_fake = bce(d_engine(fake), torch.zeros(4, 1))
    d_engine.backward(loss_fake)
    d_engine.step()
    d_losses.append([float(loss_real), float(loss_fake)])
    generated = g_engine(noise)
    loss_g = (generated.mean(0) - real.mean(0)).square().sum() + (generated.std(0) - real.std(0)).square().sum()
    g_engine.backward(loss_g)
    g_engine.step()
    g_losses.append(float(loss_g))
with torch.no_grad():
    probe = torch.linspace(-1, 2, 16).repeat(2, 1)
    scores = [float(s) for s in d_engine(probe).view(-1)]
report(d_losses=d_losses, g_losses=g_losses, d_steps=d_engine.global_steps, g_steps=g_engine.global_steps,
       d_micro_steps=d_engine.micro_steps, scores=scores)
