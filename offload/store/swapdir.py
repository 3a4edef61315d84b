"""A run's swap directory: its own, locked, with space reserved up front, and gone on clean exit.

Layout: ``<nvme_path>/offload-swap-<host>-<pid>-<start>/`` holding ``LOCK`` and the
swap files. The lock is an flock held for the life of the run, so a second job (or a
second engine in one job) that is handed the same directory fails at once instead of
overwriting live state. Directories whose lock nobody holds are a crashed run's
leftovers: they are reported with their size and never deleted silently (a
directory on a network file system may still be live on another host). A run that ends
without closing its engine (a script's last line, an exception) still removes its own
directory when the interpreter exits or the directory's owner is collected: what it
held dies with the process; only a killed process leaves one behind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from offload.aio.base import SwapFile, SwapIOError
from offload.machine.buffers import round_up

logger = logging.getLogger("offload.store")
PREFIX = "offload-swap-"


class SwapDirError(RuntimeError):
    """The swap directory cannot be used; says why and what to do."""


@dataclass(frozen=True)
class Leftover:
    path: Path
    bytes: int


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*") if p.is_file())


def find_leftovers(nvme_path: str | os.PathLike[str]) -> list[Leftover]:
    """Swap directories under nvme_path that no live run holds."""
    found: list[Leftover] = []
    root = Path(nvme_path)
    if not root.is_dir():
        return found
    for d in sorted(root.glob(PREFIX + "*")):
        lock = d / "LOCK"
        if not d.is_dir() or not lock.exists():
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # held: a live run
        finally:
            os.close(fd)
        found.append(Leftover(d, _dir_bytes(d)))
    return found


def _remove_dir(path: Path, lock_fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting: the directory is its parent's, still live
        return
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


class SwapDir:
    """Owns one run's swap directory; use as a context manager, or call close()."""

    def __init__(self, nvme_path: str | os.PathLike[str], name: str | None = None) -> None:
        root = Path(nvme_path).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SwapDirError(f"cannot create nvme_path {str(root)!r}: {e.strerror}; point nvme_path at a "
                               "writable directory on the NVMe drive") from None
        for left in find_leftovers(root):
            logger.warning("swap: %s (%.2f GB) is left over from a run that did not exit cleanly; nothing holds "
                           "it now. Delete it with `rm -r %s` once you are sure it is not in use.",
                           left.path, left.bytes / 1e9, left.path)
        self.path = root / (name or f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{int(time.time())}")
        self.path.mkdir(exist_ok=True)
        self._lock_fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self._lock_fd)
            raise SwapDirError(f"swap directory {self.path} is in use by {holder}; two runs must not share "
                               "swap files: give each its own nvme_path or let offload name the directory") \
                from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._files: dict[str, SwapFile] = {}
        self._closed = False
        # At interpreter exit, or when collected unclosed: the directory goes (the open files' data with it).
        self._remove = weakref.finalize(self, _remove_dir, self.path, self._lock_fd, os.getpid())

    def reserve(self, name: str, nbytes: int) -> SwapFile:
        """A swap file of nbytes (rounded up to 4 KiB) with its blocks allocated now, so a full
        disk is an error at start-up rather than in the middle of training."""
        if name in self._files:
            raise ValueError(f"swap file {name!r} already exists in {self.path}")
        size = round_up(nbytes)
        f = SwapFile.open(self.path / name)
        try:
            os.posix_fallocate(f.fd, 0, size)
        except OSError as e:
            f.close()
            (self.path / name).unlink(missing_ok=True)
            free = shutil.disk_usage(self.path).free
            if e.errno == errno.ENOSPC:
                raise SwapIOError(errno.ENOSPC, str(self.path / name), 0, size, "reserve",
                                  f"no space left: {size:,} bytes needed, {free:,} free on that file system; "
                                  "free space, lower the NVMe budget, or keep more state on the host") from None
            raise SwapIOError(e.errno or errno.EIO, str(self.path / name), 0, size, "reserve") from None
        self._files[name] = f
        return f

    def close(self) -> None:
        """Close and delete every swap file and the directory (the clean-exit path)."""
        if self._closed:
            return
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._remove()
        self._closed = True

    def __enter__(self) -> SwapDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
