"""The training engine: forward, backward and step of a ZeRO model (stages 0-3), in DeepSpeed's call shape.

``engine.backward(loss)`` scales the loss (by the fp16 loss scale and 1 /
gradient_accumulation_steps, as DeepSpeed does); the units' gradients are
reduce-scattered and streamed into the fp32 accumulators while backward runs.
``engine.step()`` applies the update only at an accumulation boundary: it waits for
the gradient stream, takes the global norm (one native read per shard, one
all-reduce), skips the step on an fp16 overflow, and otherwise runs Adam with the
unscale and the clip folded into one gradient factor. What the stage changes is in
offload/zero/stage.py; what the engine is made of, in build.py beside this file; where
it stands between steps, in accumulation.py.

[Note: one rank's failed step] With several ranks, one whose step fails must neither
leave the others waiting in a collective it will never join nor let them commit a step
it could not. Two agreements carry it. (1) What the step checks and waits for before
the norm (a gradient for every trained parameter, unless ignore_unused_parameters; the
gradients landing; the last step's work on host threads: an early NVMe pass that was
lost, a delayed update) may fail on one rank: that rank still joins the norm's
all-reduce, with a flag in it instead of its norm, and then every rank raises (it, its
error; the others, an EngineError saying another rank failed, after dropping the step's
gradients; where this rank had already stepped shards during backward, overlapped, it
says its step is half applied instead). This costs nothing: the all-reduce happens anyway
(at stage 0, whose norm needs no sum over the ranks, the same all-reduce sums the flag
alone, with the order check of [Note: gradient reduction order] in
offload/zero/runtime.py, which it carries at every stage). (2) With the optimizer
state on NVMe, a transfer may fail inside the step. Every rank votes once at the
commit point (every write done, no slot current yet, no host state touched): yes
there, no from its failure path (offload/zero/collectives.py's ``Vote``). A refused
vote aborts the pass as the rank's own failure would, so every rank keeps its last
step and this step's gradients, and step() called again on every rank retries it.
That is one more scalar all-reduce per step, only with NVMe state and several ranks.
The other collectives that follow a drain (checkpoints, state dicts, gathered
parameters) agree on it with one all_ok first.

[Note: one rank's failed pass] A forward or backward that raises on one rank part way
(a parameter read from NVMe failed, a batch only this rank has broke the model) is
different: the other ranks are inside the same pass, in or on their way to its
collectives (ZeRO-3's gathers, backward's reductions), and the failed rank's next
collective would pair with one of theirs. Gloo then fails on a size mismatch or, where
the sizes agree (transformer blocks are alike), hands one unit's shards to another:
wrong weights, silently. So with other ranks and collectives in the pass, the engine
takes no more work after such a failure (every call but close() raises, saying why),
and the error itself carries a note that says so; the job restarts every rank from the
last checkpoint (torchrun tears the others down when this one exits). With one rank,
or a pass without collectives (stages 0-2's forward, a backward that only accumulates),
the engine stays usable, as before.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from offload import checkpointing
from offload.accelerator import Accelerator, to_device
from offload.config import Config
from offload.engine import memory, saving, weights
from offload.engine.accumulation import Accumulation, Phase
from offload.engine.build import build
from offload.engine import errors
from offload.engine.errors import EngineError
from offload.optim.loss_scale import LossScaler, gradient_factor, unclipped_factor
from offload.pretrained import PretrainedWeights
from offload.store.param_swap import ParamSwapError
from offload.sync_ledger import Role, acting_as
from offload.telemetry import PhaseReport
from offload.zero.collectives import Group, ReductionOrder, Vote, all_ok, all_reduce_sum
from offload.zero.stage import Stage

logger = logging.getLogger("offload.engine")


class Engine:
    """A model sharded over the data-parallel group with its optimizer; see ``offload.initialize``."""

    def __init__(self, model: nn.Module, config: Config, param_groups: list[dict[str, Any]], adamw_mode: bool,
                 bias_correction: bool, group: Group, accel: Accelerator, lr_scheduler: Any = None,
                 pretrained: PretrainedWeights | None = None) -> None:
        self.config = config
        self.group = group
        self.stage = Stage(config.zero_optimization.stage)
        self.partition = self.stage.partition(group)  # what a unit's flat buffer is split over
        self.accel = accel
        self.compute_dtype = torch.bfloat16 if config.bf16.enabled is True else (
            torch.float16 if config.fp16.enabled is True else torch.float32)
        self.accumulation = Accumulation(int(config.gradient_accumulation_steps or 1))
        self._clip = float(config.gradient_clipping or 0.0)
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.global_steps = self.skipped_steps = 0
        self._closed = False
        self._out_of_step: str | None = None  # why this rank's collectives are out of step with the others'
        self.last_grad_norm: float | None = None
        parts = build(model, config, param_groups, adamw_mode=adamw_mode, bias_correction=bias_correction,
                      group=group, stage=self.stage, accel=accel, compute_dtype=self.compute_dtype,
                      lr_scheduler=lr_scheduler, pretrained=pretrained)
        self.module = model
        self.units, self.params, self.optimizer = parts.units, parts.params, parts.optimizer
        self.runtime, self.activations, self.memory = parts.runtime, parts.activations, parts.memory
        self.telemetry, self._swaps, self._trained_names = parts.telemetry, parts.swaps, parts.trained_names
        self.schedule, self.lr_scheduler = parts.schedule, parts.lr_scheduler
        self._warned_zero_grad = False  # zero_grad() mid-accumulation: said once
        self.params.repair = self._repair_params  # a stale NVMe shard met inside a forward is rewritten there
        self.step_mode = self.schedule.describe()
        self._phases = PhaseReport(self.telemetry) if config.wall_clock_breakdown else None
        if config.dump_state:
            logger.info("engine state at start (dump_state), rank %d:\n%s\nstep mode: %s\nconfig: %s", group.rank,
                        self.memory_report(), self.step_mode, config.to_json(indent=None))

    # ----------------------------------------------------------------- memory

    def memory_summary(self) -> dict[str, dict[str, int]]:
        """Bytes per tier on this rank, by what holds them, from the engine's own accounting."""
        acts = self.activations
        return self.memory.summary((self.runtime.live, self.runtime.peak_live),
                                   (acts.device_bytes, acts.peak_device_bytes) if acts.saves else None)

    def memory_report(self) -> str:
        return memory.report(self.memory_summary(), self.group.rank, self.accel.device)

    # ----------------------------------------------------------------- training loop

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; tensors in the inputs (also inside lists, tuples and dicts) that sit on
        another device are moved to the compute device first, as FSDP does, so a CPU batch just works (floating
        ones keep their dtype unless fp16.auto_cast)."""
        self._check_open()
        self.accel.graph.mark("forward")
        self._repair_params()
        self.runtime.begin_iteration()
        cast = torch.float16 if self.compute_dtype == torch.float16 and self.config.fp16.auto_cast else None
        args, kwargs = to_device((args, kwargs), self.accel.device, cast)
        try:
            with self.telemetry.span("forward"), acting_as(Role.FORWARD):
                return self.module(*args, **kwargs)
        except BaseException as e:
            self._left_collectives("forward", e, collectives=not self.stage.resident_params)
            if not isinstance(e, RuntimeError):
                raise
            if "storage of size 0" in str(e) or "data is not allocated" in str(e):
                raise errors.released_parameter_read([u.name for u in self.units]) from e
            hint = errors.input_dtype_hint(str(e), self.compute_dtype, (args, kwargs))
            if hint and hasattr(e, "add_note"):  # Python 3.11+: the error stays torch's, with what to do
                e.add_note(hint)
            raise

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled by loss_scale / gradient_accumulation_steps (``scale_wrt_gas`` false: by
        loss_scale only, for a caller that scaled it already, as DeepSpeed's flag); returns ``loss``."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EngineError(f"backward() takes the scalar loss tensor, got "
                              f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise EngineError("the loss does not require grad: was the forward run under torch.no_grad(), or are "
                              "all parameters frozen?")
        self.accel.graph.mark("backward")
        scale = self.loss_scaler.scale / (self.accumulation.steps if scale_wrt_gas else 1)
        last_micro = self.accumulation.next_is_last()
        self.runtime.reduce_grads = last_micro or self.stage.reduce_every_micro_batch
        overlapped = last_micro and self.schedule.last_backward_begins(self.optimizer, self.loss_scaler.scale,
                                                                         only=self.accumulation.pending == 0)
        try:
            with self.telemetry.span("backward"):
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException as e:
            self._left_collectives("backward", e,
                                   collectives=not self.stage.resident_params or self.runtime.reduce_grads)
            self.runtime.abort_backward()
            self.activations.discard()
            if not self.stage.reduce_every_micro_batch and self.accumulation.pending:
                # Stages 0-1 keep the earlier micro-batches' gradients in .grad, which the failed pass mixed with
                # its own: the whole accumulation is dropped, and the next backward starts a new one.
                logger.warning("backward failed: the %d earlier micro-batch(es) of this step are dropped too (ZeRO "
                               "stage %d accumulates them in .grad)", self.accumulation.pending, self.stage.number)
                self.zero_grad()
            if overlapped and self.optimizer.abandon_overlap():
                raise errors.half_applied_step() from e
            raise
        self.accumulation.add()
        return loss

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """``True``: the coming backward ends the accumulation, with fewer micro-batches than
        gradient_accumulation_steps if so (the last batches of an epoch); scale that loss yourself and pass
        ``scale_wrt_gas=False``. DeepSpeed's method of the same name."""
        self._check_open()
        self.accumulation.end_early(is_boundary)

    # The batch as DeepSpeed's engine answers it: methods, as there.
    def gradient_accumulation_steps(self) -> int:
        return self.accumulation.steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu  # type: ignore[return-value]  # resolved: a number

    def train_batch_size(self) -> int:
        return self.config.train_batch_size  # type: ignore[return-value]  # resolved: a number

    def gradient_clipping(self) -> float:
        return self._clip

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm, before clipping (inf after an fp16 overflow)."""
        return self.last_grad_norm

    def zero_optimization_stage(self) -> int:
        return self.stage.number

    def bf16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    @property
    def global_rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world

    @property
    def device(self) -> torch.device:
        return self.accel.device

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends the accumulation (DeepSpeed's meaning): the one whose backward ran
        until step() is called, the coming one before its forward."""
        return self.accumulation.current_ends()

    @property
    def micro_steps(self) -> int:
        return self.accumulation.micro_steps

    def step(self) -> None:
        """Apply the update at an accumulation boundary (a no-op between micro-batches, as in DeepSpeed)."""
        self._check_open()
        if not self.accumulation.take():
            return
        self.accel.graph.mark("step")
        order = self.runtime.order.take()  # before anything below can drop the gradients (zero_grad)
        failed: Exception | None = None
        try:
            if not self.config.zero_optimization.ignore_unused_parameters:  # as DeepSpeed, before anything applies
                unused = [name for key, name in self._trained_names.items() if key not in self.runtime.got_grad]
                if unused:
                    self.zero_grad()
                    raise errors.unused_parameters(self.group.rank, unused)
            self.activations.discard()  # inputs saved by a forward whose backward never ran
            self.optimizer.landing.send_held()  # device-accumulated sums the last micro-batch did not send
            with self.telemetry.span("grad_wait"):  # the landings; the step claims each speculation in turn
                self.optimizer.drain(speculation=False)
            self.optimizer.publish()  # the last delayed update reaches the parameters (see [Note: delayed update])
        except Exception as e:  # noqa: BLE001 - raised once every rank knows (see [Note: one rank's failed step])
            failed = e
        sum_sq, nonfinite, peers_failed, in_order = self._global_grad_sq_norm(failed is not None, order)
        if failed is not None:
            raise failed
        if peers_failed or not in_order:
            # Shards stepped during backward (overlap) moved on: this rank's step is half applied, not undone.
            half = self.schedule.stepped_in_backward and self.optimizer.abandon_overlap() > 0
            self.zero_grad()  # as the failed rank's step, this one's is gone; the next backward starts afresh
            if peers_failed:
                raise errors.peer_step_failed(self.group.rank, self.global_steps + 1, retryable=False,
                                              half_applied=half)
            raise errors.reductions_out_of_order(self.group.rank, self.global_steps + 1, half_applied=half)
        scale = self.loss_scaler.scale
        self.global_steps += 1
        if nonfinite > 0 and self.compute_dtype == torch.float16:
            self.schedule.norm_known(clipped=True)
            self.skipped_steps += 1
            self.last_grad_norm = math.inf
            self.loss_scaler.update(overflow=True)
            logger.info("step %d: fp16 gradients overflowed; step skipped, loss scale now %g", self.global_steps,
                        self.loss_scaler.scale)
            self.optimizer.clear_grads()
            self.runtime.got_grad.clear()
            self._report_every_steps_per_print()
            return
        self.last_grad_norm, grad_scale = gradient_factor(sum_sq, nonfinite, scale, self._clip)
        self.schedule.norm_known(clipped=grad_scale != unclipped_factor(scale))
        self.runtime.reshard_all()
        behind: ParamSwapError | None = None
        try:
            with self.telemetry.span("optimizer", "adam"):
                self.schedule.apply(self.optimizer, grad_scale, self.global_steps, self._commit_vote)
        except ParamSwapError as e:
            # The optimizer state moved on; only some 16-bit copies on NVMe are behind (stale), and they are
            # rewritten from the master weights before anything reads them: the step counts.
            behind = e
        except BaseException:
            # The state of the last completed step is intact (see the store's notes); so are the accumulated
            # gradients, so fixing the cause (a full disk, say) and calling step() again retries this step.
            self.global_steps -= 1
            self.accumulation.retry()  # got_grad is kept: the retry's check of unused parameters sees the same
            raise
        self.runtime.got_grad.clear()
        if self.stage.resident_params:
            self.runtime.spread_partitions()
        self.loss_scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():
                # A torch schedule counts optimizer.step() calls to warn of a wrong order; Adam ran above through
                # the engine, not through step(), so that warning would be false.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.lr_scheduler.step()
        self._report_every_steps_per_print()
        if behind is not None:
            raise errors.params_behind(self.global_steps, behind.strerror) from behind
        self.runtime.read_ahead_first()

    def _global_grad_sq_norm(self, failed: bool, order: list[float]) -> tuple[float, int, bool, bool]:
        """The sum of squared gradients and the count of non-finite ones over every partition, whether another
        rank ``failed`` before its norm (see [Note: one rank's failed step]; a rank that failed adds nothing to the
        norm), and whether every rank issued its reductions in the same ``order`` (``ReductionOrder.take``)."""
        with self.telemetry.span("optimizer", "norm"):
            totals = torch.tensor([0.0, 0.0, 1.0 if failed else 0.0, *order], dtype=torch.float64,
                                  device=self.accel.device)
            if not failed:
                sum_sq, nonfinite = self.optimizer.grad_sq_norm()  # host shards' parts, mostly taken as they landed
                totals[0], totals[1] = sum_sq, float(nonfinite)
                on_device = self.optimizer.device_grad_sq_norm()
                if on_device is not None:
                    totals[:2] += on_device
            if self.partition.world < self.group.world:
                # Stage 0: every rank holds the whole gradient already, so only the failure flag (a parameter
                # unused here fails only this rank) and the reductions' order are summed over the ranks.
                all_reduce_sum(totals[2:], self.group)
            else:
                all_reduce_sum(totals, self.partition)
            sum_sq, nonfinite, failures, *summed = self.accel.read_scalars(totals, "global gradient norm")  # one sync
            in_order = ReductionOrder.agreed(summed, self.group.world)
            return sum_sq, int(nonfinite), failures > 0, in_order

    def _commit_vote(self) -> Vote | None:
        """The ranks' vote at the step's commit point, where a step can fail before it (optimizer state on NVMe)
        and there are other ranks (see [Note: one rank's failed step])."""
        if self.partition.world == 1 or self.config.zero_optimization.offload_optimizer.device != "nvme":
            return None
        rank, step = self.group.rank, self.global_steps
        return Vote(self.partition, self.accel.device, lambda: errors.peer_step_failed(rank, step, retryable=True))

    def _drain(self, before: str, publish: bool = False) -> None:
        """Every gradient landed and every step handed to a host thread done (``publish``: and the last delayed
        update published), agreed by every rank (see [Note: one rank's failed step]); ``before``: the collective
        a rank that failed here would leave the others in."""
        if self.group.world == 1 or not self.optimizer.offload:  # nothing of it can fail on one rank alone
            if publish:
                self.optimizer.publish()
            self.optimizer.drain()
            return
        error: Exception | None = None
        try:
            if publish:
                self.optimizer.publish()
            self.optimizer.drain()
        except Exception as e:  # noqa: BLE001 - raised once every rank knows
            error = e
        if not all_ok(error is None, self.group, self.accel.device):
            raise error or errors.peer_failed_before(self.group.rank, before)

    def _report_every_steps_per_print(self) -> None:
        """wall_clock_breakdown and memory_breakdown: one log line each every steps_per_print steps."""
        every = self.config.steps_per_print
        if self.global_steps % every:
            return
        if self._phases is not None:
            logger.info("step %d, rank %d: %s", self.global_steps, self.group.rank, self._phases.line(every))
        if self.config.memory_breakdown:
            logger.info("step %d: %s", self.global_steps, self.memory_report())

    def _repair_params(self) -> None:
        """Rewrite NVMe parameter shards a failed write left behind their master weights (see
        [Note: parameter slots] in offload/store/param_swap.py)."""
        stale = self.params.stale()
        if stale:  # an early step may still be writing other units through the same buffers: let it finish
            self.optimizer.drain()
            stale = self.params.stale()
        for unit in self.units:
            if unit.index in stale:
                self.params.overwrite(unit.index, self.optimizer.master_of(unit.index))
                logger.info("rewrote unit %s's parameter shard on NVMe from its master weights", unit.name)

    def zero_grad(self) -> None:
        """Discard gradients accumulated since the last step (a no-op right after one). DeepSpeed's keeps them, so
        a loop that zeroes before every micro-batch would never reach a step here: that is said, once."""
        acc = self.accumulation
        if acc.phase is Phase.COLLECTING and not self._warned_zero_grad:
            self._warned_zero_grad = True
            logger.warning("engine.zero_grad() discarded the gradients of %d of %d micro-batches before the "
                           "accumulation ended, so no step follows them (DeepSpeed's zero_grad keeps them); "
                           "engine.step() clears gradients at the boundary itself: call zero_grad() only to drop "
                           "them (said once)", acc.pending, acc.steps)
        self.optimizer.clear_grads()
        self.runtime.clear_param_grads()
        self.runtime.got_grad.clear()
        self.runtime.order.take()
        self.accumulation.clear()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def peak_live_parameters(self) -> int:
        """The most parameter elements this rank held gathered at once (the engine's own accounting)."""
        return self.runtime.peak_live

    # ----------------------------------------------------------------- whole weights (offload/engine/weights.py)

    @contextlib.contextmanager
    def gathered_parameters(self, modifier_rank: int | None = None) -> Iterator[nn.Module]:
        """Every unit gathered inside the block (it ignores stage3_max_live_parameters); a collective. Read-only
        unless ``modifier_rank`` names the rank whose writes are kept (DeepSpeed's GatheredParameters), masters
        included."""
        self._check_open()
        self._drain("gathering the parameters")
        self._repair_params()
        with weights.gathered_parameters(self, modifier_rank) as module:
            yield module

    def load_full_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
        """Whole weights (as ``full_state_dict`` gives them) into the engine, masters included; every rank passes
        the same dict (a collective). Returns (missing, unexpected) keys."""
        self._check_open()
        self._drain("loading the state dict")
        self._repair_params()
        return weights.load_full_state_dict(self, state_dict, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict on the CPU, fp32 masters for trained parameters (a collective)."""
        self._check_open()
        self._drain("gathering the state dict")
        return weights.full_state_dict(self)

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the gathered compute-dtype weights (torch.save, or safetensors by the file's name); a
        collective. Returns whether it saved (see weights.save_16bit_model)."""
        self._check_open()
        self._drain("saving the 16-bit model", publish=True)  # a delayed update's last step goes out with it
        self._repair_params()
        return weights.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # ----------------------------------------------------------------- checkpoints (offload/engine/saving.py)

    def write_weights(self, save_dir: str | os.PathLike[str], save_filename: str = "model.safetensors") -> None:
        """The gathered compute-dtype weights into one file whatever stage3_gather_16bit_weights_on_model_save
        says (rank 0 writes, unit by unit; a collective): what offload.hf.Trainer.save_model writes."""
        self._check_open()
        self._drain("writing the weights", publish=True)
        self._repair_params()
        weights.write_weights(self, save_dir, save_filename)

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | int | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True) -> str:
        """Write a checkpoint, all or nothing (a collective); returns its path. ``tag``: ``global_step<N>``."""
        tag = None if tag is None else str(tag)  # DeepSpeed's tags may be numbers
        self._check_open()
        self.accumulation.check_save()
        self._drain("saving the checkpoint", publish=True)  # parameters and masters of the same step
        self._repair_params()
        with self.telemetry.span("checkpoint", "save"):
            return str(saving.save(self, save_dir, tag, client_state, save_latest))

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | int | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
        """Resume from ``load_dir``'s ``latest`` (or ``tag``): ``(path, client_state)``, checksums first. The
        arguments in DeepSpeed's order; every key of the module is loaded (``load_module_strict`` must be True)."""
        if not load_module_strict:
            raise EngineError("load_checkpoint(load_module_strict=False) is not supported: offload loads every key "
                              "of the module and refuses a checkpoint that lacks one; pass load_module_strict=True")
        tag = None if tag is None else str(tag)  # DeepSpeed's tags may be numbers
        self._check_open()
        self._drain("loading the checkpoint")
        with self.telemetry.span("checkpoint", "load"):
            path, client_state = saving.load(self, load_dir, tag, load_optimizer_states,
                                             load_lr_scheduler_states, load_module_only)
        self.optimizer.drop_pending()  # a delayed update staged before the load is not the loaded state's
        return str(path), client_state

    def train_state(self) -> dict[str, Any]:
        """The training loop's counters and the loss scale: what a checkpoint keeps besides the arrays (the way
        torch's DCP ``Stateful`` gives it)."""
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps, "loss_scaler": self.loss_scaler.state_dict()}

    def load_train_state(self, state: dict[str, Any]) -> None:
        """Restore ``train_state()``; gradients accumulated since the last step are dropped."""
        self.zero_grad()
        self.global_steps, self.skipped_steps = state["global_steps"], state["skipped_steps"]
        self.accumulation.micro_steps = state["micro_steps"]
        self.loss_scaler.load_state_dict(state["loss_scaler"])

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Remove every hook and free every buffer; the engine cannot be used after."""
        if self._closed:
            return
        self.runtime.close()
        self.activations.close()
        checkpointing.reset()
        self.optimizer.close()
        self.params.close()
        self._swaps.close()
        for unit in self.units:
            unit.close()
        self.accel.close()
        self._closed = True

    def _left_collectives(self, where: str, error: BaseException, collectives: bool) -> None:
        """``where`` raised on this rank: with other ranks and collectives in that pass, the others go on without
        it, so the ranks' collectives are out of step and the engine takes no more work (see [Note: one rank's
        failed pass])."""
        if self.group.world == 1 or not collectives or self._out_of_step is not None:
            return
        self._out_of_step = errors.out_of_step(self.group.rank, where, error)
        if hasattr(error, "add_note"):
            error.add_note(f"offload: {self._out_of_step}")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("this engine was closed; create a new one with offload.initialize")
        if self._out_of_step is not None:
            raise EngineError(self._out_of_step)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
