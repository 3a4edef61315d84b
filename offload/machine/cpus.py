"""The CPUs this process may use, which is not what the machine reports.

[Note: CPUs a process may use] A lent GPU machine, a container or a job scheduler gives a
process a slice of a larger host: a CPU set (``taskset``, a cpuset cgroup, Slurm) and/or a
CPU-time quota (``docker --cpus``, a cgroup's ``cpu.max``). ``os.cpu_count()`` and
``psutil.cpu_count(logical=False)`` count the whole host, so threads sized by them (the
native Adam's, torch's intra-op team in the benchmarks) can outnumber the CPUs they get
many times over, each memory-bound sweep then time-sliced against itself. So threads are
sized by the physical cores among the CPUs in this process's affinity set (hyper-threads add
no memory bandwidth), bounded by the cgroup's quota where one is set.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from offload.config import Config

SYS = Path("/sys")
PROC = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroups(proc: Path) -> dict[str, str]:
    """Controller ("" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own = {}
    for line in (_read(proc / "self/cgroup") or "").splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _ancestry(root: Path, path: str) -> list[Path]:
    """The cgroup directory of ``path`` under ``root`` and each parent up to ``root``: a limit anywhere above
    applies too."""
    parts = [p for p in path.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def quota_cpus(sys_root: Path = SYS, proc: Path = PROC) -> int | None:
    """CPUs' worth of time the cgroup quotas over this process allow (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``; the smallest along its cgroup's ancestry); None: no quota, or none that could be read."""
    try:
        return _quota_cpus(sys_root, proc)
    except ValueError:  # a file this does not understand: a count too high is safer than a failed import
        return None


def _quota_cpus(sys_root: Path, proc: Path) -> int | None:
    own, limits = _own_cgroups(proc), []
    for directory in _ancestry(sys_root / "fs/cgroup", own.get("", "/")):
        quota, _, period = (_read(directory / "cpu.max") or "max").partition(" ")
        if quota != "max" and period:
            limits.append(int(quota) / int(period))
    for directory in _ancestry(sys_root / "fs/cgroup/cpu", own.get("cpu", "/")):
        quota_us, period_us = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
        if quota_us and period_us and int(quota_us) > 0:
            limits.append(int(quota_us) / int(period_us))
    return max(1, math.ceil(min(limits))) if limits else None


def _allowed() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this OS: every CPU it reports
        return set(range(os.cpu_count() or 1))


def usable_cpus(allowed: set[int] | None = None, sys_root: Path = SYS, proc: Path = PROC) -> int:
    """Logical CPUs this process may run on at once (see [Note: CPUs a process may use])."""
    allowed = _allowed() if allowed is None else allowed
    return _within_quota(len(allowed), sys_root, proc)


def physical_cores(allowed: set[int] | None = None, sys_root: Path = SYS, proc: Path = PROC) -> int:
    """Physical cores among the CPUs this process may run on, bounded by its cgroup quota (see [Note: CPUs a
    process may use]). A core is the set of CPUs that share it (``core_cpus_list``, or ``thread_siblings_list`` on
    older kernels; core ids repeat across dies); where that cannot be read, each allowed CPU counts as a core."""
    allowed = _allowed() if allowed is None else allowed
    cores: set[object] = set()
    for cpu in allowed:
        topology = sys_root / f"devices/system/cpu/cpu{cpu}/topology"
        siblings = _read(topology / "core_cpus_list") or _read(topology / "thread_siblings_list")
        if siblings is None:
            cores = set(allowed)
            break
        cores.add(siblings)
    return _within_quota(len(cores), sys_root, proc)


def _within_quota(count: int, sys_root: Path, proc: Path) -> int:
    """``count`` CPUs, at most as many as the cgroup quota allows, at least one."""
    quota = quota_cpus(sys_root, proc)
    return max(1, count if quota is None else min(count, quota))


@functools.cache  # sysfs is read once: small kernel calls ask for it every time
def default_threads() -> int:
    """Threads for offload's memory-bound host kernels: the physical cores this process may use."""
    return physical_cores()


def host_threads(config: Config, cores: int | None = None) -> int | None:
    """Threads for the host's optimizer step: offload.cpu_threads, else zero_optimization.offload_optimizer's
    cpuadam_cores_perc of ``cores`` (DeepSpeed's share; default: this process's physical cores), else None (the
    kernels' default, every core)."""
    if config.offload.cpu_threads is not None:
        return config.offload.cpu_threads
    share = config.zero_optimization.offload_optimizer.cpuadam_cores_perc
    return None if share is None else max(1, math.floor(share * (default_threads() if cores is None else cores)))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op team at n threads for the block, then as it was. A library call (a benchmark) leaves the
    process's compute as it found it: a matmul with another team size rounds otherwise, and a run after it in the
    same process would no longer be bitwise one in another process."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
