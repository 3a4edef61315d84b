"""DeepSpeedExamples' DCGAN loop (training/gan/gan_deepspeed_train.py) in small: two engines over client
torch.optim.Adams and a config without a zero_optimization section; the modules called directly; ``netD.zero_grad()``
at the top of each iteration; the discriminator's engine takes two backward calls (real, then fake) before its step;
the generator's loss goes back through the discriminator, whose gradients the next ``netD.zero_grad()`` clears."""
import argparse

import deepspeed
import torch
from common import report
from torch import nn

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
torch.manual_seed(0)
nz, batch = 8, 8
netG = nn.Sequential(nn.Linear(nz, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
netD = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=0.002, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=0.002, betas=(0.5, 0.999))
model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                       optimizer=optimizerD)
model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                       optimizer=optimizerG)
samples = torch.Generator().manual_seed(1234)
fixed_noise = torch.randn(batch, nz, generator=samples)
real_label, fake_label = 1.0, 0.0
d_losses, g_losses = [], []
for _i in range(10):
    # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    real = torch.tanh(torch.randn(batch, 16, generator=samples) * 0.5 + 0.8)
    label = torch.full((batch,), real_label)
    output = netD(real).view(-1)
    errD_real = criterion(output, label)
    model_engineD.backward(errD_real)
    noise = torch.randn(batch, nz, generator=samples)
    fake = netG(noise)
    label.fill_(fake_label)
    output = netD(fake.detach()).view(-1)
    errD_fake = criterion(output, label)
    model_engineD.backward(errD_fake)
    model_engineD.step()
    # (2) Update G network: maximize log(D(G(z)))
    netG.zero_grad()
    label.fill_(real_label)
    output = netD(fake).view(-1)
    errG = criterion(output, label)
    model_engineG.backward(errG)
    model_engineG.step()
    d_losses.append([float(errD_real), float(errD_fake)])
    g_losses.append(float(errG))
with torch.no_grad():
    generated = netG(fixed_noise)
report(d_losses=d_losses, g_losses=g_losses, generated_sum=float(generated.double().sum()),
       d_steps=model_engineD.global_steps, g_steps=model_engineG.global_steps)
