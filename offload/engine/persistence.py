"""The engine's methods that read or write the model whole: gathered parameters, state dicts, 16-bit saves and
checkpoints. A mixin of ``Engine`` (offload/engine/core.py): each call checks the engine is usable, lets every
host thread finish agreed by every rank, rewrites stale NVMe shards, then hands over to weights.py or checkpoint_io.py,
which do the work."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from offload.config import Config
from offload.engine import checkpoint_io, weights
from offload.engine.accumulation import Accumulation
from offload.engine.errors import EngineError
from offload.engine.life import Lifetime
from offload.observe.telemetry import Telemetry
from offload.optim.loss_scale import LossScaler
from offload.optim.sharded import ShardedAdam
from offload.zero.unit import Unit

logger = logging.getLogger("offload.engine")


class Persistence:
    """Whole weights and checkpoints, in DeepSpeed's call shapes."""

    # The engine's fields and steps these use (Engine's).
    accumulation: Accumulation
    config: Config
    optimizer: ShardedAdam
    telemetry: Telemetry
    loss_scaler: LossScaler
    global_steps: int
    skipped_steps: int
    global_samples: int
    train_batch_size: Callable[[], int]
    life: Lifetime
    units: list[Unit]
    _drain: Callable[..., None]  # (before, publish=False)
    discard_gradients: Callable[[], None]

    # ----------------------------------------------------------------- whole weights (offload/engine/weights.py)

    @contextlib.contextmanager
    def gathered_parameters(self, modifier_rank: int | None = None,
                            params: Iterable[torch.Tensor] | None = None) -> Iterator[nn.Module]:
        """Every unit (``params``: the units holding these) gathered inside the block (it ignores
        stage3_max_live_parameters); a collective. Read-only unless ``modifier_rank`` names the rank whose writes
        are kept (DeepSpeed's GatheredParameters), masters included."""
        self.life.check()
        self._drain("gathering the parameters")
        self.optimizer.repair_stale()
        only = None
        if params is not None:
            wanted = {id(p) for p in params}
            only = {u.index for u in self.units for s in u.slots if id(s.param) in wanted}
        with weights.gathered_parameters(self, modifier_rank, only) as module:
            yield module
        if params is not None:
            for unit in self.units:
                unit.drop_kept(wanted)

    def load_full_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
        """Whole weights (as ``full_state_dict`` gives them) into the engine, masters included; every rank passes
        the same dict (a collective). Returns (missing, unexpected) keys."""
        self.life.check()
        self._drain("loading the state dict")
        self.optimizer.repair_stale()
        return weights.load_full_state_dict(self, state_dict, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict on the CPU, fp32 masters for trained parameters (a collective)."""
        self.life.check()
        self._drain("gathering the state dict")
        return weights.full_state_dict(self)

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the gathered compute-dtype weights (torch.save, or safetensors by the file's name); a
        collective. Returns whether it saved (see weights.save_16bit_model)."""
        self.life.check()
        self._drain("saving the 16-bit model", publish=True)  # a delayed update's last step goes out with it
        self.optimizer.repair_stale()
        return weights.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's question before it gathers a ZeRO-3 model to save it (accelerate's ``get_state_dict``)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                              ) -> dict[str, torch.Tensor]:
        """DeepSpeed's name (accelerate and transformers call it to save a ZeRO-3 model): the compute-dtype weights
        gathered on rank 0's host, ``{}`` elsewhere; a collective (see weights.consolidated_16bit_state_dict)."""
        self.life.check()
        self._drain("gathering the 16-bit state dict", publish=True)
        self.optimizer.repair_stale()
        return weights.consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    # ----------------------------------------------------------------- checkpoints (offload/engine/checkpoint_io.py)

    def write_weights(self, save_dir: str | os.PathLike[str], save_filename: str = "model.safetensors") -> None:
        """The gathered compute-dtype weights into one file whatever stage3_gather_16bit_weights_on_model_save
        says (rank 0 writes, unit by unit; a collective): what offload.hf.Trainer.save_model writes."""
        self.life.check()
        self._drain("writing the weights", publish=True)
        self.optimizer.repair_stale()
        weights.write_weights(self, save_dir, save_filename)

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | int | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True) -> str:
        """Write a checkpoint, all or nothing (a collective); returns its path. ``tag``: ``global_step<N>``."""
        tag = None if tag is None else str(tag)  # DeepSpeed's tags may be numbers
        self.life.check()
        self.accumulation.check_save()
        self._drain("saving the checkpoint", publish=True)  # parameters and masters of the same step
        self.optimizer.repair_stale()
        with self.telemetry.span("checkpoint", "save"):
            return str(checkpoint_io.save(self, save_dir, tag, client_state, save_latest))

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | int | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *, trust_client_state: bool = False
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """Resume from ``load_dir``'s ``latest`` (or ``tag``): ``(path, client_state)``, checksums first. The
        arguments in DeepSpeed's order; every key of the module is loaded (``load_module_strict`` must be True).
        Without ``tag`` and with no ``latest`` there (nothing saved yet), a warning and ``(None, None)``, as
        DeepSpeed answers, so that a script's auto-resume starts fresh. Nothing in the checkpoint is unpickled as
        an object, except the client_state values saved so when ``trust_client_state`` (see [Note: checkpoints
        run no code])."""
        if not load_module_strict:
            raise EngineError("load_checkpoint(load_module_strict=False) is not supported: offload loads every key "
                              "of the module and refuses a checkpoint that lacks one; pass load_module_strict=True")
        tag = None if tag is None else str(tag)  # DeepSpeed's tags may be numbers
        self.life.check()
        if tag is None and not checkpoint_io.found_latest(self, load_dir):
            logger.warning("load_checkpoint: %s holds no checkpoint ('latest' is missing), so nothing was loaded "
                           "and training goes on from the engine's state; pass tag= to load a specific one",
                           os.fspath(load_dir))
            return None, None
        self._drain("loading the checkpoint")
        with self.telemetry.span("checkpoint", "load"):
            path, client_state = checkpoint_io.load(self, load_dir, tag, load_optimizer_states,
                                             load_lr_scheduler_states, load_module_only, trust_client_state)
        self.optimizer.drop_pending()  # a delayed update staged before the load is not the loaded state's
        return str(path), client_state

    def train_state(self) -> dict[str, Any]:
        """The training loop's counters and the loss scale: what a checkpoint keeps besides the arrays (the way
        torch's DCP ``Stateful`` gives it)."""
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "global_samples": self.global_samples,
                "micro_steps": self.accumulation.micro_steps, "loss_scaler": self.loss_scaler.state_dict()}

    def load_train_state(self, state: dict[str, Any]) -> None:
        """Restore ``train_state()``; gradients accumulated since the last step are dropped."""
        self.discard_gradients()
        self.global_steps, self.skipped_steps = state["global_steps"], state["skipped_steps"]
        # a checkpoint written before global_samples was kept: the steps at this run's batch size
        self.global_samples = state.get("global_samples", self.global_steps * self.train_batch_size())
        self.accumulation.micro_steps = state["micro_steps"]
        self.loss_scaler.load_state_dict(state["loss_scaler"])
