"""The whole package passes mypy (configured in pyproject.toml's [tool.mypy]): part of the test command. What it
imports from elsewhere (torch, numpy) is read for its types, its errors not reported."""

import hashlib
import pathlib
import subprocess
import sys
import tempfile

from conftest import REPO

# What mypy checks: the whole package, every module in it.
CHECKED = ("offload",)

# mypy's incremental cache, kept between runs (a warm run is several times faster), one per checkout so that
# worktrees do not thrash one another's. mypy checks every entry against its source, so a stale one is harmless.
CACHE = pathlib.Path(tempfile.gettempdir()) / f"offload-mypy-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}"


def test_mypy_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(CACHE), *CHECKED],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
