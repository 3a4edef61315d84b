"""The io_uring engine, through the `liburing` package (pinned to 2024.5.3; see liburing_probe.py).

[Note: one reaper, eventfd wake-ups] liburing's Python wrappers hold the GIL while they
block, so the engine never calls io_uring_wait_cqe: an eventfd registered with the ring
is signalled on every completion, and a reaper thread blocks in os.eventfd_read (which
releases the GIL), then drains completions one at a time with peek/seen (the wrapper's
batch indexing does not handle the completion ring wrapping around). Submissions and
resubmissions go through one lock that owns the submission side; the reaper alone owns
the completion side. At most queue_depth pieces are in flight; the rest wait in order.
"""

from __future__ import annotations

import collections
import errno as errno_mod
import os
import threading
from collections.abc import Callable
from typing import Literal

import torch

from offload.aio.base import (
    IOEngine,
    Piece,
    Request,
    SwapFile,
    SwapIOError,
    Verify,
    _memoryview_at,
    check_block_size,
    check_request,
    piece_error,
    split,
    zero_transfer,
)
from offload.aio.liburing_probe import import_liburing


class IoUringEngine(IOEngine):
    name = "io_uring"

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8) -> None:
        liburing = import_liburing()  # only after probe_io_uring() said it is safe here
        self._lib = liburing
        self.block_size = check_block_size(block_size)
        self.queue_depth = queue_depth
        self._ring = liburing.io_uring()
        rc = liburing.io_uring_queue_init(max(queue_depth, 1), self._ring, 0)
        if rc < 0:
            raise OSError(-rc, f"io_uring_queue_init({queue_depth}) failed: {os.strerror(-rc)}")
        self._efd = os.eventfd(0, os.EFD_CLOEXEC)
        liburing.io_uring_register_eventfd(self._ring, self._efd)
        self._cqe = liburing.io_uring_cqe()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiting: collections.deque[Piece] = collections.deque()
        self._inflight: dict[int, Piece] = {}
        self._next_id = 1
        self._closing = False
        self._closed = False
        # Tests inject faults here: (piece, res) -> res.
        self._inject: Callable[[Piece, int], int] | None = None
        self._reaper = threading.Thread(target=self._reap, name="offload-io_uring-reaper", daemon=True)
        self._reaper.start()

    def submit(self, op: str, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
               verify: Verify | None = None) -> Request:
        if self._closing:
            raise RuntimeError("the io_uring engine is closed")
        address = check_request(op, file, buffer, offset, length)
        request = Request(op, file, offset, length, buffer, verify=verify)
        pieces = split(request, address, self.block_size)
        with self._lock:
            self._waiting.extend(pieces)
            self._fill_locked()
        return request

    def _fill_locked(self) -> None:
        """Move waiting pieces into the ring up to queue_depth, then submit them in one call."""
        lib = self._lib
        added = []
        while self._waiting and len(self._inflight) < self.queue_depth:
            piece = self._waiting.popleft()
            remaining = piece.length - piece.done
            mv = _memoryview_at(piece.address + piece.done, remaining)
            sqe = lib.io_uring_get_sqe(self._ring)
            if piece.request.op == "read":
                lib.io_uring_prep_read(sqe, piece.request.file.fd, mv, remaining, piece.offset + piece.done)
            else:
                lib.io_uring_prep_write(sqe, piece.request.file.fd, mv, remaining, piece.offset + piece.done)
            ident = self._next_id
            self._next_id += 1
            lib.io_uring_sqe_set_data64(sqe, ident)
            self._inflight[ident] = piece
            added.append(ident)
        if added:
            try:
                lib.io_uring_submit(self._ring)
            except OSError as e:
                for ident in added:
                    piece = self._inflight.pop(ident)
                    piece.request.piece_finished(piece_error(piece, e.errno or errno_mod.EIO))

    def _reap(self) -> None:
        lib = self._lib
        while True:
            try:
                os.eventfd_read(self._efd)  # blocks without the GIL
            except OSError:
                return
            while True:
                completions = []
                with self._lock:
                    while lib.io_uring_peek_cqe(self._ring, self._cqe) == 0:
                        res, ident = self._cqe.res, self._cqe.user_data
                        lib.io_uring_cqe_seen(self._ring, self._cqe)
                        piece = self._inflight.pop(ident, None)
                        if piece is not None:
                            completions.append((piece, res))
                if not completions:
                    break
                finished = [(p, e) for p, res in completions if (e := self._settle(p, res)) is not False]
                # Refill the ring before finishing pieces: finishing may verify checksums, and
                # the drive should stay busy meanwhile.
                with self._lock:
                    self._fill_locked()
                for piece, error in finished:
                    piece.request.finish_piece(piece, error)
            with self._lock:
                self._fill_locked()
                if not self._inflight and not self._waiting:
                    self._idle.notify_all()
                    if self._closing:
                        return

    def _settle(self, piece: Piece, res: int) -> SwapIOError | None | Literal[False]:
        """The outcome of one completion: an error, None (piece done) or False (continued, not done)."""
        if self._inject is not None:
            res = self._inject(piece, res)
        if res < 0:
            return piece_error(piece, -res)
        if res == 0:
            return zero_transfer(piece)
        piece.done += res
        if piece.done < piece.length:
            with self._lock:  # a short transfer: continue from where it stopped, ahead of new work
                self._waiting.appendleft(piece)
            return False
        return None

    def close(self) -> None:
        """Wait for everything in flight (the kernel may still be writing into buffers), then tear down."""
        if self._closed:
            return
        with self._lock:
            self._closing = True
            while self._inflight or self._waiting:
                self._idle.wait()
        os.eventfd_write(self._efd, 1)  # wake the reaper so it sees _closing
        self._reaper.join()
        self._lib.io_uring_queue_exit(self._ring)
        os.close(self._efd)
        self._closed = True
