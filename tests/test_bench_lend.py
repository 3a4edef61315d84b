"""`offload bench lend` runs end to end on the emulated discrete device: offload's round trips lend what the device
holds (the fp32 parameters, their state and gradients) and give it all back, beside the bus's copy of the same
bytes; DeepSpeed's side is skipped with the reason where there is no GPU."""

import json

import pytest
import torch

from offload.bench.step import StepBench
from offload.commands.cli import main


def test_bench_lend_round_trips_what_the_device_holds(tmp_path, capsys):
    out = tmp_path / "lend.json"
    assert main(["bench", "lend", "--device", "cpu", "--hidden", "64", "--layers", "2", "--vocab", "256",
                 "--dtype", "fp32", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    torch.manual_seed(0)
    params = sum(p.numel() for p in StepBench(hidden=64, layers=2, heads=1, vocab=256).build_model().parameters())
    ours, bus = result["summary"]["offload"], result["summary"]["bus"]
    # the parameters (4 bytes), Adam's master and moments (12) and at most a gradient (4) an element
    assert 16 * params <= ours["lent_bytes"] <= 20 * params + (1 << 20)
    assert ours["returned"] and bus["lent_bytes"] == ours["lent_bytes"]
    assert len(result["sides"]["offload"]["out_s"]) == 2 and ours["x_offload"] == 1.0 and bus["x_bus"] == 1.0
    assert "no GPU" in result["summary"]["deepspeed"]["skipped"]
    assert "round trip" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_bench_lend_on_cuda_without_a_gpu_says_so(capsys):
    assert main(["bench", "lend", "--device", "cuda"]) == 2
    assert "no usable GPU" in capsys.readouterr().err
