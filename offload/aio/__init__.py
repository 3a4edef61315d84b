"""Async file I/O for the NVMe tier: io_uring (liburing) or a thread pool, on O_DIRECT swap files."""

from offload.aio.base import IOEngine, Request, SwapFile, SwapIOError
from offload.aio.checksum import ChecksumError, ChecksummedFile
from offload.aio.choose import engine_from_config, make_engine
from offload.aio.liburing_probe import probe_io_uring
from offload.machine.buffers import AlignedBuffer, BufferPool, PoolExhausted, round_up

__all__ = ["AlignedBuffer", "BufferPool", "ChecksumError", "ChecksummedFile", "IOEngine", "PoolExhausted", "Request",
           "SwapFile", "SwapIOError", "engine_from_config", "make_engine", "probe_io_uring", "round_up"]
