"""A Fabric training loop, as a DeepSpeed user of Fabric writes it, run four times in one process, one Fabric each:
under ``ddp`` (saving a single file after step 4), under an offload strategy with the same loop (saving the
engine's folder after step 4), that offload run resumed from its folder, and offload with ``load_full_weights``
from DDP's file. Rank r writes OUT.r.pt: each run's losses, learning rates and final whole weights. With --devices 2
Fabric's launcher starts rank 1 by running this script again (the later Fabrics of rank 0 see LOCAL_RANK set and
start nothing).

    python fabric_loop.py OUT [--devices 2]
"""

import argparse
import os
import sys

import lightning as L
import torch
from torch import nn

import offload.lightning
from offload.machine.backward_context import hold_on_main_thread

hold_on_main_thread()  # the DDP reference too: else torch's exit abort can fail it ([Note: the backward's context])

STEPS, ACCUMULATE, SAVED_AT, CLIP = 8, 2, 4, 0.5
OFFLOAD = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}


class Net(nn.Module):
    """An embedding, two residual blocks, a head; a buffer counting the forwards."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width)) for _ in range(2))
        self.head = nn.Linear(width, 32)
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.batches += 1
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), targets.flatten())


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, 32, (4, 12), generator=g)
    return tokens, (tokens * 7 + 3) % 32


def run(strategy, devices: int, save: str | None = None, resume: str | None = None,
        first_step: int = 0, last_step: int = STEPS) -> dict:
    """One Fabric, one model: steps first_step..last_step-1 (with ``resume``, from the step the file holds)."""
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=devices)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    net, optimizer, scheduler = fabric.setup(net, optimizer, scheduler=scheduler)
    plain = strategy == "ddp"
    if resume is not None:
        state = {"model": net, "step": first_step}
        if not fabric.strategy.load_full_weights:  # the engine's folder: the optimizer's state and the rest
            state.update(optimizer=optimizer, scheduler=scheduler)
        fabric.load(resume, state)
        first_step = state["step"]
    losses, lrs, norms = [], [], []
    for step in range(first_step, last_step):
        for micro in range(ACCUMULATE):
            with fabric.no_backward_sync(net, enabled=micro < ACCUMULATE - 1):
                loss = net(*batch(step, micro, fabric.global_rank)) / ACCUMULATE
                fabric.backward(loss)
            losses.append(loss.item())
        if plain:
            norms.append(fabric.clip_gradients(net, optimizer, max_norm=CLIP).item())  # offload's: the config's
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        if save is not None and step + 1 == SAVED_AT:
            fabric.save(save, {"model": net, "optimizer": optimizer, "scheduler": scheduler, "step": step + 1})
    refused = {} if plain or resume is None else refusals(fabric, net, optimizer, resume)
    engine = net.module if plain else net._forward_module
    weights = engine.state_dict() if plain else engine.full_state_dict()
    return {"losses": losses, "lrs": lrs, "norms": norms,
            "weights": {k: v.detach().float().clone() for k, v in weights.items()},
            "refused": refused, "strategy": type(fabric.strategy).__name__, "world": fabric.world_size,
            "rank": fabric.global_rank}


def refusals(fabric: L.Fabric, net, optimizer, folder: str) -> dict[str, str]:
    """What the offload strategy refuses, each call's error, by name."""
    calls = {"load not strict": lambda: fabric.load(folder, {"model": net}, strict=False),
             "save without the model": lambda: fabric.save(folder + ".x", {"step": 1}),
             "save with a filter": lambda: fabric.save(folder + ".x", {"model": net}, filter={"model": print}),
             "step with a closure": lambda: optimizer.step(closure=lambda: 0.0),
             "clip_gradients": lambda: fabric.clip_gradients(net, optimizer, max_norm=1.0)}
    said = {}
    for name, call in calls.items():
        try:
            call()
            said[name] = "nothing"
        except Exception as e:  # noqa: BLE001 - each refusal's type and message, asserted by the test
            said[name] = f"{type(e).__name__}: {e}"
    return said


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--folder", required=True, help="where the checkpoints go (the same on every rank)")
    args = parser.parse_args()
    single, folder = os.path.join(args.folder, "ddp.ckpt"), os.path.join(args.folder, "offload.ckpt")
    result = {"ddp": run("ddp", args.devices, save=single)}
    result["offload"] = run(offload.lightning.fabric.OffloadStrategy(config=OFFLOAD), args.devices, save=folder)
    result["resumed"] = run(offload.lightning.fabric.OffloadStrategy(config=OFFLOAD), args.devices, resume=folder)
    result["full_weights"] = run(offload.lightning.fabric.OffloadStrategy(config=OFFLOAD, load_full_weights=True),
                                 args.devices, resume=single, last_step=SAVED_AT + 1)
    result["deepspeed_imported"] = "deepspeed" in sys.modules
    torch.save(result, f"{args.out}.{result['ddp']['rank']}.pt")


if __name__ == "__main__":
    main()
