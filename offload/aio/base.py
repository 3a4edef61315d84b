"""The I/O engine interface: byte ranges of aligned host buffers to and from O_DIRECT files.

A request is split into ``block_size`` pieces, each a single read or write; pieces
complete in any order. A short transfer continues from where it stopped and is never
reported as success; a failed piece fails its request with an error naming the file,
offset, length and errno, after every other piece in flight has finished (so the
buffer is no longer being written when the caller sees the error).
"""

from __future__ import annotations

import ctypes
import enum
import errno as errno_mod
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeAlias

import torch

from offload.machine.buffers import ALIGN, round_up

_O_DIRECT_HINT = " (the file system may not support O_DIRECT)"


class SwapIOError(OSError):
    """A swap read or write failed; says which file, where, how much and why."""

    def __init__(self, err: int, path: str, offset: int, length: int, op: str, detail: str = "") -> None:
        reason = detail or os.strerror(err)
        super().__init__(err, f"{op} of {length:,} bytes at offset {offset:,} in {path} failed: {reason} "
                              f"[errno {err} {errno_mod.errorcode.get(err, '?')}]")
        self.path, self.offset, self.length, self.op = path, offset, length, op


@dataclass
class SwapFile:
    """An open O_DIRECT file, named in errors."""

    path: str
    fd: int
    writable: bool

    @classmethod
    def open(cls, path: str | os.PathLike[str], writable: bool = True, create: bool = True) -> SwapFile:
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_DIRECT | os.O_CLOEXEC
        if create and writable:
            flags |= os.O_CREAT
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise SwapIOError(e.errno or errno_mod.EIO, os.fspath(path), 0, 0, "open",
                              f"{e.strerror}{_O_DIRECT_HINT if e.errno == errno_mod.EINVAL else ''}") from None
        return cls(os.fspath(path), fd, writable)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Deferred(enum.Enum):
    """DEFERRED's type: a one-member enum, so that ``result is DEFERRED`` narrows a verify hook's result."""

    DEFERRED = "DEFERRED"


# A verify hook returns this when it will call request.piece_finished itself later.
DEFERRED: Final = Deferred.DEFERRED


@dataclass
class Piece:
    """One block of a request: [offset, offset + length) of the file <-> buffer address."""

    request: Request
    offset: int
    address: int
    length: int
    done: int = 0  # bytes transferred so far (short transfers continue from here)


# A request's verify hook: an error, None (the piece is good) or DEFERRED (it calls piece_finished itself later).
Verify: TypeAlias = Callable[[Piece], SwapIOError | Deferred | None]


@dataclass(eq=False)
class Request:
    """A read or write of ``length`` bytes; wait() returns when every piece is done."""

    op: str  # "read" | "write"
    file: SwapFile
    offset: int
    length: int
    buffer: torch.Tensor  # keeps the memory alive while the kernel writes into it
    _pending: int = 0
    _error: SwapIOError | None = None
    # Called for each piece that arrived whole, in the completing thread (so checksum checks
    # overlap the pieces still in flight); a returned error fails the request.
    verify: Verify | None = None
    _event: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    submitted_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None  # perf_counter time the last piece finished (telemetry draws the interval)

    def finish_piece(self, piece: Piece, error: SwapIOError | None) -> None:
        if error is None and self.verify is not None:
            verdict = self.verify(piece)
            if verdict is DEFERRED:
                return  # the verifier calls piece_finished itself, from its own thread
            error = verdict
        self.piece_finished(error)

    def piece_finished(self, error: SwapIOError | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            if self._pending == 0:
                self.finished_at = time.perf_counter()
                self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} of {self.length:,} bytes at {self.offset:,} in {self.file.path} "
                               f"still in flight after {timeout} s")
        if self._error is not None:
            raise self._error


def check_request(op: str, file: SwapFile, buffer: torch.Tensor, offset: int, length: int) -> int:
    """Validate alignment; returns the buffer address. Lengths round up to 4 KiB on the wire."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"{op}: the buffer must be a contiguous CPU tensor (an AlignedBuffer's)")
    address = buffer.data_ptr()
    if address % ALIGN or offset % ALIGN:
        raise ValueError(f"{op} on {file.path}: O_DIRECT needs 4096-aligned buffer addresses and file offsets "
                         f"(address % 4096 = {address % ALIGN}, offset = {offset}); use AlignedBuffer")
    if length <= 0:
        raise ValueError(f"{op} on {file.path}: length must be positive, got {length}")
    capacity = buffer.numel() * buffer.element_size()
    wire = round_up(length)
    if wire > capacity:
        raise ValueError(f"{op} on {file.path}: {length:,} bytes travel as {wire:,} (whole 4 KiB blocks) but the "
                         f"buffer holds {capacity:,}; allocate buffers with AlignedBuffer, which rounds up")
    if op == "write" and not file.writable:
        raise ValueError(f"write to {file.path}, which was opened read-only")
    return address


def split(request: Request, address: int, block_size: int) -> list[Piece]:
    wire = round_up(request.length)
    pieces = [Piece(request, request.offset + start, address + start, min(block_size, wire - start))
              for start in range(0, wire, block_size)]
    request._pending = len(pieces)
    return pieces


def piece_error(piece: Piece, err: int, detail: str = "") -> SwapIOError:
    """The error for what is left of a piece: file, offset and length from where it stopped."""
    req = piece.request
    return SwapIOError(err, req.file.path, piece.offset + piece.done, piece.length - piece.done, req.op, detail)


def zero_transfer(piece: Piece) -> SwapIOError | None:
    """A read or write that moved no bytes. Past the requested length (inside the 4 KiB
    padding) a read has all it needs; anywhere else it is a truncated file."""
    req = piece.request
    if req.op == "read" and piece.offset + piece.done >= req.offset + req.length:
        return None
    return piece_error(piece, errno_mod.EIO, f"short {req.op}: the file ends here (truncated swap file?)")


class RequestGroup:
    """Requests that finish together; wait() raises the first error only after all are done."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests

    def done(self) -> bool:
        return all(r.done() for r in self.requests)

    def wait(self, timeout: float | None = None) -> None:
        first: SwapIOError | None = None
        for r in self.requests:
            try:
                r.wait(timeout)
            except SwapIOError as e:
                first = first or e
        if first is not None:
            raise first


def wait_quietly(request: Request | RequestGroup | None) -> bool:
    """Wait without raising, for a caller already unwinding from a first failure or dropping the data; whether
    the transfer succeeded (None: nothing was in flight)."""
    if request is None:
        return True
    try:
        request.wait()
    except Exception:  # noqa: BLE001 - the caller reports or redoes it; this wait only lets the buffer be reused
        return False
    return True


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block_size must be a positive multiple of 4096, got {block_size!r}")
    return block_size


class IOEngine:
    """What every engine offers. Use as a context manager; close() waits for what is in flight."""

    name = "engine"
    block_size: int  # every engine sets it (check_block_size) in its __init__

    def read(self, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
             verify: Verify | None = None) -> Request:
        return self.submit("read", file, buffer, offset, length, verify)

    def write(self, file: SwapFile, buffer: torch.Tensor, offset: int, length: int) -> Request:
        return self.submit("write", file, buffer, offset, length)

    def submit(self, op: str, file: SwapFile, buffer: torch.Tensor, offset: int, length: int,
               verify: Verify | None = None) -> Request:
        raise NotImplementedError

    def wait_all(self, requests: list[Request]) -> None:
        """Wait for every request; raise the first error only after all have finished."""
        RequestGroup(requests).wait()

    def close(self) -> None:
        pass

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def transfer_piece(piece: Piece) -> SwapIOError | None:
    """One piece with plain syscalls, short transfers continued; the thread engine's worker."""
    req = piece.request
    while piece.done < piece.length:
        mv = _memoryview_at(piece.address + piece.done, piece.length - piece.done)
        try:
            if req.op == "read":
                n = os.preadv(req.file.fd, [mv], piece.offset + piece.done)
            else:
                n = os.pwritev(req.file.fd, [mv], piece.offset + piece.done)
        except OSError as e:
            return piece_error(piece, e.errno or errno_mod.EIO)
        if n == 0:
            return zero_transfer(piece)
        piece.done += n
    return None


def _memoryview_at(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")
