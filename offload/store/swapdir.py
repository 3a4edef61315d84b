"""A run's swap directory: its own, locked, with space reserved up front, and gone on clean exit.

Layout: ``<nvme_path>/offload-swap-<host>-<pid>-<start>/`` holding ``LOCK`` and the
swap files. The lock is an flock held for the life of the run, so a second job (or a
second engine in one job) that is handed the same directory fails at once instead of
overwriting live state. A run that ends without closing its engine (a script's last line,
an exception) still removes its own directory when the interpreter exits or the
directory's owner is collected: what it held dies with the process; only a killed process
leaves one behind.

[Note: reclaiming a killed run's swap] A directory whose lock nobody holds is a leftover.
``LOCK`` names the writer: pid, host, the process's start time and the boot it ran in. A
leftover whose writer is provably dead (this host, and the pid gone, or now another
process by its start time, or the machine rebooted since) is removed at start-up and the
log says what and how much, so that a crash-looping job does not fill the drive. Any other
(another host's, on a shared file system; a lock from an older offload that names no start
time; a writer that still runs) is left, with a warning and its size.

[Note: a swap directory appears locked] Ranks of one job share nvme_path, and each scans it
for leftovers while the others make their directories. A directory made in place has a
moment with no LOCK held: a scan then took the lock itself (finding a leftover of 0 B), and
the maker's own flock failed as "in use by another process". So a new directory is made
under a staging name no scan looks at, its LOCK taken and its owner written there, and only
then renamed to its name: under PREFIX every directory a scan meets is held or a leftover.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from offload.aio.base import IOEngine, SwapFile, SwapIOError
from offload.machine.buffers import round_up
from offload.store.budget import TierBudget

logger = logging.getLogger("offload.store")
PREFIX = "offload-swap-"
STAGING = ".offload-staging-"  # not PREFIX: a scan for leftovers never sees a directory being made


@dataclass(frozen=True)
class TierRoom:
    """What a store may take, as the placement planned it (offload/store/placement.py): the host and NVMe budgets,
    its swap directory with the I/O engine over it (None: nothing of it on NVMe), this rank (its files' names) and
    how many host buffers its transfers use."""

    host: TierBudget
    nvme: TierBudget
    swap: tuple[SwapDir, IOEngine] | None = None
    rank: int = 0
    buffer_count: int = 4


class SwapDirError(RuntimeError):
    """The swap directory cannot be used; says why and what to do."""


@dataclass(frozen=True)
class Owner:
    """Who wrote a swap directory's LOCK (see [Note: reclaiming a killed run's swap])."""
    pid: int
    host: str
    start: int | None = None  # the process's start, in clock ticks after boot (/proc/<pid>/stat)
    boot: str | None = None  # /proc/sys/kernel/random/boot_id

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), _process_start(os.getpid()), _boot_id())

    def line(self) -> str:
        return f"pid {self.pid} on {self.host} start {self.start} boot {self.boot}\n"

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        words = text.split()
        if len(words) < 4 or words[0] != "pid" or words[2] != "on" or not words[1].isdigit():
            return None
        fields = dict(zip(words[4::2], words[5::2], strict=False))
        start, boot = fields.get("start", ""), fields.get("boot", "None")  # line() writes None for what it lacked
        return cls(int(words[1]), words[3], int(start) if start.isdigit() else None, None if boot == "None" else boot)

    def gone(self) -> str | None:
        """Why this writer is provably dead, or None where it may live."""
        if self.host != socket.gethostname() or self.start is None:
            return None
        boot = _boot_id()
        if self.boot is not None and boot is not None and self.boot != boot:
            return f"the machine has rebooted since pid {self.pid} wrote it"
        start = _process_start(self.pid)
        if start is None:
            return f"pid {self.pid} on this host is gone"
        if start != self.start:
            return f"pid {self.pid} is now another process"
        return None


def _process_start(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22, starttime; the name may hold spaces


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def size_text(nbytes: int) -> str:
    """Bytes in the unit that shows them: "2.9 MB", "512 B"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Leftover:
    path: Path
    bytes: int
    owner: Owner | None = None  # None: the LOCK names no writer offload can check

    def dead(self) -> str | None:
        """Why its writer is provably dead (then it may be removed), or None."""
        return self.owner.gone() if self.owner is not None else None


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
            owner = Owner.parse(os.pread(fd, 400, 0).decode(errors="replace"))
        except BlockingIOError:
            continue  # held: a live run
        finally:
            os.close(fd)
        found.append(Leftover(d, _dir_bytes(d), owner))
    return found


def reclaim_leftovers(root: Path) -> None:
    """Remove the leftovers whose writers are provably dead; report the others (see [Note: reclaiming a killed
    run's swap])."""
    for left in find_leftovers(root):
        why = left.dead()
        if why is not None:
            shutil.rmtree(left.path, ignore_errors=True)
            logger.warning("swap: removed %s (%s), left by a run that was killed: %s", left.path,
                           size_text(left.bytes), why)
            continue
        logger.warning("swap: %s (%s) is left over from a run that did not exit cleanly; nothing holds it now, "
                       "but its writer may still live (%s). Delete it with `rm -r %s` once you are sure it is not "
                       "in use.", left.path, size_text(left.bytes),
                       "another host's" if left.owner is not None and left.owner.host != socket.gethostname()
                       else "its LOCK does not show that it is gone", left.path)


def _remove_dir(path: Path, lock_fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting: the directory is its parent's, still live
        return
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


def _locked_dir(root: Path, path: Path) -> int:
    """Make path with its LOCK held and return the lock's descriptor (see [Note: a swap directory appears locked])."""
    if not path.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=root))
        fd = os.open(staging / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else can see it yet
        os.pwrite(fd, Owner.me().line().encode(), 0)
        try:
            os.rename(staging, path)
            return fd
        except OSError as e:
            os.close(fd)
            shutil.rmtree(staging, ignore_errors=True)
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise SwapDirError(f"cannot create swap directory {path}: {e.strerror}") from None
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise SwapDirError(f"swap directory {path} is in use by {holder}; two runs must not share "
                           "swap files: give each its own nvme_path or let offload name the directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, Owner.me().line().encode(), 0)
    return fd


class SwapDir:
    """Owns one run's swap directory; use as a context manager, or call close()."""

    def __init__(self, nvme_path: str | os.PathLike[str], name: str | None = None) -> None:
        root = Path(nvme_path).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SwapDirError(f"cannot create nvme_path {str(root)!r}: {e.strerror}; point nvme_path at a "
                               "writable directory on the NVMe drive") from None
        reclaim_leftovers(root)
        self.path = root / (name or f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{int(time.time())}")
        self._lock_fd = _locked_dir(root, self.path)
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

    def release(self, name: str) -> None:
        """Swap file ``name`` is done with: closed, and its blocks given back."""
        f = self._files.pop(name)
        f.close()
        (self.path / name).unlink(missing_ok=True)

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
