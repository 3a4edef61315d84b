"""Choosing an engine: io_uring where it is safe and allowed here (liburing_probe.py), else the thread pool,
with a reason."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from offload.aio.base import IOEngine
from offload.aio.liburing_probe import probe_io_uring

if TYPE_CHECKING:
    from offload.config import Config

logger = logging.getLogger("offload.aio")


def make_engine(kind: str = "auto", block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 1,
                directory: str | None = None) -> IOEngine:
    """An engine of ``kind`` (auto | io_uring | threads); auto falls back to threads with a logged reason."""
    from offload.aio.threads import ThreadPoolEngine

    if kind not in ("auto", "io_uring", "threads"):
        raise ValueError(f"engine must be 'auto', 'io_uring' or 'threads', got {kind!r}")
    if kind != "threads":
        probe = probe_io_uring(directory)
        if probe.ok:
            from offload.aio.uring import IoUringEngine
            return IoUringEngine(block_size=block_size, queue_depth=queue_depth)
        if kind == "io_uring":
            raise RuntimeError(f"io_uring was asked for but cannot be used: {probe.reason}")
        logger.warning("aio: using the thread-pool engine: %s", probe.reason)
    return ThreadPoolEngine(block_size=block_size, threads=max(threads, 2))


def engine_from_config(config: Config, directory: str | None = None) -> IOEngine:
    """The engine a config asks for: its aio section and offload.aio_engine."""
    aio = config.aio
    return make_engine(config.offload.aio_engine, block_size=aio.block_size, queue_depth=aio.queue_depth,
                       threads=aio.intra_op_parallelism, directory=directory)
