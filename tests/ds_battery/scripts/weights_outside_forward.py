"""ZeRO-3 weights touched outside forward after a few steps: shapes, the empty partition of a large parameter,
a small (persistent) one whole, the full fp32 value, and what a GatheredParameters block leaves."""
import argparse

import deepspeed
import torch
from common import Net, data, report
from deepspeed.utils import safe_get_full_fp32_param

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net(hidden=192)  # blocks' Linear weights: 147456 elements, above the persistence threshold
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
numels = {"after initialize": [p.numel() for p in engine.module.parameters()]}
for tokens in data(8).split(4):
    engine.backward(engine(tokens))
    engine.step()
    numels.setdefault("after the first step", [p.numel() for p in engine.module.parameters()])
big, small = engine.module.blocks[0][1].weight, engine.module.blocks[0][0].weight
numel_big, numel_small, small_sum = big.numel(), small.numel(), float(small.detach().sum())
full = safe_get_full_fp32_param(big)
with deepspeed.zero.GatheredParameters([big, small]):
    gathered_sum = float(big.detach().float().sum())
report(ds_shape=list(big.ds_shape), ds_numel=int(big.ds_numel), numel_big_after_step=numel_big,
       numel_small_after_step=numel_small, small_sum=small_sum, full_shape=list(full.shape),
       gathered_vs_full=abs(gathered_sum - float(full.sum())) < 1e-2,
       numel_small_after_gathered=small.numel(), numel_big_after_gathered=big.numel(), numels=numels,
       small_sums=[float(p.detach().float().abs().sum()) for p in engine.module.parameters() if p.numel()])
