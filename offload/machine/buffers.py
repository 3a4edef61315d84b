"""Page-aligned host buffers (zero-copy torch tensors, pinned where a GPU exists) and a bounded pool.

O_DIRECT needs the buffer address, the length and the file offset aligned to the
device's logical block; 4 KiB covers every NVMe drive. Anonymous mmap gives page
alignment for free and lets large buffers use transparent huge pages.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import torch

from offload.machine import stream_check

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class PoolExhausted(RuntimeError):
    """The pool's byte budget is spent; it never grows past it."""


class _Mapping(mmap.mmap):
    """Anonymous memory that gives up its CUDA registration before it is unmapped.

    A registration outlives an unmapping: the next buffer mapped at that address would fail
    ``cudaHostRegister`` (already registered) and torch's own pinning there would fail too. The
    tensors made from this mapping keep it alive, so this finalizer runs once the last of them is
    gone, and before the base type unmaps the pages.
    """

    registered_at = 0  # the address registered with the driver, 0 when none

    def unregister(self) -> None:
        address, self.registered_at = self.registered_at, 0
        if address:
            torch.cuda.cudart().cudaHostUnregister(address)

    def __del__(self) -> None:
        self.unregister()


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class AlignedBuffer:
    """``nbytes`` (rounded up to 4 KiB) of page-aligned host memory, as a uint8 tensor."""

    def __init__(self, nbytes: int, pin: bool | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.capacity = round_up(nbytes)
        self._mmap = _Mapping(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.capacity >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        stream_check.host_memory(self.tensor, self._mmap)
        self.pinned = False
        if pin if pin is not None else torch.cuda.is_available():
            # Registering pages with the driver makes H2D/D2H copies from them asynchronous; portable, so they are
            # pinned for every CUDA context of the process, not only the one current here
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.capacity, HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.capacity} bytes failed (error {int(err)})")
            self._mmap.registered_at = self.tensor.data_ptr()
            self.pinned = True

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements as ``dtype``, sharing memory."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.capacity:
            raise ValueError(f"{numel} x {dtype} needs {nbytes} bytes; this buffer holds {self.capacity}")
        return self.tensor[:nbytes].view(dtype)

    def release_pin(self) -> None:
        self._mmap.unregister()
        self.pinned = False


@dataclass
class PoolStats:
    capacity: int
    in_use: int
    peak: int
    buffers_out: int


class BufferPool:
    """Hands out aligned buffers within a fixed byte budget; freed buffers are reused by size."""

    def __init__(self, capacity_bytes: int, pin: bool | None = None, name: str = "host pool") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{name}: capacity must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity = capacity_bytes
        self._pin = pin
        self._lock = threading.Lock()
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._allocated = 0   # bytes of buffers that exist (free or out)
        self._in_use = 0
        self._peak = 0
        self._out = 0

    def acquire(self, nbytes: int) -> AlignedBuffer:
        size = round_up(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buf = free.pop()
            else:
                if self._allocated + size > self.capacity:
                    spare = sum(b.capacity for bufs in self._free.values() for b in bufs)
                    if self._allocated - spare + size > self.capacity:
                        raise PoolExhausted(
                            f"{self.name}: {size:,} more bytes would exceed its budget of {self.capacity:,} "
                            f"({self._in_use:,} in use in {self._out} buffers); raise the budget or release "
                            "buffers first")
                    self._drop_free_until(size)
                buf = AlignedBuffer(size, pin=self._pin)
                self._allocated += buf.capacity
            self._in_use += buf.capacity
            self._out += 1
            self._peak = max(self._peak, self._in_use)
            return buf

    def _drop_free_until(self, size: int) -> None:
        """Free cached buffers of other sizes until ``size`` more bytes fit."""
        for bufs in self._free.values():
            while bufs and self._allocated + size > self.capacity:
                b = bufs.pop()
                b.release_pin()
                self._allocated -= b.capacity

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._in_use -= buf.capacity
            self._out -= 1
            self._free.setdefault(buf.capacity, []).append(buf)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self.capacity, self._in_use, self._peak, self._out)
