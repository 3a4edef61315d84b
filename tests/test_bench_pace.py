"""`offload bench step --baseline floor` (offload/bench/pace.py): each placement beside plain PyTorch and its floor,
max(compute, the host's Adam share at the rate measured in the run)."""

import json
import sys
from dataclasses import replace

import pytest
import torch

from offload.bench import pace
from offload.bench.step import StepBench, draw_on_gpu
from offload.commands.cli import main
from offload.models import GPT

TINY = ["--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2", "--vocab", "256", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--unit-bytes", "16Ki"]


def test_every_placement_is_timed_beside_plain_pytorch_against_its_floor(tmp_path, capsys):
    out = tmp_path / "floor.json"
    # a device budget that holds part of the optimizer state: auto splits it, full keeps it all on the host
    assert main(["bench", "step", "--baseline", "floor", *TINY, "--dtype", "bf16", "--clip", "0", "--device-budget",
                 "1Mi", "--variants", "full,auto,nvme", "--path", str(tmp_path / "nvme"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    table = result["table"]
    assert set(table) == {"torch", "torch-bf16", "full", "auto", "nvme"} and not result["errors"]
    assert result["clip"] == 0.0 and result["host_adam_ns_per_element"] > 0
    compute = min(table[s]["forward_s"] + table[s]["backward_s"] for s in ("torch", "torch-bf16"))
    for side in ("full", "auto", "nvme"):
        row = table[side]
        host = row["host_elements"] * result["host_adam_ns_per_element"] * 1e-9
        assert row["compute_s"] == pytest.approx(compute) and row["host_adam_s"] == pytest.approx(host)
        assert row["floor_s"] == pytest.approx(max(compute, host))
        assert row["to_floor"] == pytest.approx(row["step_s"] / row["floor_s"])
    assert table["full"]["device_elements"] == 0 and table["full"]["host_elements"] > 0
    assert 0 < table["auto"]["host_elements"] < table["full"]["host_elements"]  # the device kept the rest
    assert table["auto"]["host_elements"] + table["auto"]["device_elements"] == table["full"]["host_elements"]
    for name in ("full", "auto", "nvme"):  # each variant's config beside the result, as the engine read it
        config = json.loads((tmp_path / f"config-{name}.json").read_text())
        assert config["gradient_clipping"] == 0.0 and config["offload"]["budgets"]["device"] == 1 << 20
    printed = capsys.readouterr().out
    assert "floor = max(compute" in printed and "/floor" in printed


def test_on_a_gpu_the_floor_is_the_longest_lane_the_bus_directions_included(capsys):
    """#68: a streamed variant moves its state over the bus both ways; the floor prices each direction's bytes at
    the rate measured there, beside compute and the host's share, and names the lane that sets it."""
    phases = {"forward_s": 0.03, "backward_s": 0.07, "optimizer_s": 0.0}
    common = {"step_s": 0.2, "spread_s": [0.2, 0.2], "peak_device": 0, "device_elements": 0, "mode": ""}
    result = pace.PaceResult(bench={"hidden": 1, "layers": 1, "vocab": 1, "seq": 1, "micro": 1, "dtype": "bf16",
                                    "device": "cuda"}, params=10**9, clip=0.0, host_adam_ns_per_element=0.25,
                             configs={})
    result.table = {
        "torch": {**common, **phases},
        "full": {**common, **phases, "host_elements": 10**9, "streamed_elements": 0, "bus_up_bytes": 4 * 10**9,
                 "bus_down_bytes": 2 * 10**9, "h2d_gbps": 50.0, "d2h_gbps": 50.0},
        "stream-all": {**common, **phases, "host_elements": 0, "streamed_elements": 10**9,
                       "bus_up_bytes": 12 * 10**9, "bus_down_bytes": 14 * 10**9, "h2d_gbps": 50.0,
                       "d2h_gbps": 50.0}}
    pace._floors(result, ("torch",))
    full, streamed = result.table["full"], result.table["stream-all"]
    assert full["floor_s"] == pytest.approx(0.25) and full["floor_lane"] == "host Adam"
    assert full["bus_up_s"] == pytest.approx(0.08) and full["bus_down_s"] == pytest.approx(0.04)
    assert streamed["floor_s"] == pytest.approx(14e9 / 50e9) and streamed["floor_lane"] == "bus down"
    assert streamed["host_adam_s"] == 0.0 and streamed["compute_s"] == pytest.approx(0.1)
    pace.print_table(result, sys.stdout)
    assert "stream-all           lanes: compute 0.100 s, host Adam 0.000 s, bus up 0.240 s" in capsys.readouterr().out


def test_an_unknown_floor_variant_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "step", "--baseline", "floor", *TINY, "--variants", "full,nope",
                 "--out", str(tmp_path / "f.json")]) == 2
    err = capsys.readouterr().err
    assert "no floor variant 'nope': choose from full, full-after, full-overlap, auto, auto-params-device, nvme" in err


def test_the_variants_default_to_the_three_placements_of_a_model_larger_than_the_gpu():
    assert list(pace.variants()) == ["full", "auto", "auto-params-device"]


# The model every side builds (StepBench.build_model): on a GPU its weights are drawn there, since torch's CPU
# generator drew a 4.5B model's for a minute a side on the lent H200's host.
SMALL = StepBench(hidden=64, layers=2, vocab=256, seq=16)


def test_the_weights_are_drawn_on_the_gpu_where_they_fit_in_half_its_free_memory():
    params = 4_500_000_000  # 18 GB in fp32
    assert draw_on_gpu(params, free_bytes=140 << 30) and draw_on_gpu(params, free_bytes=36 * 10**9)
    assert not draw_on_gpu(params, free_bytes=36 * 10**9 - 2)


def test_on_the_host_the_bench_builds_as_plain_construction_does():
    torch.manual_seed(0)
    plain = GPT(SMALL.model_config())
    torch.manual_seed(0)
    built = SMALL.build_model()
    torch.manual_seed(0)
    bf16 = SMALL.build_model(on_device=True, dtype=torch.bfloat16)
    for (name, p), b, h in zip(plain.named_parameters(), built.parameters(), bf16.parameters()):
        assert torch.equal(p, b), name
        assert h.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), h), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_weights_are_drawn_there_and_handed_back_on_the_host():
    b = replace(SMALL, device="cuda", world=1)
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    host = b.build_model()
    assert {p.device.type for p in host.parameters()} == {"cpu"} and host.head.weight is host.wte.weight
    assert torch.cuda.memory_allocated() == before  # nothing of the construction stays on the GPU
    torch.manual_seed(0)
    device = b.build_model(on_device=True, dtype=torch.bfloat16)
    # every side draws the same weights; the high-water mark starts at what the side holds, not the construction
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    for (name, h), d in zip(host.named_parameters(), device.parameters()):
        assert d.is_cuda and d.dtype == torch.bfloat16 and torch.equal(h.to(torch.bfloat16), d.cpu()), name
