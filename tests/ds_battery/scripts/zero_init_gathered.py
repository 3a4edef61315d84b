"""ZeRO-3 construction: the model built under zero.Init, a weight set through GatheredParameters before and after
initialize, the full fp32 weights read back."""
import argparse

import deepspeed
import torch
from common import Net, data, report, train
from deepspeed.utils import safe_get_full_fp32_param

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
plain = Net(hidden=64)
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
    model = Net(hidden=64)
with deepspeed.zero.GatheredParameters(model.blocks[0][1].weight, modifier_rank=0):
    same_init = bool(torch.equal(model.blocks[0][1].weight.detach(), plain.blocks[0][1].weight.detach()))
    model.blocks[0][1].weight.data[0].fill_(0.5)
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
with deepspeed.zero.GatheredParameters(engine.module.head.weight, modifier_rank=0):
    head_sum = float(engine.module.head.weight.detach().sum())
losses = train(engine, data(16).split(4))
row = safe_get_full_fp32_param(engine.module.blocks[0][1].weight)
report(same_init=same_init, losses=losses, row_sum=float(row[0].sum()), shape=list(row.shape), head_sum=head_sum)
