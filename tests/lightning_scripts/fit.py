"""A LightningModule fitted by Lightning's Trainer under the strategy named on the command line, and what it did:
each training step's loss, the learning rates, the validation loss, the final whole weights; with --save, a
checkpoint at each epoch's end (4 steps); with --resume, fit(ckpt_path=...) from one. Run as a script (Lightning's
launcher starts the other processes of --devices 2 by running it again), one side per run; rank r writes OUT.r.pt.

    python fit.py ddp OUT [--devices 2] [--precision bf16-mixed] [--steps 8] [--save DIR] [--resume DIR]
                  [--compile BACKEND]

--compile: each block a class of the script's own, compiled in place in configure_model (``block.compile()``, as
Lightning's docs advise for strategies that shard: a compiled LightningModule is refused by Lightning itself for
DeepSpeed's strategies, offload's among them).
"""

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.utilities.model_summary import DeepSpeedSummary
from torch import nn

import offload
import offload.lightning  # noqa: F401 - registers the offload_* strategy names
from offload.machine.backward_context import hold_on_main_thread
from offload.zero.compiled import DynamoCounts

hold_on_main_thread()  # the DDP reference too: else torch's exit abort can fail it ([Note: the backward's context])


class Block(nn.Module):
    """The Sequential block's layers under a class of the script's own (torch's own containers are not traced)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.Linear(2 * w, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(self.norm(h))))


class Blocks(L.LightningModule):
    """Two residual blocks over an embedding, built in configure_model (under the strategy's sharded context)."""

    def __init__(self, lr: float = 1e-2, width: int = 64, manual: bool = False, compile: str = "") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.val_losses: list[float] = []
        self.net: nn.Module | None = None
        self.register_buffer("batches", torch.zeros((), dtype=torch.long))  # a buffer each rank keeps

    def configure_model(self) -> None:
        if self.net is not None:
            return
        w = self.hparams.width
        backend = self.hparams.compile
        blocks = [Block(w) if backend else nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.GELU(),
                                                         nn.Linear(2 * w, w)) for _ in range(2)]
        for block in blocks if backend else ():
            block.compile(backend=backend)
        self.net = nn.ModuleDict({"embed": nn.Embedding(32, w), "blocks": nn.ModuleList(blocks),
                                  "head": nn.Linear(w, 32)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        h = self.net["embed"](tokens)
        for block in self.net["blocks"]:
            h = h + block(h)
        return self.net["head"](h)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.batches += 1
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        if not self.automatic_optimization:  # the loop a GAN's or an RL module's training_step writes
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            scheduler.step()
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        loss = self.loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(seed: int, world: int) -> torch.utils.data.DataLoader:
    """This rank's part of the data, in the same order every epoch (Lightning's own sampler reshuffles each epoch,
    and numbers the epochs of a resumed run one apart from an uninterrupted one's)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (32 * world, 12), generator=g)
    data = torch.utils.data.TensorDataset(tokens, (tokens * 7 + 3) % 32)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set in the processes Lightning's launcher starts
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)


def whole_weights(trainer: L.Trainer, module: Blocks) -> dict[str, torch.Tensor]:
    engine = trainer.strategy.model
    if isinstance(engine, offload.Engine):
        return {k: v.float().clone() for k, v in engine.full_state_dict().items()}
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save", help="a ModelCheckpoint callback saving at each epoch's end into this folder")
    parser.add_argument("--resume", help="fit(ckpt_path=...) from this checkpoint")
    parser.add_argument("--manual", action="store_true", help="manual optimization (no accumulation, no clipping)")
    parser.add_argument("--compile", default="", help="compile each block with this torch.compile backend")
    parser.add_argument("--full-weights", action="store_true",
                        help="the offload strategy's load_full_weights (--resume names a single-file checkpoint)")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    module = Blocks(manual=args.manual, compile=args.compile)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=args.save, every_n_epochs=1, save_top_k=-1,
                                                     save_on_train_epoch_end=True)] if args.save else []
    strategy = args.strategy
    if args.full_weights:
        strategy = offload.lightning.OffloadStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                                                     load_full_weights=True)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        callbacks=callbacks,
                        precision=args.precision, accumulate_grad_batches=1 if args.manual else 2,
                        gradient_clip_val=None if args.manual else 0.5,
                        val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=bool(args.save), enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    start = DynamoCounts.now()
    trainer.fit(module, loader(1, args.devices), loader(2, args.devices), ckpt_path=args.resume)
    dynamo = DynamoCounts.now().since(start)
    summary = DeepSpeedSummary(module, max_depth=2) if args.strategy.startswith("offload") else None
    result = {"losses": module.losses, "lrs": module.lrs, "val_losses": module.val_losses,
              "weights": whole_weights(trainer, module), "global_step": trainer.global_step,
              "batches": int(module.batches), "strategy": type(trainer.strategy).__name__, "world": trainer.world_size,
              "params_per_device": getattr(summary, "parameters_per_layer", None),
              "params_total": getattr(summary, "total_parameters", None),
              "deepspeed_imported": "deepspeed" in sys.modules,
              "compiled": trainer.strategy.model.compile_report().as_dict()
              if isinstance(trainer.strategy.model, offload.Engine) else None,
              "graphs": dynamo.graphs, "graph_breaks": dynamo.break_count}
    tested = trainer.validate(module, loader(2, args.devices), verbose=False)
    result["validated"] = tested[0]["val_loss"]
    torch.save(result, f"{args.out}.{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
