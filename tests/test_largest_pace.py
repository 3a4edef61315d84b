"""tools/largest_pace.py, #44's "largest model this machine trains" row, as a smoke run at a tiny size on this CPU:
the estimate's choice for this machine is the one trained, and each tier's peak as the engine accounted it stays
within what the estimate said for that model (the device's here: host memory, not a GPU's allocator)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "largest_pace.py"


@pytest.mark.slow
def test_the_largest_choice_trains_within_its_estimate(tmp_path):
    out = tmp_path / "largest.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--params", "2e6", "--hidden", "64", "--seq", "64",
                           "--steps", "2", "--nvme-path", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and "error" not in result, result.get("traceback")
    largest = result["largest"]
    assert result["choice"] == max(largest, key=lambda k: largest[k]["params"])
    assert 0.8 * 2e6 < result["params"] < 1.2 * 2e6
    assert result["tokens_per_s"] > 0 and len(result["losses"]) == 3
    for tier in ("host", "nvme"):
        assert result["peaks"][tier] <= result["estimate"][tier], tier


def test_a_run_that_fails_writes_its_error_and_exits_1(tmp_path):
    out = tmp_path / "largest.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--fraction", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert proc.returncode == 1 and "--fraction 2.0 must be in (0, 1]" in result["error"]
