"""DeepSpeedExamples' shape: argparse with the config arguments, init_distributed, training_data, the loop."""
import argparse

import deepspeed
import torch
from common import Net, data, report

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = Net()
dataset = torch.utils.data.TensorDataset(data(32))
engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                    training_data=dataset)
losses, applied, boundary = [], [], []
for (tokens,) in loader:
    tokens = tokens.to(torch.device("cpu") if engine.local_rank < 0 else tokens.device)
    loss = engine(tokens)
    boundary.append(engine.is_gradient_accumulation_boundary())
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    applied.append(engine.was_step_applied())
report(losses=losses, applied=applied, boundary=boundary, global_steps=engine.global_steps,
       global_samples=engine.global_samples, dp=engine.dp_world_size, lr=engine.get_lr(),
       mom=[list(m) for m in engine.get_mom()], stage=engine.zero_optimization_stage(),
       micro=engine.train_micro_batch_size_per_gpu(), gas=engine.gradient_accumulation_steps(),
       batches=len(loader), clip=engine.gradient_clipping())
