"""offload.machine.host_malloc: with glibc's mmap threshold fixed, freed unit-sized buffers go back to the system."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from offload.config import Config, ConfigError
from offload.machine.host_malloc import resident

# Free one 2 MiB block (glibc then raises its threshold past 2 MiB), then allocate twenty more and free every
# other one: from the heap (the raised threshold), the freed ones stay resident between the live ones.
CHURN = """
import sys, torch
sys.path.insert(0, "tests")
from memwatch import rss_anon
from offload.machine.host_malloc import set_mmap_threshold
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(128 << 10)
first = torch.ones(512 << 10)
del first
before = rss_anon()
blocks = [torch.ones(512 << 10) for _ in range(20)]
del blocks[::2]
print(rss_anon() - before - 10 * (2 << 20))  # beyond the ten blocks still live
"""


def _retained(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], cwd=REPO, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_a_fixed_threshold_returns_freed_buffers_to_the_system():
    assert _retained("fixed") < 4 << 20  # of 20 MiB freed (glibc's default keeps about all of it here)


def test_the_setting_is_checked_and_off_unless_set():
    assert Config.load({}).offload.host_malloc.mmap_threshold is None
    assert Config.load({"offload": {"host_malloc": {"mmap_threshold": "128KiB"}}}).offload.host_malloc.mmap_threshold \
        == 128 << 10
    with pytest.raises(ConfigError, match=r"offload.host_malloc.mmap_threshold: must be <= 3.3\d+e\+07"):
        Config.load({"offload": {"host_malloc": {"mmap_threshold": "64MiB"}}})


def test_resident_counts_what_the_process_allocated():
    """What `offload bench step` reports per variant: 128 MiB written grow the anonymous RSS by as much."""
    before = resident()
    block = torch.ones(32 << 20)  # 128 MiB, every page written
    after = resident()
    assert before.anon is not None and after.anon is not None  # Linux
    assert after.anon - before.anon >= 120 << 20 and after.peak >= after.anon
    del block
