"""ZeRO-3 weights touched outside forward: shapes, the empty partition, the full fp32 value."""
import argparse

import deepspeed
import torch
from common import Net, data, report
from deepspeed.utils import safe_get_full_fp32_param

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
for tokens in data(8).split(4):
    engine.backward(engine(tokens))
    engine.step()
w = engine.module.blocks[0][1].weight
full = safe_get_full_fp32_param(w)
with deepspeed.zero.GatheredParameters(w):
    gathered_sum = float(w.detach().float().sum())
report(ds_shape=list(w.ds_shape), ds_numel=int(w.ds_numel), numel_outside=w.numel(), full_shape=list(full.shape),
       gathered_vs_full=abs(gathered_sum - float(full.sum())) < 1e-3)
