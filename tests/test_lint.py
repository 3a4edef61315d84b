"""The code passes ruff (pycodestyle, pyflakes, bugbear and import order, as pyproject.toml configures it): part of
the test command."""

import subprocess
import sys

from conftest import REPO


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "offload", "tests", "tools", "examples"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
