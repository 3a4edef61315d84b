"""One shard's Adam: the kernel over the shard's segments, and where its new 16-bit shard goes (see [Note: parameter
return] in offload/optim/sharded.py). Every schedule's step ends here: after backward, overlapped, speculated, early
or delayed; the optimizer (sharded.py) and its early step (early_step.py) and speculation (speculation.py) call it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from offload.machine.accelerator import Accelerator, Event
from offload.machine.native import Stochastic
from offload.observe.step_graph import COMPUTE
from offload.optim.adam import AdamHyper, adam_step, device_adam_step, device_adam_step_held
from offload.optim.generic import GenericHyper, GenericStep
from offload.optim.hyper import Hyper
from offload.optim.muon_pass import MuonPass, apply_pieces
from offload.optim.one_state import ONE_STATE_RULES, one_state_step
from offload.optim.shard_state import ShardPhase, ShardState, StateSplit, by_group, widened
from offload.store.param_store import ParamStore
from offload.store.state_format import StateSlot, mix_seed
from offload.store.sub_groups import SubGroup


@dataclass(frozen=True)
class UpdateMeans:
    """How the update runs besides Adam's arithmetic: the host kernel's threads, this rank's stream of a bf16
    master rounded stochastically (None: no such master), and the Muon matrices' first pass (None: the optimizer is
    not Muon; see [Note: Muon over shards] in offload/optim/muon_pass.py)."""

    threads: int | None = None
    stochastic: int | None = None
    muon: MuonPass | None = None
    generic: GenericStep | None = None  # a torch optimizer's own step (None: not one; offload/optim/generic.py)


class ShardUpdate:
    """Adam over one shard at a time, with the shards' own states, the parameter store to write and the threads
    the host kernel runs on."""

    def __init__(self, accel: Accelerator, shards: dict[int, ShardState], params: ParamStore, split: StateSplit,
                 nvme_units: frozenset[int], means: UpdateMeans) -> None:
        """``split``: which units' state is stepped on the host (those write a host copy of the shard);
        ``nvme_units``: units whose parameter shard is homed on NVMe."""
        self.accel, self.shards, self.params = accel, shards, params
        self.threads, self.stochastic, self.muon = means.threads, means.stochastic, means.muon
        self.generic = means.generic
        self.split = split
        self.nvme_units = nvme_units
        self._compute_done: Event | None = None  # where the step orders copies after compute (re-recorded)

    def after_compute(self) -> Event:
        """An event at this point of the compute stream (one object, re-recorded for each of the step's copies)."""
        self._compute_done = self.accel.compute_event(into=self._compute_done)
        return self._compute_done

    def on_discrete_device(self, index: int) -> bool:
        """Whether unit ``index``'s state lives on a device apart from the host (a GPU, or the emulated one): its
        norm and Adam run in torch's kernels there (see [Note: Adam on a discrete device] in optim/adam.py)."""
        return not self.split.steps_on_host(index) and not self.accel.host_is_device

    def prepare_muon(self, groups: Iterable[SubGroup], hypers: list[Hyper], grad_scale: float) -> None:
        """Muon's first pass, at the start of the step (nothing without Muon)."""
        if self.muon is not None:
            self.muon.prepare(groups, self.shards, hypers, grad_scale)

    def step_shard(self, index: int, views: StateSlot, step: int, hypers: list[Hyper], grad_scale: float,
                   into: StateSlot | None = None, target: torch.Tensor | None = None, publish: bool = True) -> None:
        """One shard's Adam, in place or (``into``: host state) into another slot; the new shard goes to the
        parameter store's target, or to ``target`` (the delayed update's staging), or (stepped on the device, not
        ``publish``) is left to the caller (the streamed lane writes it). The state is held in the format its views
        have (see offload/store/state_format.py)."""
        state = self.shards[index]
        master, exp_avg, exp_avg_sq = views
        empty = state.phase is ShardPhase.EMPTY  # no gradient reached this unit since the last step: Adam sees zeros
        out = target if target is not None else (
            self.params.step_target(index) if self.split.steps_on_host(index) else None)
        if index in self.nvme_units:  # a fresh write buffer: what the step does not write keeps its value
            assert out is not None
            for start, end in state.gaps:
                out[start:end].copy_(master[start:end])
        # the weights are the master's high half (see [Note: the weights are the high half]): written in place
        in_place = out is not None and views.master.numel() > 0 and out.data_ptr() == views.master.data_ptr()
        out16 = out if out is not None and out.dtype != torch.float32 and not in_place else None
        grad, pre_scale = (torch.zeros_like(master), 1.0) if empty else state.gradient()
        # Master, moments read and written, the gradient read, the new shard written.
        state_bytes = 2 * sum(b.element_size() for b in views.buffers() if b.numel())  # a moment not held: none
        out_bytes = out.element_size() if out is not None and not in_place else 0
        self.accel.graph.work("adam", index, nbytes=master.numel() * (state_bytes + grad.element_size() + out_bytes),
                              lane=COMPUTE if self.on_discrete_device(index) else None)
        segments = state.segments
        matrices = self.muon.units.get(index) if self.muon is not None else None
        if matrices is not None:  # the second pass of Muon's step ([Note: Muon over shards] in muon_pass.py)
            apply_pieces(matrices, views, hypers, out16)
            segments = [seg for seg in segments if hypers[seg.group].rule != "muon"]  # the rest are Adam's
        if self.generic is not None:  # see [Note: a torch optimizer's own step] in generic.py
            assert into is None, "a torch optimizer's own step is not speculated"
            for seg in self.generic.pieces[index]:
                s = slice(seg.start, seg.end)
                g = widened(grad[s], pre_scale)
                hyper = hypers[seg.group]
                assert isinstance(hyper, GenericHyper)
                self.generic.segment((master[s], exp_avg[s], exp_avg_sq[s]), g * grad_scale if grad_scale != 1.0
                                     else g, step, hyper, out16[s] if out16 is not None else None)
        elif any(h.rule in ONE_STATE_RULES for h in hypers):  # one state buffer (offload/optim/one_state.py)
            assert into is None, "Lion and Adagrad are not speculated (the schedule takes no speculative step)"
            on_device = out is None and self.on_discrete_device(index)
            for seg in segments:
                s = slice(seg.start, seg.end)
                # the host kernel reads a 16-bit gradient itself; torch's ops (on the device) need it in fp32
                g = widened(grad[s], pre_scale) if on_device or pre_scale != 1.0 else grad[s]
                one_state_step(views.narrow(seg.start, seg.end - seg.start), g, step, _adam(hypers[seg.group]),
                               grad_scale, out16[s] if out16 is not None else None,
                               None if on_device else self.threads, self._stream(index, step, seg.start), on_device)
        elif out is None and self.on_discrete_device(index):  # torch's fused kernel
            assert into is None  # never speculated: host state only
            for group, segs in by_group(segments).items():
                slices = [slice(seg.start, seg.end) for seg in segs]
                parts = [views.narrow(s.start, s.stop - s.start) for s in slices]
                # fp32 as the kernel reads it: a gradient kept as it landed widened and scaled, one unit at a time
                grads = [widened(grad[s], pre_scale) for s in slices]
                if views.master.dtype == torch.float32 and exp_avg.dtype == torch.float32:
                    device_adam_step([p.master for p in parts], grads, [p.exp_avg for p in parts],
                                     [p.exp_avg_sq for p in parts], step, _adam(hypers[group]), grad_scale)
                else:
                    device_adam_step_held(parts, grads, step, _adam(hypers[group]), grad_scale,
                                          self._stream(index, step, slices[0].start))
        else:
            lo = views.master_lo
            for seg in segments:
                s = slice(seg.start, seg.end)
                adam_step(master[s], grad[s], exp_avg[s], exp_avg_sq[s], step, _adam(hypers[seg.group]),
                          grad_scale, out16=out16[s] if out16 is not None else None, threads=self.threads,
                          pre_scale=pre_scale, into=None if into is None else tuple(b[s] for b in into.buffers()),
                          master_lo=None if lo is None else lo[s], stochastic=self._stream(index, step, seg.start))
        if into is not None:
            master = into[0]
        if out is None:  # state on the compute device: the shard is written straight away
            if publish:
                self.params.write_device(index, master)
        else:
            if out16 is None and not in_place:
                for seg in state.segments:
                    out[seg.start:seg.end].copy_(master[seg.start:seg.end])
            if target is None:
                self.params.wrote(index)

    def _stream(self, index: int, step: int, start: int) -> Stochastic | None:
        """The stochastic rounding of unit ``index``'s elements from ``start`` on at ``step``: one stream per
        rank, step and unit (see [Note: state formats] in native/kernels.cpp), indexed by the element."""
        if self.stochastic is None:
            return None
        return Stochastic(mix_seed(self.stochastic, step, index), start)

    def restore_target(self, index: int, master: torch.Tensor) -> None:
        out, segments = self.params.step_target(index), self.shards[index].segments
        for seg in segments:
            out[seg.start:seg.end].copy_(master[seg.start:seg.end])


def _adam(hyper: Hyper) -> AdamHyper:
    """A group's hyperparameters where the update is Adam's (or Lion's, Adagrad's): never a Muon group's."""
    assert isinstance(hyper, AdamHyper), "a Muon group's pieces are stepped by apply_pieces"
    return hyper
