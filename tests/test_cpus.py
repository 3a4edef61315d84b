"""Threads are sized by the CPUs this process may use, not the host's count: the physical cores in its affinity set,
bounded by its cgroup's CPU quota (a container's slice of a large host)."""

import os

import pytest

from offload.machine import cpus, native


def fake_sys(root, cores_of, cpu_max=None, v1=None, siblings_file="core_cpus_list"):
    """A sysfs tree: CPU i on core cores_of[i] (each core's CPUs listed in siblings_file, and a core_id that
    repeats across dies, which must not merge cores); cgroup v2's cpu.max, or v1's quota and period."""
    for cpu, core in enumerate(cores_of):
        topology = root / f"devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "core_id").write_text(f"{core % 2}\n")
        (topology / siblings_file).write_text(",".join(str(i) for i, c in enumerate(cores_of) if c == core) + "\n")
    if cpu_max is not None:
        (root / "fs/cgroup").mkdir(parents=True)
        (root / "fs/cgroup/cpu.max").write_text(cpu_max + "\n")
    if v1 is not None:
        (root / "fs/cgroup/cpu").mkdir(parents=True)
        (root / "fs/cgroup/cpu/cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (root / "fs/cgroup/cpu/cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return root


# Eight CPUs on four cores, hyper-thread siblings numbered apart (0 and 4 share core 0), as Linux numbers them.
SIBLINGS = [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("allowed, cpu_max, physical, usable", [
    (set(range(8)), "max 100000", 4, 8),  # the whole host, no quota: its cores
    ({0, 1, 4, 5}, "max 100000", 2, 4),  # a CPU set of two cores with their siblings
    ({0, 1, 2, 3}, "max 100000", 4, 4),  # one thread of each core
    (set(range(8)), "250000 100000", 3, 3),  # docker --cpus=2.5: three CPUs' worth at once, at most
    ({0, 4}, "50000 100000", 1, 1),
])
def test_the_cpus_a_process_may_use_bound_its_threads(tmp_path, allowed, cpu_max, physical, usable):
    root = fake_sys(tmp_path, SIBLINGS, cpu_max=cpu_max)
    assert cpus.physical_cores(allowed, root) == physical
    assert cpus.usable_cpus(allowed, root) == usable


def test_cgroup_v1_quota_and_a_host_without_topology(tmp_path):
    root = fake_sys(tmp_path / "v1", SIBLINGS, v1=(400000, 100000))
    assert cpus.physical_cores(set(range(8)), root) == 4 and cpus.usable_cpus(set(range(8)), root) == 4
    root = fake_sys(tmp_path / "v1-unlimited", SIBLINGS, v1=(-1, 100000))
    assert cpus.quota_cpus(root) is None and cpus.usable_cpus(set(range(8)), root) == 8
    older = fake_sys(tmp_path / "older", SIBLINGS, siblings_file="thread_siblings_list")
    assert cpus.physical_cores({0, 1, 4, 5}, older) == 2
    bare = tmp_path / "bare"  # no topology, no cgroup files (some VMs, other kernels): each allowed CPU is a core
    bare.mkdir()
    assert cpus.physical_cores({0, 1, 2}, bare) == 3 and cpus.quota_cpus(bare) is None


@pytest.mark.parametrize("own, limits, expected", [
    ("0::/jobs/trainer\n", {"fs/cgroup/jobs/cpu.max": "300000 100000", "fs/cgroup/jobs/trainer/cpu.max": "max 100000"},
     3),  # v2: a parent's limit holds below it
    ("0::/jobs/trainer\n", {"fs/cgroup/jobs/cpu.max": "max 100000", "fs/cgroup/jobs/trainer/cpu.max": "150000 100000"},
     2),
    ("2:cpu,cpuacct:/slurm/job1\n0::/\n", {"fs/cgroup/cpu/slurm/job1/cpu.cfs_quota_us": "200000",
                                             "fs/cgroup/cpu/slurm/job1/cpu.cfs_period_us": "100000"}, 2),  # v1
    ("0::/\n", {}, None),
    ("garbage\n0::/\n", {"fs/cgroup/cpu.max": "lots 100000"}, None),  # not understood: no bound, no error
])
def test_the_quota_is_read_where_this_process_s_cgroup_is(tmp_path, own, limits, expected):
    root, proc = fake_sys(tmp_path / "sys", SIBLINGS), tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text(own)
    for path, text in limits.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")
    assert cpus.quota_cpus(root, proc) == expected
    assert cpus.usable_cpus(set(range(8)), root, proc) == (expected or 8)


def test_the_native_kernels_default_to_the_cores_this_process_may_use():
    allowed = os.sched_getaffinity(0)
    assert native.default_threads() == cpus.physical_cores() <= len(allowed)
    assert 1 <= cpus.usable_cpus() <= len(allowed)
