"""The optimizer over this rank's shards: fp32 master, Adam moments and gradient accumulator per unit.

With ``offload_optimizer.device: cpu`` all of it lives in host memory and the step
is the native CPU Adam; otherwise it lives on the compute device (and on a CPU
device it is still the native kernel).

[Note: gradient stream] A unit's reduce-scattered gradient shard leaves the device as
soon as it exists: the D2H copy stream waits for the compute stream's event, copies
the shard into one of a few staging buffers, and a host thread waits for that copy
and adds it into the fp32 accumulator. A staging buffer is reused only after the
host thread has finished with it, so a slow host applies back-pressure instead of
overwriting a buffer in flight. ``drain`` waits for all of it before the step reads
the accumulators.

[Note: parameter return] After the step each unit's new compute-dtype shard is copied
back on the H2D copy stream; the copy's event is the unit's ``ready`` event, which
the next gather of that unit waits for (``Unit.unshard``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload import native
from offload.accelerator import Accelerator, DoneEvent, Event
from offload.aio.buffers import AlignedBuffer
from offload.optim.adam import AdamHyper, adam_step
from offload.telemetry import Telemetry
from offload.zero.unit import Unit

STAGING_BUFFERS = 4


@dataclass(frozen=True)
class Segment:
    """A run of a shard whose elements all belong to one param group (``start``/``end`` shard-relative)."""

    start: int
    end: int
    group: int


def shard_segments(unit: Unit, group_of: dict[int, int]) -> list[Segment]:
    """The optimizer segments of this rank's shard; padding and params in no group are left out."""
    lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
    segments: list[Segment] = []
    for slot in unit.slots:
        group = group_of.get(id(slot.param))
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if group is None or start >= end:
            continue
        if segments and segments[-1].group == group and segments[-1].end == start - lo:
            segments[-1] = Segment(segments[-1].start, end - lo, group)
        else:
            segments.append(Segment(start - lo, end - lo, group))
    return segments


@dataclass
class ShardState:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    out16: torch.Tensor | None  # the new compute-dtype shard, written by the fused step (16-bit compute only)
    segments: list[Segment]
    fresh: bool = True  # the accumulator holds nothing from this step yet
    buffers: list[AlignedBuffer] = field(default_factory=list)


class ShardedAdam(torch.optim.Optimizer):
    """Adam/AdamW over the shards of a ZeRO-3 model. Hyperparameters live in ``param_groups`` as in
    any torch optimizer (LR schedulers work), but the step is ``engine.step()``."""

    def __init__(self, param_groups: list[dict[str, Any]], accel: Accelerator, *, offload: bool,
                 compute_dtype: torch.dtype, adamw_mode: bool, bias_correction: bool, threads: int | None,
                 telemetry: Telemetry | None = None) -> None:
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        super().__init__(param_groups, defaults)
        self.accel = accel
        self.offload = offload
        self.compute_dtype = compute_dtype
        self.adamw_mode = adamw_mode
        self.bias_correction = bias_correction
        self.threads = threads
        self.telemetry = telemetry or Telemetry()
        self.adam_steps = 0
        self.shards: dict[int, ShardState] = {}
        self._d2h = accel.copy_stream("d2h") if offload else None
        self._h2d = accel.copy_stream("h2d") if offload else None
        self._host = accel.host_queue("grad-accumulate") if offload else None
        self._staging: list[tuple[torch.Tensor, Event]] = []
        self._next_staging = 0

    @property
    def state_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.accel.device

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the sharded optimizer steps through engine.step(), which also reduces, clips and "
                           "writes the new parameters back; call engine.step()")

    # ----------------------------------------------------------------- state

    def add_unit(self, unit: Unit, master: torch.Tensor, group_of: dict[int, int]) -> None:
        """Own ``unit``'s optimizer state; ``master`` is its fp32 shard (host)."""
        n = unit.shard_numel
        buffers: list[AlignedBuffer] = []

        def alloc(dtype: torch.dtype) -> torch.Tensor:
            if not self.offload:
                return torch.zeros(n, dtype=dtype, device=self.accel.device)
            t, buf = self.accel.host_buffer(n, dtype)
            buffers.append(buf)
            t.zero_()
            return t

        state = ShardState(alloc(torch.float32), alloc(torch.float32), alloc(torch.float32), alloc(torch.float32),
                           alloc(self.compute_dtype) if self.offload and self.compute_dtype != torch.float32 else None,
                           shard_segments(unit, group_of), buffers=buffers)
        state.master.copy_(master)
        self.shards[unit.index] = state
        if self.offload and (not self._staging or self._staging[0][0].numel() < n):
            self._staging = [(self.accel.host_buffer(n, self.compute_dtype)[0], DoneEvent())
                             for _ in range(STAGING_BUFFERS)]

    def state_bytes(self) -> int:
        """Master, moments, accumulator and 16-bit copy of every shard this rank owns."""
        tensors = [t for s in self.shards.values() for t in (s.master, s.exp_avg, s.exp_avg_sq, s.grad, s.out16)
                   if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._staging)

    # ----------------------------------------------------------------- gradients in

    def accumulate(self, unit: Unit, shard_grad: torch.Tensor, scale: float) -> None:
        """Add ``scale`` x the reduce-scattered gradient shard into the unit's fp32 accumulator."""
        state = self.shards.get(unit.index)
        if state is None:
            return
        if not self.offload:
            _accumulate(state, shard_grad, scale)
            return
        assert self._d2h is not None and self._host is not None
        slot = self._next_staging
        self._next_staging = (slot + 1) % len(self._staging)
        staging, free = self._staging[slot]
        free.synchronize()  # the host thread is done with this buffer's previous gradient
        stage = staging[:shard_grad.numel()]
        tel = self.telemetry

        def copy() -> None:
            with tel.span("d2h", unit.name):
                stage.copy_(shard_grad, non_blocking=True)

        def add() -> None:
            with tel.span("accumulate", unit.name):
                _accumulate(state, stage, scale)
            del grad_ref[:]  # the device gradient may be freed now that its copy has been waited for

        grad_ref = [shard_grad]
        self._d2h.wait_event(self.accel.compute_event())
        self._d2h.run(copy)
        self._host.wait_event(self._d2h.record())
        self._host.run(add)
        tel.add_bytes("d2h", shard_grad.numel() * shard_grad.element_size())
        self._staging[slot] = (staging, self._host.record())

    def drain(self) -> None:
        """Wait until every gradient sent so far is in its accumulator (re-raises a failed copy)."""
        if self._host is not None:
            self._host.synchronize()

    def clear_grads(self) -> None:
        self.drain()
        for state in self.shards.values():
            state.fresh = True

    # ----------------------------------------------------------------- the step

    def grad_sq_norm(self) -> tuple[float, int]:
        """This rank's sum of squared accumulated gradients and count of non-finite ones."""
        total, nonfinite = 0.0, 0
        for state in self.shards.values():
            if state.fresh:
                continue
            for seg in state.segments:
                g = state.grad[seg.start:seg.end]
                if g.device.type == "cpu":
                    part = native.grad_sq_norm(g, threads=self.threads)
                    total, nonfinite = total + part.sum_sq, nonfinite + part.nonfinite
                else:
                    total += float(g.double().square().sum())
                    nonfinite += int((~torch.isfinite(g)).sum())
        return total, nonfinite

    def hyper(self, group: int) -> AdamHyper:
        g = self.param_groups[group]
        return AdamHyper(lr=float(g["lr"]), betas=tuple(g["betas"]), eps=float(g["eps"]),
                         weight_decay=float(g["weight_decay"]), adamw_mode=self.adamw_mode,
                         bias_correction=self.bias_correction)

    def apply(self, units: Iterable[Unit], grad_scale: float) -> None:
        """One Adam step on every shard with gradients scaled by ``grad_scale``; new params go back to the device."""
        if self._h2d is not None:
            self._h2d.synchronize()  # last step's copies read master/out16, which this step rewrites
        self.adam_steps += 1
        hypers = [self.hyper(i) for i in range(len(self.param_groups))]
        for unit in units:
            state = self.shards.get(unit.index)
            if state is None:
                continue
            if state.fresh:  # no gradient reached this unit since the last step: Adam sees zeros
                state.grad.zero_()
            for seg in state.segments:
                s = slice(seg.start, seg.end)
                out16 = state.out16[s] if state.out16 is not None else None
                if state.master.device.type == "cpu":
                    adam_step(state.master[s], state.grad[s], state.exp_avg[s], state.exp_avg_sq[s], self.adam_steps,
                              hypers[seg.group], grad_scale, out16=out16, threads=self.threads)
                else:
                    _torch_adam(state.master[s], state.grad[s], state.exp_avg[s], state.exp_avg_sq[s],
                                self.adam_steps, hypers[seg.group], grad_scale)
            self._write_back(unit, state)
            state.fresh = True

    def _write_back(self, unit: Unit, state: ShardState) -> None:
        source = state.out16 if state.out16 is not None else state.master
        if self._h2d is None:
            unit.shard.copy_(source)
            unit.ready = None
            return
        # The shard may still be read by a gather on the compute stream: copy after it.
        self._h2d.wait_event(self.accel.compute_event())
        shard, tel = unit.shard, self.telemetry

        def copy() -> None:
            with tel.span("h2d", unit.name):
                shard.copy_(source, non_blocking=True)

        self._h2d.run(copy)
        unit.ready = self._h2d.record()
        tel.add_bytes("h2d", source.numel() * source.element_size())

    def close(self) -> None:
        self.drain()
        for stream in (self._d2h, self._h2d):
            if stream is not None:
                stream.synchronize()
        for state in self.shards.values():
            for buf in state.buffers:
                buf.release_pin()
        self.shards.clear()
        self._staging.clear()


def _accumulate(state: ShardState, grad: torch.Tensor, scale: float) -> None:
    if state.fresh:
        state.grad.copy_(grad)
        if scale != 1.0:
            state.grad.mul_(scale)
        state.fresh = False
    else:
        state.grad.add_(grad, alpha=scale)


def _torch_adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, h: AdamHyper,
                grad_scale: float) -> None:
    """The same update as the native kernel in torch ops, for state that lives on a GPU."""
    beta1, beta2 = h.betas
    g = g * grad_scale
    if not h.adamw_mode and h.weight_decay:
        g = g.add(p, alpha=h.weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if h.bias_correction else 1.0
    bc2 = 1 - beta2 ** step if h.bias_correction else 1.0
    if h.adamw_mode and h.weight_decay:
        p.mul_(1 - h.lr * h.weight_decay)
    p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(h.eps), value=-h.lr / bc1)
