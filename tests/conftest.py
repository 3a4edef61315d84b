import os
import pathlib

# One intra-op thread for torch in every worker and in every rank or script it starts (they inherit it). The suite
# runs three workers on two cores, and an OpenMP team of two per process spins while it waits for its partner, which
# another worker holds: on the AVX2 EPYC (2 vCPUs) the whole suite took 1080 s with the default team (both cores
# 97% busy: about 2100 CPU-s), 830 s and 1560 CPU-s with this (2026-12-07). Set before torch is imported, which
# reads it once; a developer who wants another team size sets OMP_NUM_THREADS themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 - after the thread count, which must come before torch

from offload.machine import native  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """No test leaves torch's intra-op team another size: a run after it in the same worker would round otherwise
    than the same run in a subprocess, and a resume-bitwise test there fails for another test's reason."""
    import torch
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before, f"this test left torch at {torch.get_num_threads()} threads, not {before}"


@pytest.fixture(autouse=True)
def _said_once_again():
    """zero.Init's fallback warning is said once a process: each test that looks for it sees it, whichever test
    of its worker fell back first."""
    import offload.zero.init
    offload.zero.init._said.clear()


@pytest.fixture
def repo() -> pathlib.Path:
    return REPO


@pytest.fixture
def small_fs(tmp_path):
    """A factory of real, small ext4 file systems (loop-mounted, so O_DIRECT works and a full disk is the kernel's
    ENOSPC), where the machine lets us mount one (root, losetup); skips elsewhere. Each is unmounted after."""
    import subprocess
    mounted = []

    def make(mib: int) -> pathlib.Path:
        image, mnt = tmp_path / f"fs{len(mounted)}.img", tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        with open(image, "wb") as f:
            f.truncate(mib << 20)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True)
        if made.returncode != 0 or subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                                                  capture_output=True).returncode != 0:
            pytest.skip("cannot loop-mount a small ext4 here (needs root and mkfs.ext4)")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:  # lazily: a closed engine's io_uring may let go of its files a moment later
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


@pytest.fixture(params=native.supported_variants())
def variant(request):
    """Run the test once per kernel variant this CPU can execute (portable included)."""
    before = native.active_variant()
    native.select_variant(request.param)
    yield request.param
    native.select_variant(before)


# --------------------------------------------------------------------------- the slow marker

SLOW_LIST = REPO / "tests" / "slow.txt"


def _slow_tests() -> dict[str, float]:
    """Node ids in tests/slow.txt (written by tools/slow_tests.py from a timed run), with their seconds there."""
    seconds: dict[str, float] = {}
    for line in SLOW_LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            took, nodeid = line.split()[:2]
            seconds[nodeid] = max(float(took), seconds.get(nodeid, 0.0))
    return seconds


QUICK_S = 0.3  # what a test not in tests/slow.txt is taken to cost (each took under 1.5 s there)


def _longest_files_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Order the test files by their expected time, the longest first, each file's tests kept in their order.
    ./dev.sh test hands whole files to its workers as each becomes free (--dist loadfile): longest first is the
    schedule that leaves no worker finishing a long file alone at the end, and a file's module-scoped fixtures
    (a Lightning or accelerate reference run) are built once."""
    cost: dict[str, float] = {}
    for item in items:
        cost[item.nodeid.split("::")[0]] = cost.get(item.nodeid.split("::")[0], 0.0) + seconds.get(item.nodeid, QUICK_S)
    position = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-cost[item.nodeid.split("::")[0]], position[item.nodeid]))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: over a few seconds each (tests/slow.txt); the inner loop is "
                                       "`./dev.sh test -m \"not slow\"`")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = _slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    _longest_files_first(items, slow)
    # A renamed or removed test must leave the list too. Parameters that depend on this CPU (kernel variants)
    # may be absent here, so the check is by test function.
    if not config.args or [str(a) for a in config.args] == ["tests"]:
        functions = {item.nodeid.split("[")[0] for item in items}
        gone = sorted(n for n in slow if n.split("[")[0] not in functions)
        if gone:
            raise pytest.UsageError(f"tests/slow.txt names tests that no longer exist: {', '.join(gone)}; remove "
                                    "them, or regenerate the list with tools/slow_tests.py")


# --------------------------------------------------------------------------- what this CPU could not run

def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which native kernel variants the variant-parametrised tests ran here, and which compiled ones this CPU
    cannot execute (so were checked only where another CPU runs the suite; NEON runs under qemu-user in
    test_native_cross.py wherever the cross tools are). No emulator from the registries runs AVX-512 here:
    Debian's qemu-user (7.2) stops on SIGILL at its first AVX-512 instruction, and Intel SDE is a download, not
    a package (docs/testing.md)."""
    ran, compiled = native.supported_variants(), native.compiled_variants()
    missing = [v for v in compiled if v not in ran]
    terminalreporter.write_line(f"kernel variants tested on this CPU: {', '.join(ran)}"
                                + (f"; not reachable here: {', '.join(missing)}" if missing else ""))
