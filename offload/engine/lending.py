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

from offload.aio.base import IOEngine, SwapFile, SwapIOError
from offload.checkpointing import ActivationStore
from offload.config import Config
from offload.engine.accumulation import Accumulation, Phase
from offload.engine.build import SwapFiles
from offload.engine.errors import EngineError
from offload.engine.life import Lifetime
from offload.machine.accelerator import Accelerator
from offload.machine.buffers import ALIGN, AlignedBuffer, round_up
from offload.machine.parking import Parking
from offload.optim.sharded import ShardedAdam
from offload.store.param_store import ParamStore
from offload.store.swapdir import SwapDir
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
    _swaps: SwapFiles
    config: Config
    _spills = 0  # NVMe files written so far (each lending's has a name of its own)

    def offload_states(self, include: Container[OffloadStateTypeEnum | str] | None = None,
                       device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the ``include``d states (default: all) that are on the device to host memory (pinned with
        ``pin_memory``) or, with ``device="nvme"``, through it into a file in the config's NVMe directory (where
        DeepSpeed refuses), between steps. ``non_blocking`` is accepted; the memory is given back only once its
        copy is done, so the call returns after the copies either way."""
        target = OffloadDeviceEnum(getattr(device, "value", device))
        if target is OffloadDeviceEnum.none:
            raise EngineError("engine.offload_states(device='none'): the states move to host memory (device='cpu') "
                              "or through it to NVMe (device='nvme')")
        zero = self.config.zero_optimization
        nvme_path = zero.offload_optimizer.nvme_path or zero.offload_param.nvme_path
        if target is OffloadDeviceEnum.nvme and nvme_path is None:
            raise EngineError("engine.offload_states(device='nvme') writes the states to the config's NVMe "
                              "directory, and this config names none: set zero_optimization.offload_optimizer."
                              "nvme_path (or offload_param's), or offload to device='cpu'")
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
            parking.park(self._device_memory(wanted), pin=pin_memory and target is OffloadDeviceEnum.cpu)
        if target is OffloadDeviceEnum.nvme and parking.nbytes:
            assert nvme_path is not None
            self._spills += 1
            try:
                swap_dir, io = self._swaps.at(nvme_path)
                parking.spill(NvmeSpill(swap_dir, io, f"lent-{self._spills}"))
            except BaseException as e:
                parking.restore()
                raise EngineError(f"engine.offload_states(device='nvme'): {e}; nothing moved (the states are on "
                                  "the device as before)") from e
        if self.accel.is_cuda:
            torch.cuda.empty_cache()
        self._lent = parking
        self.life.lend()
        logger.info("engine.offload_states: %.1f MiB of device memory given back (%s), kept in %s",
                    parking.nbytes / 2**20, ", ".join(sorted(c.value for c in wanted)),
                    "an NVMe file" if parking.spilled else "host memory")

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved; training goes on as if it had never moved. From NVMe, a failed
        read leaves the states offloaded (call it again)."""
        if self._lent is None:
            raise EngineError("engine.reload_states(): nothing is offloaded (call engine.offload_states() first)")
        try:
            self._lent.restore(non_blocking=non_blocking)
        except SwapIOError as e:
            raise EngineError(f"engine.reload_states(): {e}; the states are still offloaded, on NVMe: call "
                              "engine.reload_states() again once the drive reads") from e
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


class NvmeSpill:
    """A lending's kept bytes in a swap file of their own, through an aligned staging buffer (O_DIRECT reads and
    writes whole 4 KiB blocks from aligned memory): reserved whole before anything is written, so a full drive
    fails at once; released after the reload."""

    STAGING = 16 << 20

    def __init__(self, swap_dir: SwapDir, io: IOEngine, name: str) -> None:
        self.swap_dir, self.io, self.name = swap_dir, io, name
        self._offsets: list[int] = []
        self._file: SwapFile | None = None

    def write_all(self, copies: list[torch.Tensor]) -> None:
        at = 0
        for copy in copies:
            self._offsets.append(at)
            at += round_up(copy.numel())
        self._file = self.swap_dir.reserve(self.name, max(at, ALIGN))
        try:
            self._move(copies, write=True)
        except BaseException:
            self.release()
            raise

    def read_all(self, into: list[torch.Tensor]) -> None:
        self._move(into, write=False)

    def _move(self, tensors: list[torch.Tensor], write: bool) -> None:
        assert self._file is not None
        staging = AlignedBuffer(self.STAGING, pin=False)
        for tensor, offset in zip(tensors, self._offsets, strict=True):
            for start in range(0, tensor.numel(), self.STAGING):
                n = min(self.STAGING, tensor.numel() - start)
                if write:
                    staging.tensor[:n].copy_(tensor[start:start + n])
                    self.io.write(self._file, staging.tensor, offset + start, n).wait()
                else:
                    self.io.read(self._file, staging.tensor, offset + start, n).wait()
                    tensor[start:start + n].copy_(staging.tensor[:n])

    def release(self) -> None:
        if self._file is not None:
            self.swap_dir.release(self.name)
            self._file = None
