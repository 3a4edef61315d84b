"""The thread-pool engine: os.preadv/pwritev on O_DIRECT files from a pool of threads.

For machines where io_uring is refused (Docker's default seccomp profile, old kernels).
Python releases the GIL inside each syscall, so the threads' transfers overlap.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from offload.aio.base import (
    IOEngine,
    Piece,
    Request,
    SwapFile,
    Verify,
    check_block_size,
    check_request,
    split,
    transfer_piece,
)


class ThreadPoolEngine(IOEngine):
    name = "threads"

    def __init__(self, block_size: int = 1 << 20, threads: int = 2) -> None:
        self.block_size = check_block_size(block_size)
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-aio")

    def submit(self, op: str, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
               verify: Verify | None = None) -> Request:
        address = check_request(op, file, buffer, offset, length)
        request = Request(op, file, offset, length, buffer, verify=verify)
        for piece in split(request, address, self.block_size):
            self._pool.submit(_transfer, piece)
        return request

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _transfer(piece: Piece) -> None:
    """One piece, on a pool thread."""
    piece.request.finish_piece(piece, transfer_piece(piece))
