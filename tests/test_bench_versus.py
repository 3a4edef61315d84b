"""`offload bench step --baseline deepspeed`: one config read by both engines, a clear exit without DeepSpeed, and
the whole side-by-side run on a tiny model where DeepSpeed is installed (`./dev.sh deepspeed` installs it)."""

import io
import json

import pytest

from offload.bench import versus
from offload.bench.step import StepBench
from offload.commands.cli import main
from offload.config import Config

TINY = ["--warmup", "1", "--world", "1", "--hidden", "64", "--layers", "2", "--seq", "32", "--vocab", "512",
        "--micro", "2", "--steps", "2", "--rounds", "1"]


def test_without_deepspeed_the_command_says_how_to_install_it_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(versus, "deepspeed_version", lambda: None)
    assert main(["bench", "step", "--baseline", "deepspeed", *TINY, "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert "DeepSpeed is not installed" in err and "pip install --no-deps deepspeed" in err
    assert "./dev.sh deepspeed" in err and not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_the_shared_config_is_deepspeed_format_and_offload_runs_it_as_written(where, tmp_path):
    bench = StepBench(offload="nvme" if where == "nvme" else "cpu", nvme_path=str(tmp_path), world=1)
    raw = versus.shared_config(bench, where)
    assert "offload" not in raw  # nothing only one of the engines would read
    config = Config.load(json.loads(json.dumps(raw))).resolve(world_size=1)
    zero = config.zero_optimization
    assert zero.stage == 3 and zero.offload_param.device == zero.offload_optimizer.device == where
    assert config.gradient_clipping == 1.0 and config.train_micro_batch_size_per_gpu == bench.micro
    assert list(versus.variants(bench)) == (["host", "nvme"] if where == "nvme" else ["host"])


@pytest.mark.parametrize("name", list(versus.PLACEMENTS))
def test_every_placement_is_one_config_that_offload_reads_as_deepspeed_does(name, tmp_path):
    bench = StepBench(nvme_path=str(tmp_path), world=1)
    place = versus.PLACEMENTS[name]
    raw = versus.shared_config(bench, place)
    assert "offload" not in raw
    config = Config.load(json.loads(json.dumps(raw))).resolve(world_size=1)
    zero = config.zero_optimization
    assert (zero.offload_param.device, zero.offload_optimizer.device) == (place.params, place.optimizer)
    assert zero.offload_optimizer.ratio == place.ratio
    assert config.optimizer.params.torch_adam is place.torch_adam  # DeepSpeed's switch; offload's Adam either way
    assert raw.get("zero_force_ds_cpu_optimizer", True) is not place.torch_adam


def test_an_unknown_deepspeed_variant_is_a_usage_error(capsys, tmp_path):
    assert main(["bench", "step", "--baseline", "deepspeed", *TINY, "--variants", "host,gpu-only",
                 "--out", str(tmp_path / "s.json")]) == 2
    assert "no DeepSpeed variant 'gpu-only': choose from host, nvme, optimizer-host" in capsys.readouterr().err


@pytest.mark.skipif(versus.deepspeed_version() is None, reason="DeepSpeed is not installed (./dev.sh deepspeed)")
# The built-in GPT on two ranks in bf16, a Hugging Face GPT-2 on one in fp32: between them every path a third case
# (the built-in GPT on one rank in fp32) would take, 9 s less of a suite near its limit.
@pytest.mark.parametrize("world,model,dtype", [("2", None, "bf16"), ("1", "gpt2-tiny", "fp32")])
def test_side_by_side_runs_all_three_from_one_config_file(tmp_path, capsys, world, model, dtype):
    """The same model on every side: the built-in GPT, or a Hugging Face GPT-2 (--model), one config for both; in
    bf16, plain PyTorch on bf16 weights beside it under autocast (the like-for-like compute)."""
    if model is not None:
        pytest.importorskip("transformers")
    out = tmp_path / "step.json"
    args = [*TINY[:TINY.index("--world")], "--world", world, *TINY[TINY.index("--world") + 2:]]
    if model is not None:
        args += ["--model", model]
    args += ["--dtype", dtype]
    assert main(["bench", "step", "--baseline", "deepspeed", *args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())  # where --out says
    assert f"wrote {out}" in printed
    assert not result["errors"], result["errors"]
    path = result["configs"]["host"]
    bench = StepBench(**{k: tuple(v) if k == "stages" else v for k, v in result["bench"].items()})
    assert json.loads(open(path).read()) == versus.shared_config(bench, "cpu")
    sides = result["table"]["host"]
    assert set(sides) == {"torch", "offload", "deepspeed"} | ({"torch-bf16"} if dtype == "bf16" else set())
    for row in sides.values():
        assert row["step_s"] > 0 and row["peak_rss"] > 0
        assert row["spread_s"][0] <= row["step_s"] <= row["spread_s"][1]
    assert "DeepSpeed" in sides["deepspeed"]["optimizer"] or "Adam" in sides["deepspeed"]["optimizer"]
    ratios = result["ratios"]["host"]
    assert ratios["offload/deepspeed"] == pytest.approx(sides["offload"]["step_s"] / sides["deepspeed"]["step_s"])
    assert "offload/deepspeed" in printed and path in printed
    if dtype == "bf16":
        assert "bf16 weights, no fp32 master" in sides["torch-bf16"]["optimizer"]
        assert ratios["offload/torch-bf16"] == pytest.approx(sides["offload"]["step_s"] / sides["torch-bf16"]["step_s"])
        assert "offload/torch-bf16" in printed
    if model is not None:
        assert result["bench"]["model"] == model and printed.count(f"{model} ") >= 1


def _deepspeed_whose_cpu_adam_fails(rank, world, config_path):
    """DeepSpeed's first initialize fails as its op builder does without a CUDA toolkit (the injected fault)."""
    import deepspeed
    real, calls = deepspeed.initialize, []

    def initialize(**kwargs):
        calls.append(kwargs["config"])
        if len(calls) == 1:
            raise RuntimeError("Error building extension 'cpu_adam': nvcc not found")
        return real(**kwargs)
    deepspeed.initialize = initialize
    import torch

    from offload.models import GPT
    bench = StepBench(world=1, hidden=64, layers=2, seq=32, vocab=512, micro=2)
    torch.manual_seed(0)
    engine, name = versus.deepspeed_engine(GPT(bench.model_config()), bench, config_path)
    return name, calls[1]


@pytest.mark.skipif(versus.deepspeed_version() is None, reason="DeepSpeed is not installed (./dev.sh deepspeed)")
def test_where_deepspeeds_cpu_adam_does_not_build_it_runs_torchs_adam_and_says_so(tmp_path):
    from offload.machine.launch import run_ranks
    path = tmp_path / "config.json"
    path.write_text(json.dumps(versus.shared_config(StepBench(world=1, micro=2), "cpu")))
    name, config = run_ranks(_deepspeed_whose_cpu_adam_fails, 1, env={"DS_ACCELERATOR": "cpu"},
                             config_path=str(path))[0]
    assert "torch_adam: DeepSpeed's Adam op did not build: RuntimeError: Error building extension 'cpu_adam'" in name
    assert config["optimizer"]["params"]["torch_adam"] is True and config["zero_force_ds_cpu_optimizer"] is False


def test_an_error_raised_inside_deepspeeds_op_builder_counts_as_a_failed_build():
    # On torch 2.11 + CUDA 13 (the H100 of 2026-11-25) the builder's sort of the arch list raised a bare
    # ValueError: invalid literal for int() with base 10: '0a'. Code compiled under the builder's file name
    # raises the same here.
    where = "/site-packages/deepspeed/ops/op_builder/builder.py"
    builder = compile("def compute_capability_args():\n    return int('0a')\n", where, "exec")
    namespace: dict = {}
    exec(builder, namespace)
    with pytest.raises(ValueError) as inside:
        namespace["compute_capability_args"]()
    assert versus._op_build_failed(inside.value)
    with pytest.raises(ValueError) as elsewhere:
        int("0a")
    assert not versus._op_build_failed(elsewhere.value)  # a ValueError of the model's own is DeepSpeed's to raise


def test_deepspeed_reads_the_arch_list_without_the_arch_specific_suffixes():
    assert versus.deepspeed_arch_list("9.0a") == "9.0"
    assert versus.deepspeed_arch_list("8.0;9.0a;10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert versus.deepspeed_arch_list("8.6 9.0") == "8.6 9.0"


def test_the_optimizer_column_names_the_adam_that_offload_ran():
    mode = "early: Adam after the step returns (...)"  # where the state is: on the host, on the device
    assert versus._offload_optimizer_name(True, False, mode) == "offload native Adam (early)"
    assert versus._offload_optimizer_name(False, True, mode) == "offload torch fused Adam on the device (early)"
    assert "host, torch fused Adam on the device" in versus._offload_optimizer_name(True, True, mode)
    assert versus._offload_optimizer_name(True, True, mode, discrete=False) == (
        "offload native Adam on the host and the device (early)")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_a_gpu_the_table_shows_each_sides_gpu_high_water_mark(device):
    """#20 asks for the GPU memory high-water mark beside the step; on a CPU there is none to show."""
    row = {"step_s": 1.0, "spread_s": [0.9, 1.1], "forward_s": 0.3, "backward_s": 0.6, "optimizer_s": 0.1,
           "peak_rss": 3 << 30, "start_s": 2.0, "optimizer": "x"}
    table = {"host": {"torch": {**row, "peak_device": 5 << 30}, "offload": {**row, "peak_device": 2 << 30},
                      "deepspeed": {**row, "peak_device": 3 << 29}}}
    bench = {"layers": 2, "hidden": 64, "vocab": 128, "seq": 16, "micro": 2, "dtype": "bf16", "world": 1,
             "device": device, "repeats": 1, "steps": 1}
    out = io.StringIO()
    versus.print_table(versus.VersusResult(bench, 10**6, "0.19.8", {"host": "config-host.json"}, table), out)
    text = out.getvalue()
    if device == "cuda":
        assert "GPU peak" in text
        assert [line.split()[7] for line in text.splitlines() if line.startswith("  ") and "G " in line] == [
            "5.00G", "2.00G", "1.50G"]
    else:
        assert "GPU peak" not in text
