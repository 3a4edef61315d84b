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

How one rank's failure reaches the others (a failed step, a failed pass) is offload/engine/
agreement.py's, with its notes: [Note: one rank's failed step], [Note: one rank's failed pass].
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from offload import checkpointing
from offload.config import Config
from offload.config.fields import resolved
from offload.engine import agreement, errors, memory
from offload.engine.accessors import DeepSpeedAccessors
from offload.engine.accumulation import Accumulation, Phase
from offload.engine.build import OptimizerChoice, build
from offload.engine.compiling import Compiling
from offload.engine.errors import EngineError
from offload.engine.lending import StateLending
from offload.engine.life import Lifetime
from offload.engine.model_zero_grad import ModelZeroGrad
from offload.engine.persistence import Persistence
from offload.engine.stopping import Stoppable, StopRequest
from offload.files.pretrained import PretrainedWeights
from offload.machine.accelerator import Accelerator, to_device
from offload.observe.sync_ledger import Role, acting_as
from offload.observe.telemetry import PhaseReport
from offload.optim.loss_scale import LossScaler, gradient_factor, unclipped_factor
from offload.store.param_swap import ParamSwapError
from offload.zero.collectives import Group
from offload.zero.parameter_offload import ParameterOffload
from offload.zero.plan import ENGINE
from offload.zero.stage import Stage

logger = logging.getLogger("offload.engine")


class Engine(DeepSpeedAccessors, Persistence, Stoppable, Compiling, StateLending):
    """A model sharded over the data-parallel group with its optimizer; see ``offload.initialize``."""

    def __init__(self, model: nn.Module, config: Config, choice: OptimizerChoice, group: Group, accel: Accelerator,
                 pretrained: PretrainedWeights | None = None) -> None:
        self.config = config
        self.group = group
        self.stage = Stage(config.zero_optimization.stage)
        self.partition = self.stage.partition(group)  # what a unit's flat buffer is split over
        self.accel = accel
        self.compute_dtype = torch.bfloat16 if config.bf16.enabled is True else (
            torch.float16 if config.fp16.enabled is True else torch.float32)
        self.accumulation = Accumulation(int(resolved(config.gradient_accumulation_steps) or 1))
        self._clip = float(resolved(config.gradient_clipping) or 0.0)
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.global_steps = self.skipped_steps = self.global_samples = 0
        self.step_applied = False  # the last step() changed the weights (was_step_applied)
        self.life = Lifetime(group.rank, group.world)
        self.trains = bool(choice.param_groups)  # an engine without an optimizer runs forward only (ZeRO-Inference)
        self.stop = StopRequest()  # see [Note: stopping at an agreed step] in engine/stopping.py
        self.last_grad_norm: float | None = None
        parts = build(model, config, choice, group=group, stage=self.stage, accel=accel,
                      compute_dtype=self.compute_dtype, pretrained=pretrained)
        self.module = model
        self.units, self.params, self.optimizer = parts.units, parts.params, parts.optimizer
        self.landing, self.optimizer.loss_scaler = parts.landing, self.loss_scaler
        if self.stage.number == 3:
            self.optimizer.parameter_offload = ParameterOffload(model)
        for slot in (s for u in self.units for s in u.slots):  # deepspeed.utils' helpers find the engine by it
            setattr(slot.param, ENGINE, weakref.ref(self))
        self.runtime, self.activations, self.memory = parts.runtime, parts.activations, parts.memory
        self.telemetry, self._swaps, self._trained_names = parts.telemetry, parts.swaps, parts.trained_names
        self.schedule, self.lr_scheduler, self.refit = parts.schedule, parts.lr_scheduler, parts.refit
        self._warned_zero_grad = False  # zero_grad() mid-accumulation: said once
        # the model's own zero_grad(), told to the engine (see [Note: the model's own zero_grad])
        self._model_zero_grad = ModelZeroGrad(self) if self.trains else None
        self.step_mode = self.schedule.describe()  # with the reasons; step_brief: the few words
        self.step_brief = self.schedule.brief()
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
        self.life.check()
        self.accel.graph.mark("forward")
        self.optimizer.repair_stale()
        self.runtime.begin_iteration()
        cast = torch.float16 if self.compute_dtype == torch.float16 and self.config.fp16.auto_cast else None
        args, kwargs = to_device((args, kwargs), self.accel.device, cast)
        try:
            with self.telemetry.span("forward"), acting_as(Role.FORWARD):
                return self.module(*args, **kwargs)
        except BaseException as e:
            self.life.left_collectives("forward", e, collectives=not self.stage.resident_params)
            if not isinstance(e, RuntimeError):
                raise
            if errors.reads_a_released_parameter(str(e)):
                raise errors.released_parameter_read([u.name for u in self.units]) from e
            hint = errors.input_dtype_hint(str(e), self.compute_dtype, (args, kwargs))
            if hint and hasattr(e, "add_note"):  # Python 3.11+: the error stays torch's, with what to do
                e.add_note(hint)
            raise

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled by loss_scale / gradient_accumulation_steps (``scale_wrt_gas`` false: by
        loss_scale only, for a caller that scaled it already, as DeepSpeed's flag); returns ``loss``."""
        self.life.check()
        if not self.trains:
            raise errors.no_optimizer("backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EngineError(f"backward() takes the scalar loss tensor, got "
                              f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise EngineError("the loss does not require grad: was the forward run under torch.no_grad(), or are "
                              "all parameters frozen?")
        acc = self.accumulation
        if acc.next_adds_past_boundary() and self.schedule.stepped_in_backward:
            raise errors.backward_after_update_began(acc.pending + 1, acc.calls_per_step)
        self.accel.graph.mark("backward")
        scale = self.loss_scaler.scale / (acc.steps if scale_wrt_gas else 1)
        last_micro = acc.next_is_last()  # past the boundary too: see [Note: more backward calls than micro-batches]
        reduce = last_micro or self.stage.reduce_every_micro_batch
        self.runtime.backward.announce(reduce)
        overlapped = last_micro and self.schedule.last_backward_begins(
            self.optimizer, self.loss_scaler.scale, only=acc.next_is_only(), sure=acc.next_surely_last())
        try:
            with self.telemetry.span("backward"):
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException as e:
            self.life.left_collectives("backward", e, collectives=not self.stage.resident_params or reduce)
            self.runtime.backward.returned()
            self.runtime.abort_backward()
            self.activations.discard()
            # What the pass reduced before it broke is in the gradients already (in .grad at stages 0-1, in the
            # shards' accumulators or kept gradients at 2-3) and would add to the retry's: the step's gradients are
            # dropped, the earlier micro-batches' with them, and the next backward starts a new accumulation.
            if self.accumulation.pending:
                logger.warning("backward failed: the %d earlier micro-batch(es) of this step are dropped too (the "
                               "failed pass's gradients were added to theirs)", self.accumulation.pending)
            self.discard_gradients()
            if overlapped and self.optimizer.abandon_overlap():
                raise errors.half_applied_step() from e
            raise
        self.runtime.backward.returned()
        self.accumulation.add()
        return loss

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """``True``: the coming backward ends the accumulation, with fewer micro-batches than
        gradient_accumulation_steps if so (the last batches of an epoch); scale that loss yourself and pass
        ``scale_wrt_gas=False``. DeepSpeed's method of the same name."""
        self.life.check()
        self.accumulation.end_early(is_boundary)

    def step(self) -> None:
        """Apply the update at an accumulation boundary (a no-op between micro-batches, as in DeepSpeed)."""
        self.life.check()
        if not self.trains:
            raise errors.no_optimizer("step()")
        self.step_applied = False
        if not self.accumulation.take():
            return
        self.accel.graph.mark("step")
        order = self.runtime.take_order()  # before anything below can drop the gradients (discard_gradients)
        failed: Exception | None = None
        try:
            if not self.config.zero_optimization.ignore_unused_parameters:  # as DeepSpeed, before anything applies
                unused = self.runtime.without_grad(self._trained_names)
                if unused:
                    self.discard_gradients()
                    raise errors.unused_parameters(self.group.rank, unused)
            self.activations.discard()  # inputs saved by a forward whose backward never ran
            self.landing.send_held()  # device-accumulated sums the last micro-batch did not send
            with self.telemetry.span("grad_wait"):  # the landings; the step claims each speculation in turn
                self.optimizer.drain(speculation=False, copies_back=False)
            # The last delayed update reaches the parameters (see [Note: delayed update] in optim/early_step.py).
            self.optimizer.publish()
        except Exception as e:  # noqa: BLE001 - raised once every rank knows (see [Note: one rank's failed step])
            failed = e
        sum_sq, nonfinite, peers_failed, in_order, stop = agreement.global_grad_sq_norm(
            self.optimizer, self.group, self.partition, self.accel, self.telemetry, failed is not None, order,
            self.stop.requested)
        if failed is not None:
            raise failed
        if peers_failed or not in_order:
            # Shards stepped during backward (overlap) moved on: this rank's step is half applied, not undone.
            half = self.schedule.stepped_in_backward and self.optimizer.abandon_overlap() > 0
            self.discard_gradients()  # as the failed rank's step, this one's is gone; the next backward starts afresh
            if peers_failed:
                raise errors.peer_step_failed(self.group.rank, self.global_steps + 1, retryable=False,
                                              half_applied=half)
            raise errors.reductions_out_of_order(self.group.rank, self.global_steps + 1, half_applied=half)
        scale = self.loss_scaler.scale
        self.global_steps += 1
        self.optimizer.stepped()
        self.global_samples += self.train_batch_size()  # DeepSpeed counts the skipped steps' too
        self.optimizer.overflow = nonfinite > 0 and self.compute_dtype == torch.float16
        if self.optimizer.overflow:
            self.schedule.norm_known(clipped=True)
            self.skipped_steps += 1
            self.last_grad_norm = math.inf
            self.loss_scaler.update(overflow=True)
            logger.info("step %d: fp16 gradients overflowed; step skipped, loss scale now %g", self.global_steps,
                        self.loss_scaler.scale)
            self.optimizer.clear_grads()
            self.runtime.step_taken()
            self._report_every_steps_per_print()
            self._stop_if_agreed(stop)
            return
        self.last_grad_norm, grad_scale = gradient_factor(sum_sq, nonfinite, scale, self._clip)
        if not self.config.zero_optimization.compute_grad_norm:
            self.last_grad_norm = None  # as DeepSpeed's get_global_grad_norm answers (the finite check still ran)
        self.schedule.norm_known(clipped=grad_scale != unclipped_factor(scale))
        self.runtime.reshard_all()
        behind: ParamSwapError | None = None
        finished = False
        try:
            with self.telemetry.span("optimizer", "adam"):
                nvme = self.config.zero_optimization.offload_optimizer.device == "nvme"
                vote = agreement.commit_vote(nvme, self.partition, self.group, self.accel, self.global_steps)
                finished = self.schedule.apply(self.optimizer, grad_scale, self.global_steps, vote)
        except ParamSwapError as e:
            # The optimizer state moved on; only some 16-bit copies on NVMe are behind (stale), and they are
            # rewritten from the master weights before anything reads them: the step counts.
            behind = e
        except BaseException:
            # The state of the last completed step is intact (see the store's notes); so are the accumulated
            # gradients, so fixing the cause (a full disk, say) and calling step() again retries this step.
            self.global_steps -= 1
            self.global_samples -= self.train_batch_size()
            self.accumulation.retry()  # got_grad is kept: the retry's check of unused parameters sees the same
            raise
        self.runtime.step_taken()
        self.step_applied = True
        if self.stage.resident_params:
            self.runtime.spread_partitions()
        if finished:
            self.runtime.refresh_kept()
        else:
            self.runtime.kept_stale()
        self.loss_scaler.update(overflow=False)
        self.refit.after_step()  # auto's split, once, by the first step's measured peak
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():
                # A torch schedule counts optimizer.step() calls to warn of a wrong order; Adam ran above through
                # the engine, not through step(), so that warning would be false.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                self.lr_scheduler.step()
        self._report_every_steps_per_print()
        self._stop_if_agreed(stop)
        if behind is not None:
            raise errors.params_behind(self.global_steps, behind.strerror) from behind
        self.runtime.read_ahead_first()

    def _drain(self, before: str, publish: bool = False) -> None:
        agreement.drained(self.optimizer, self.group, self.accel, before, publish)

    def _report_every_steps_per_print(self) -> None:
        """wall_clock_breakdown and memory_breakdown: one log line each every steps_per_print steps."""
        every = self.config.steps_per_print
        if every is None or self.global_steps % every:
            return
        if self._phases is not None:
            logger.info("step %d, rank %d: %s", self.global_steps, self.group.rank, self._phases.line(every))
        if self.config.memory_breakdown:
            logger.info("step %d: %s", self.global_steps, self.memory_report())

    def zero_grad(self) -> None:
        """DeepSpeed's: clears ``.grad``, which keeps an unfinished accumulation (see [Note: zero_grad between
        micro-batches]). ``discard_gradients`` drops it."""
        acc = self.accumulation
        if acc.phase is not Phase.COLLECTING:
            self.discard_gradients()
            return
        if self.stage.reduce_every_micro_batch:
            return  # stages 2-3: the earlier micro-batches are already reduced into the shards, as in DeepSpeed
        self.runtime.clear_held_grads()
        if not self._warned_zero_grad:
            self._warned_zero_grad = True
            logger.warning("engine.zero_grad() between micro-batches at ZeRO stage %d dropped the gradients of the "
                           "%d earlier micro-batch(es) of %d, as DeepSpeed's does at stages 0-1 (they are kept in "
                           ".grad until the boundary; stages 2-3 keep them): the step applies only the later ones. "
                           "Call zero_grad() after engine.step() instead (said once)", self.stage.number,
                           acc.pending, acc.steps)

    def discard_gradients(self) -> None:
        """Drop every gradient since the last step, however many micro-batches are in; the next backward starts a
        new accumulation (a batch skipped by not stepping; a load; a failed step)."""
        self.optimizer.clear_grads()
        self.runtime.drop_grads()
        self.accumulation.clear()

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Remove every hook and free every buffer; the engine cannot be used after."""
        if not self.life.close():
            return
        if self._model_zero_grad is not None:
            self._model_zero_grad.close()
        self.runtime.close()
        self.activations.close()
        checkpointing.reset()
        self.optimizer.close()
        self.params.close()
        self._swaps.close()
        for unit in self.units:
            unit.close()
        self.accel.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
