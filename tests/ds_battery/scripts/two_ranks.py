"""Two processes under ZeRO-3: a DistributedSampler loader, losses averaged with deepspeed.comm, weights touched
outside forward (a released weight's sum, a persistent one whole, module.state_dict() saved and loaded), and a
write through GatheredParameters(modifier_rank=0) seen by every rank."""
import argparse

import deepspeed
import deepspeed.comm as dist
import torch
from common import Net, data, report
from deepspeed.utils import safe_get_full_fp32_param

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = Net(hidden=192)
engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                            training_data=torch.utils.data.TensorDataset(data(16)))
losses = []


def train(batches):
    for (tokens,) in batches:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)


train(loader)
train(loader)
big, small = engine.module.blocks[0][1].weight, engine.module.blocks[0][0].weight
touched = {"big_sum": float(big.sum()), "big_shape": list(big.shape), "small_abs_sum": float(small.abs().sum()),
           "small_shape": list(small.shape)}
state = engine.module.state_dict()
torch.save(state, f"state{rank}.pt")
loaded = torch.load(f"state{rank}.pt")
touched["state_numels"] = {k: v.numel() for k, v in loaded.items()}
with deepspeed.zero.GatheredParameters([big], modifier_rank=0):
    if rank == 0:
        big.data[0].zero_()
with deepspeed.zero.GatheredParameters([big]):
    touched["written_row"] = float(big[0].abs().sum())
master = safe_get_full_fp32_param(big)
touched["written_row_master"] = float(master[0].abs().sum())
touched["full_shape"] = list(master.shape)
report(rank=rank, world=world, losses=losses, steps=engine.global_steps, samples=engine.global_samples,
       batches=len(loader), **touched)
