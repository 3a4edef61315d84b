"""``engine.offload_states()`` / ``reload_states()``: the device's memory lent back between steps, as an RLHF loop
frees its trained engines' GPU memory while generation runs (OpenRLHF, verl, DeepSpeed-Chat).

A mixin of ``Engine`` (offload/engine/core.py), with DeepSpeed's names, arguments and categories
(``OffloadStateTypeEnum``). What is on the compute device moves to host memory; what is homed elsewhere (host or
NVMe state, host-homed shards) stays where it is. Each room says what it holds on the device
(``device_memory()``); the storages under it are lent by offload/machine/parking.py ([Note: lending by
storage]), so every view (the model's parameters, the state's master and moments) stays the same object, and
training after ``reload_states`` goes on bit for bit as if nothing had moved. While the states are away the engine
takes no work (offload/engine/life.py: LENT).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Container, Iterator

import torch
from torch import nn

from offload.checkpointing import ActivationStore
from offload.engine.accumulation import Accumulation, Phase
from offload.engine.errors import EngineError
from offload.engine.life import Lifetime
from offload.machine.accelerator import Accelerator
from offload.machine.parking import Parking
from offload.optim.sharded import ShardedAdam
from offload.store.param_store import ParamStore
from offload.zero.unit import Unit

logger = logging.getLogger("offload.engine")


class OffloadStateTypeEnum(str, enum.Enum):
    """What ``offload_states(include=...)`` moves (DeepSpeed's names). The master weights (hp_params) and the
    moments (optim_states) share one slot per sub-group, so naming either moves both."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


ALL_STATES = frozenset(OffloadStateTypeEnum)


class StateLending:
    """``offload_states``, ``reload_states`` and ``states_offloaded``."""

    module: nn.Module
    units: list[Unit]
    params: ParamStore
    optimizer: ShardedAdam
    accel: Accelerator
    accumulation: Accumulation
    life: Lifetime
    activations: ActivationStore
    _lent: Parking | None = None

    def offload_states(self, include: Container[OffloadStateTypeEnum | str] | None = None,
                       device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the ``include``d states (default: all) that are on the device to host memory (pinned with
        ``pin_memory``), between steps. ``non_blocking`` is accepted; the memory is given back only once its
        copy is done, so the call returns after the copies either way."""
        target = OffloadDeviceEnum(getattr(device, "value", device))
        if target is not OffloadDeviceEnum.cpu:
            raise EngineError(f"engine.offload_states(device={target.value!r}): offload moves the device's states "
                              "to host memory only (device='cpu'); a host or NVMe home for them is the config's "
                              "zero_optimization.offload_optimizer / offload_param")
        wanted = _categories(include)
        self.life.check()
        if self.accumulation.phase is not Phase.EMPTY:
            raise EngineError(f"engine.offload_states() between micro-batches ({self.accumulation.pending} of "
                              f"{self.accumulation.steps} in): call it after engine.step(), at a step boundary")
        self._drain("offload_states")  # type: ignore[attr-defined]  # Engine's
        self.params.wait_copies_back()
        self.activations.discard()  # inputs a forward-only pass left saved
        self.accel.synchronize()
        parking = Parking()
        if not self.accel.host_is_device:  # else the device is host memory: nothing to give back
            parking.park(self._device_memory(wanted), pin=pin_memory)
        if self.accel.is_cuda:
            torch.cuda.empty_cache()
        self._lent = parking
        self.life.lend()
        logger.info("engine.offload_states: %.1f MiB of device memory given back (%s)", parking.nbytes / 2**20,
                    ", ".join(sorted(c.value for c in wanted)))

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved; training goes on as if it had never moved."""
        if self._lent is None:
            raise EngineError("engine.reload_states(): nothing is offloaded (call engine.offload_states() first)")
        self._lent.restore(non_blocking=non_blocking)
        self._lent = None
        self.life.reclaim()

    @property
    def states_offloaded(self) -> int:
        """The device bytes lent back now (0 when the states are on the device)."""
        return self._lent.nbytes if self._lent is not None else 0

    def _device_memory(self, wanted: frozenset[OffloadStateTypeEnum]) -> Iterator[tuple[torch.Tensor, bool]]:
        """(tensor, whether its contents must come back) for everything of ``wanted`` on the device."""
        if wanted & {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params}:
            yield from ((t, True) for t in self.optimizer.store.device_memory())
            if self.optimizer.streamed is not None:
                yield self.optimizer.streamed.device_memory(), False  # scratch between steps
        if OffloadStateTypeEnum.lp_params in wanted:
            yield from ((t, True) for t in self.params.device_memory())
            yield from ((t, True) for unit in self.units for t in unit.device_memory())
            yield from ((b, True) for b in self.module.buffers() if b.device == self.accel.device)
        if wanted & {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer}:
            yield from ((t, True) for t in self.optimizer.device_gradients())


def _categories(include: Container[OffloadStateTypeEnum | str] | None) -> frozenset[OffloadStateTypeEnum]:
    if include is None:
        return ALL_STATES
    try:
        return frozenset(OffloadStateTypeEnum(getattr(c, "value", c)) for c in include)  # type: ignore[attr-defined]
    except ValueError as e:
        raise EngineError(f"engine.offload_states(include=...): {e}; the states are "
                          f"{', '.join(c.value for c in OffloadStateTypeEnum)}") from None
