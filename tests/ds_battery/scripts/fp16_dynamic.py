"""fp16 with dynamic loss scaling (a high initial scale, so the first steps overflow and are skipped): the losses,
the scale after each step and the skipped count; once from the model's fp32 weights as built, once from those
weights rounded to fp16 first (where DeepSpeed's master starts, since it casts the module before building it)."""
import argparse

import deepspeed
import torch
from common import report
from torch import nn

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
deepspeed.init_distributed()
if deepspeed.__name__ == "deepspeed":  # DeepSpeed refuses fp16 on a CPU without mkldnn's fp16; the arithmetic runs
    from deepspeed.accelerator import get_accelerator
    type(get_accelerator()).is_fp16_supported = lambda self: True
g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(12, 8, 16, generator=g), torch.randn(12, 8, 1, generator=g)
observed = {}
for start in ("as_built", "rounded"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if start == "rounded":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    losses, scales = [], []
    for x, y in zip(xs, ys):
        loss = nn.functional.mse_loss(engine(x.half()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        scales.append(engine.optimizer.cur_scale)
    observed[start] = {"losses": losses if start == "as_built" else losses[:4], "scales": scales,
                       "skipped": engine.skipped_steps}
report(**observed)
