"""An accelerate training loop as people write it, run as a script: with accelerate's own Accelerator (``plain``)
or with the import changed to offload's (``offload``), the same config and data. Writes what it observed to OUT
(torch.save): losses, the final weights, and what the accelerator's calls returned.

    python loop.py {plain,offload,deepspeed} OUT [--epochs N] [--save DIR] [--load DIR] [--precision bf16] [--dummy]
                   [--dynamo BACKEND]

--dummy (offload): the optimizer and scheduler from the config, through accelerate's DummyOptim and DummyScheduler
(its lr_scheduler_callable builds the StepLR the plain loop builds), as a DeepSpeed script of accelerate's writes
them.

--dynamo BACKEND: accelerate's dynamo_backend (plain accelerate compiles the whole model; offload each unit's
blocks), on a model with two residual blocks of its own class, cut into units of about two layers.
"""

import argparse
import sys

import torch
from accelerate.utils import DeepSpeedPlugin, set_seed

from offload.machine.backward_context import hold_on_main_thread

hold_on_main_thread()  # the plain reference too: else torch's exit abort can fail it ([Note: the backward's context])

parser = argparse.ArgumentParser()
parser.add_argument("impl", choices=["plain", "offload", "deepspeed"])
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--save")
parser.add_argument("--load")
parser.add_argument("--precision", default="no")
parser.add_argument("--dummy", action="store_true")
parser.add_argument("--dynamo", default="no")
args = parser.parse_args()

if args.impl in ("offload", "deepspeed"):  # deepspeed: accelerate's own DeepSpeed path, the same config
    if args.impl == "offload":
        from offload.accelerate import Accelerator
    else:
        from accelerate import Accelerator
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    if args.impl == "deepspeed":  # what its get_state_dict needs at stage 3
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if args.dummy:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    if args.dynamo != "no":
        config["offload"] = {"unit_bytes": 8192}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=2,
                              mixed_precision=args.precision, dynamo_backend=args.dynamo)
else:
    from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision=args.precision,
                              dynamo_backend=args.dynamo)


class Residual(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


set_seed(0)
if args.dynamo != "no":
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), Residual(32), Residual(32), torch.nn.Linear(32, 1))
else:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
if args.dummy:
    from offload.accelerate import DummyOptim, DummyScheduler  # accelerate.utils has them only with DeepSpeed
    optimizer = DummyOptim(model.parameters())
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.StepLR(
        opt, step_size=3, gamma=0.5))
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
gen = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
first = 0
if args.load:
    accelerator.load_state(args.load)
    first = 1
losses, norms, lrs = [], [], []
for epoch in range(first, args.epochs):
    for x, y in loader:
        with accelerator.accumulate(model):
            if args.precision == "bf16" and args.impl != "plain":
                x = x.to(torch.bfloat16)  # DeepSpeed's bf16 casts the weights, not the inputs: scripts cast them
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.impl == "plain":
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients and args.impl != "plain":
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        losses.append(float(loss))
        lrs.append(scheduler.get_last_lr()[0])
    if args.save and epoch == 0:
        accelerator.save_state(args.save)
state = {k: v.detach().float().cpu() for k, v in accelerator.get_state_dict(model).items()}
torch.save({"losses": losses, "norms": norms, "lrs": lrs, "state": state,
            "unwrapped": type(accelerator.unwrap_model(model)).__name__,
            "compiled": list(model.compile_report().compiled) if args.impl == "offload" else None,
            "bf16": bool(getattr(model, "bfloat16_enabled", lambda: False)()),
            "deepspeed_imported": any(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules)},
           args.out if accelerator.num_processes == 1 else f"{args.out}.{accelerator.process_index}")
