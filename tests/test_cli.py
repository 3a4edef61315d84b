"""The command line: what the README tells users to run."""

import io
import json
import re
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import REPO

from offload.bench.step import StepBench
from offload.commands.cli import main
from offload.commands.demo import run_demo


def test_demo_trains_through_the_sharded_engine():
    result = run_demo(steps=40)
    assert result.last_loss < 0.7 * result.first_loss
    # released after use (on a CPU at W = 1 nothing is gathered: units are read in place, peak 0)
    assert result.units >= 4 and 0 <= result.peak_live < 0.5 * 150_000
    assert result.skipped_steps == 0


def test_demo_rejects_a_bad_config_with_the_key_path(capsys):
    assert main(["demo", "--config", '{"optimizer": {"params": {"lr": -1}}}']) == 2
    assert "optimizer.params.lr: must be >= 0" in capsys.readouterr().err


def test_config_check_reports_the_resolved_batch(capsys):
    assert main(["config", "check", str(REPO / "configs/zero3_fp16.json"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch: 64 = micro 8 x accumulation 4 x world 2" in out
    assert "zero stage 3: parameters on the host, optimizer state on the host" in out
    assert "budgets: none set (what is free at start)" in out and "scheduler: WarmupDecayLR" in out
    assert main(["config", "check", str(REPO / "configs/zero3_nvme_offload.json")]) == 0
    out = capsys.readouterr().out
    assert "parameters on NVMe (/tmp/offload_nvme), optimizer state on NVMe (/tmp/offload_nvme)" in out
    assert "budgets: host 16.00 GiB" in out and "offload_param.max_in_cpu): 1,000,000,000 elements" in out


def test_config_check_prints_resolved_json(capsys):
    assert main(["config", "check", str(REPO / "configs/zero3_bf16.json"), "--world-size", "4",
                 "--print-resolved"]) == 0
    out = capsys.readouterr().out
    resolved = json.loads(out[out.index("{"):])
    assert resolved["gradient_accumulation_steps"] == 1 and resolved["train_micro_batch_size_per_gpu"] == 8


def test_config_check_fails_with_exit_2_and_the_path(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    assert main(["config", "check", str(bad)]) == 2
    assert "zero_optimization.offload_param.nvme_path: is required" in capsys.readouterr().err


def test_info_names_the_active_kernels(capsys):
    from offload.machine import native
    assert main(["info"]) == 0
    assert f"native kernels: active {native.active_variant()}" in capsys.readouterr().out


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "offload", "config", "docs"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("# Config reference")


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["config"]])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_bench_adam_writes_json_with_every_comparison(tmp_path, capsys):
    out = tmp_path / "adam.json"
    assert main(["bench", "adam", "--sizes", "200K", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    impls = {(r["what"], r["impl"].split(" (")[0]) for r in report["rows"]}
    assert ("adam", "torch AdamW fused=True") in impls and ("adam", "offload adam_step") in impls
    assert ("adam", "offload adam_step into a second slot") in impls
    prefetching = {r["impl"].split(", ")[-1] for r in report["rows"] if r["impl"].startswith("offload adam_step (")}
    assert prefetching == {"prefetching)", "hardware prefetch only)"}  # each beside the ceiling and torch
    assert ("cpu-side", "offload norm + fused step") in impls and ("ceiling", "in-place axpy a += s*b") in impls
    ours = next(r for r in report["rows"] if r["impl"].startswith("offload adam_step"))
    assert ours["versus"]["value"] > 0 and ours["size"] == 200_000
    floors = {r["impl"].split(":")[0]: r for r in report["rows"] if r["what"] == "compute"}
    formats = {r["impl"].split(":")[0] for r in report["rows"] if r["what"] == "format"}
    assert formats and all(f["seconds"] > 0 and f["versus"]["value"] > 0 for f in floors.values())
    printed = capsys.readouterr().out
    # Each format has its floor, or says why not (a floor is a difference of two timings, which a VM whose speed
    # moves can make negative): never neither, never a floor for a format the bench did not step.
    unmeasured = set(re.findall(r"compute {4}([^:\n]+): its floor could not be measured", printed))
    assert set(floors) | unmeasured == formats and not set(floors) & unmeasured
    assert "x the rate of torch AdamW fused=True" in printed and "ns an element on one core" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_pcie_without_a_gpu_says_it_needs_one(capsys):
    assert main(["bench", "pcie"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert main(["bench", "step", "--device", "cuda"]) == 2
    assert "no usable GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bench_pcie_compares_pinned_and_pageable(tmp_path, capsys):
    out = tmp_path / "pcie.json"
    assert main(["bench", "pcie", "--pcie-size", "32Mi", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["gbps"]) == {"pinned h2d", "pinned d2h", "pageable h2d", "pageable d2h"}
    assert all(v > 0 for v in report["gbps"].values()) and report["duplex_gbps"] > 0
    assert "pinned" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_estimate_on_a_gpu_machine_prices_the_step_at_the_rates_it_measures_there(capsys):
    """Without --machine, the rates initialize measures (offload/engine/rates.py), so auto's split is start-up's;
    --machine h100 prices at the preset's."""
    assert main(["estimate", "--model", "gpt2", "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "GB/s measured on this machine" in out and "from the h100 preset" in out  # compute: the preset's
    assert main(["estimate", "--model", "gpt2", "--offload-optimizer", "cpu", "--machine", "h100"]) == 0
    assert "measured on this machine" not in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bench_step_on_the_gpu_reports_both_high_waters(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--device", "cuda", "--world", "1", "--hidden", "64", "--layers", "2", "--seq",
                 "16", "--micro", "2", "--steps", "2", "--rounds", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"]["device"] == "cuda"
    assert set(report["peak_device_bytes"]) == {"torch", *StepBench(device="cuda", world=1).variants()}
    assert all(v > 0 for v in report["peak_device_bytes"].values())
    assert "GPU memory high water" in capsys.readouterr().out


def test_bench_nvme_compares_engines_interleaved(tmp_path, capsys):
    out = tmp_path / "nvme.json"
    assert main(["bench", "nvme", "--path", str(tmp_path / "drive"), "--file-size", "8Mi", "--blocks", "1Mi",
                 "--depths", "4", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == {"read", "write"}
    assert {r["impl"] for r in rows} >= {"threads"}
    assert all(r["gb_per_s"] > 0 and r["file_bytes"] == 8 << 20 for r in rows)
    assert not (tmp_path / "drive" / "offload-bench-nvme.bin").exists()  # the scratch file is removed


def test_bench_step_compile_puts_compiled_and_eager_sides_beside_each_other(tmp_path, capsys):
    out = tmp_path / "compile.json"
    assert main(["bench", "step", "--compile", "aot_eager", "--world", "1", "--warmup", "1", "--hidden", "64",
                 "--layers", "2", "--seq", "16", "--micro", "2", "--steps", "2", "--rounds", "2", "--variants",
                 "params-host", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "aot_eager" and report["variant"] == "params-host"
    sides = ("torch", "torch-compiled", "offload", "offload-compiled")
    assert all(len(report["samples"][s]) == 4 for s in sides)  # two rounds of two steps, every side
    median = report["median_s"]
    for side in ("torch", "offload"):
        assert report["speedup"][side] == pytest.approx(median[side] / median[f"{side}-compiled"])
    saved = {side: median[side] - median[f"{side}-compiled"] for side in ("torch", "offload")}
    if saved["torch"] > 0.05 * median["torch"]:  # a share only where compiling saved plain PyTorch something
        assert report["gain_kept"] == pytest.approx(saved["offload"] / saved["torch"])
    else:
        assert report["gain_kept"] is None
    compared = {(c["subject"], c["baseline"]) for c in report["comparisons"]}
    assert ("offload compiled (aot_eager)", "torch compiled (aot_eager)") in compared
    assert all(c["quantity"] == "time" for c in report["comparisons"])
    assert "compiling speeds offload up" in capsys.readouterr().out


def test_bench_step_splits_the_step_and_compares_with_torch(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--warmup", "1", "--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2",
                 "--steps", "2", "--rounds", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ratio"] == pytest.approx(report["offload_step_s"] / report["torch_step_s"])
    assert set(report["phases_s"]) == {"gather", "gather_wait", "prefetch", "reduce_scatter", "all_reduce",
                                       "all_gather", "grad_wait", "optimizer", "compute"}
    variants = report["variants"]
    assert set(variants) == {"host", "host-no-prefetch", "clip-after", "clip-speculative-kept",
                             "clip-speculative-recomputed", "noclip-overlap", "noclip-after", "params-host",
                             "params-host-early"}
    # A speculation is kept where clipping does not fire and recomputed where it does. How many ran before the step
    # claimed their shard depends on the speculation lane's pace (the step steps the rest itself): some, not all.
    kept, recomputed = variants["clip-speculative-kept"], variants["clip-speculative-recomputed"]
    assert kept["speculation_kept"] > 0 and kept["speculation_recomputed"] == 0
    assert recomputed["speculation_recomputed"] > 0 and recomputed["speculation_kept"] == 0
    assert variants["clip-after"]["speculation_kept"] == variants["clip-after"]["speculation_recomputed"] == 0
    # Adam's time wherever it ran: on the training thread for the whole step, on the worker for the early one.
    assert variants["clip-after"]["adam_s"] == variants["clip-after"]["optimizer_s"]
    assert variants["params-host-early"]["adam_s"] > variants["params-host-early"]["optimizer_s"]
    text = capsys.readouterr().out
    assert "x torch" in text and "the early step's gain" in text
    assert "with clipping: Adam after backward" in text and "clip-speculative-recomputed" in text
    assert report["phases_s"]["gather"] > 0 and report["phases_s"]["optimizer"] > 0
    # Each rank receives half of every unit per gather: forward and backward gather the whole model once each.
    params = report["params"]
    assert report["bytes_per_step"]["all_gather"] >= 2 * params * 4 / 2
    # On a CPU the landing worker reads each reduced gradient where it lies and the new shards are written where
    # compute reads them: nothing crosses a link (a GPU copies each gradient down and each new shard back).
    assert report["bytes_per_step"]["d2h"] == 0 and report["bytes_per_step"]["h2d"] == 0


def test_bench_step_runs_only_the_variants_named_and_refuses_unknown_ones(tmp_path, capsys):
    out = tmp_path / "step.json"
    tiny = ["--warmup", "1", "--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2", "--steps", "1",
            "--rounds", "1", "--world", "1"]
    assert main(["bench", "step", *tiny, "--variants", "clip-after,host,ratio-half,delayed", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["clip-after", "host", "ratio-half", "delayed"]
    assert report["memory"]["ratio-half"]["device"] > report["memory"]["host"]["device"]  # half the state there
    from offload.machine.cpus import default_threads
    assert report["variants"]["host"]["adam_threads"] == default_threads()  # recorded: the count differs by machine
    assert "ratio-half:" in capsys.readouterr().out
    assert report["offload_step_s"] == report["variants"]["clip-after"]["step_s"]  # the first is the headline
    capsys.readouterr()
    assert main(["bench", "step", *tiny, "--variants", "host,clip-later"]) == 2
    assert "no variant 'clip-later' with offload cpu: choose from host, " in capsys.readouterr().err


def test_bench_step_spare_cores_variant_leaves_two_cores_to_the_rest():
    from offload.bench import step
    from offload.machine.cpus import default_threads
    bench = step.StepBench(hidden=64, layers=2, seq=16, micro=2, world=1, only=("host", "host-spare-cores"))
    variants = bench.variants()
    assert step.engine_config(bench, variants["host"])["offload"]["cpu_threads"] is None  # the default count
    assert step.engine_config(bench, variants["host-spare-cores"])["offload"]["cpu_threads"] == \
        max(1, default_threads() - 2)
    assert "host-spare-cores" not in step.StepBench(hidden=64, layers=2, seq=16, micro=2, world=1).variants()


def test_bench_step_trains_a_named_model_on_every_side(tmp_path, capsys):
    """#20's question is asked of the user's model: a model of the catalog (a Hugging Face GPT-2 here) at its own
    size, which --layers overrides, trained by plain PyTorch and by offload alike."""
    pytest.importorskip("transformers")
    from offload.models.catalog import build_model
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--warmup", "1", "--model", "gpt2-tiny", "--layers", "1", "--seq", "16",
                 "--micro", "2", "--steps", "1", "--rounds", "1", "--world", "1", "--variants", "host", "--out",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"]["model"] == "gpt2-tiny" and report["bench"]["layers"] == 1
    assert report["bench"]["hidden"] == 0  # its own width
    model = build_model("gpt2-tiny", 4096, 16, layers=1)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert report["params"] == sum(p.numel() for p in model.parameters())
    assert report["torch_step_s"] > 0 and report["variants"]["host"]["step_s"] > 0
    assert f"gpt2-tiny {report['params'] / 1e6:.1f}M (layers 1), seq 16" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["bench", "step", "--model", "gpt5"])
    assert refused.value.code == 2 and "invalid choice: 'gpt5'" in capsys.readouterr().err


def test_bench_step_compares_zero_stages_in_one_table_and_plot(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--warmup", "1", "--stage", "0,2,3", "--hidden", "64", "--layers", "2", "--seq",
                 "16", "--micro", "2", "--steps", "1", "--rounds", "1", "--checkpointing", "cpu", "--out",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"stage0", "stage2", "stage3"}
    memory = report["memory"]  # stage 0 holds everything on the device; stages 2-3 put the optimizer on the host
    assert memory["stage0"]["device"] > memory["stage2"]["device"] > memory["stage3"]["device"] - 4 * report["params"]
    assert memory["stage2"]["host"] > memory["stage0"]["host"]
    assert (tmp_path / "stages.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "stage2" in text and "every block checkpointed (inputs on the host" in text
    saved_inputs = 2 * 2 * 16 * 64 * 4  # two blocks' inputs: micro 2 x seq 16 x hidden 64, fp32
    assert memory["stage0"]["host"] == saved_inputs
    assert main(["bench", "step", "--stage", "1,x"]) != 0


def test_bench_step_with_nvme_compares_host_pipelined_and_serial(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--warmup", "1", "--offload", "nvme", "--path", str(tmp_path / "swap"),
                 "--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2", "--steps", "2", "--rounds", "1",
                 "--world", "1", "--sub-group-size", "20000", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"nvme", "host", "nvme-optimizer", "nvme-no-readahead", "nvme-serial",
                                       "nvme-optimizer-overlap", "host-overlap"}
    assert report["variants"]["host"]["nvme_bytes"] == 0
    # Every step reads and writes every sub-group's master and moments: 12 bytes per element, both ways; with
    # the parameters there too, it also writes each new 16-bit (here fp32) shard and reads it back to gather.
    per_rank = report["params"]  # one rank
    for name in ("nvme-optimizer", "nvme-optimizer-overlap"):
        assert report["variants"][name]["nvme_bytes"] >= 2 * 12 * per_rank
        assert report["variants"][name]["optimizer_io_s"] > 0
    assert report["variants"]["host-overlap"]["optimizer_io_s"] == 0
    assert report["variants"]["nvme"]["nvme_bytes"] >= 2 * 12 * per_rank + 2 * 4 * per_rank
    assert report["variants"]["nvme"]["param_read_s"] > 0 and report["variants"]["host"]["param_read_s"] == 0
    printed = capsys.readouterr().out
    assert "pipelining's gain" in printed and "read-ahead's gain" in printed and "% hidden" in printed
    assert "optimizer state transfers (nvme-optimizer-overlap)" in printed
    assert not any((tmp_path / "swap").iterdir())


def test_bench_step_early_nvme_moves_the_bytes_of_the_whole_step(tmp_path, monkeypatch):
    """Returning before the NVMe pass changes when bytes move, not how many: each is read and written once a
    step, and no read ahead is dropped. A lagging landing worker makes each pass spill into the next forward,
    and the bench counts bytes over whole steps (see [Note: bytes per step] in offload/bench/step.py: an H200
    counted 0.8 GB a step more for nvme-early when the window cut passes)."""
    monkeypatch.setenv("OFFLOAD_EMULATED_HOST_DELAY_S", "0.002")
    out = tmp_path / "step.json"
    # Four warm-up steps: the first steps nothing during backward (it shows how many backward calls make a step),
    # the second speculates (no step has clipped yet) and recomputes, whole; the passes settle from the fourth on.
    assert main(["bench", "step", "--offload", "nvme", "--path", str(tmp_path / "swap"), "--hidden", "64",
                 "--layers", "2", "--seq", "16", "--micro", "2", "--steps", "2", "--rounds", "1", "--world", "1",
                 "--warmup", "4", "--variants", "nvme,nvme-early", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    assert variants["nvme-early"]["early"] == 1.0 and variants["nvme"]["early"] == 0.0
    assert variants["nvme-early"]["nvme_bytes"] == variants["nvme"]["nvme_bytes"] > 0
    assert variants["nvme-early"]["wasted_read_bytes"] == variants["nvme"]["wasted_read_bytes"] == 0
    assert variants["nvme-early"]["wasted_write_bytes"] == variants["nvme"]["wasted_write_bytes"] == 0


def test_bench_all_quick_runs_every_benchmark_and_writes_one_json_and_a_plot(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "all", "--quick", "--path", str(tmp_path / "swap"), "--out", str(out)]) == 0
    report = json.loads((out / "all.json").read_text())
    assert report["quick"] and set(report["results"]) >= {"adam", "nvme", "step_cpu", "step_nvme"}
    benches = {h["bench"] for h in report["headlines"]}
    assert benches >= {"adam", "nvme", "step"} and all(h["value"] > 0 for h in report["headlines"])
    assert set(report["seconds"]) >= {"adam", "nvme", "step cpu", "step nvme"}
    assert set(report["results"]["step_nvme"]["variants"]) == {"nvme", "host"}
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert ("summary: each figure is its subject's time or rate over its baseline's: --quick, a smoke run, not "
            "figures to quote") in printed
    assert "step: against plain PyTorch's step (time, lower is better)" in printed
    assert "adam: against torch AdamW fused=True (rate, higher is better)" in printed
    assert "where the time went: " in printed
    assert "caution: " in printed  # its tiny steps are the machine's noise as much as the engine's


def test_bench_step_accumulates_micro_batches_on_both_sides(tmp_path, capsys):
    from offload.bench import step
    one, two = (step.run(step.StepBench(hidden=64, layers=2, seq=16, micro=2, world=2, steps=1, repeats=1, accum=accum,
                                        unit_bytes=8 << 10, headline_only=True), tmp_path / f"step{accum}.json")
                for accum in (1, 2))
    # ZeRO-3 gathers each unit for each micro-batch's forward and backward (persistent ones stay gathered): with two
    # micro-batches a step, nearly twice the bytes.
    assert 1.5 * one.bytes_per_step["all_gather"] < two.bytes_per_step["all_gather"] <= \
        2 * one.bytes_per_step["all_gather"]
    assert json.loads((tmp_path / "step2.json").read_text())["bench"]["accum"] == 2
    assert main(["bench", "step", "--baseline", "deepspeed", "--accum", "2"]) == 2
    assert "leave --accum at 1" in capsys.readouterr().err


def test_bench_step_profile_writes_a_torch_trace_with_the_engines_phases(tmp_path):
    from offload.bench import step
    bench = step.StepBench(hidden=64, layers=2, seq=16, micro=2, world=1, steps=1, repeats=1, unit_bytes=8 << 10,
                           headline_only=True, profile=True, trace_dir=str(tmp_path / "traces"))
    step.run(bench, tmp_path / "step.json")
    events = json.loads((tmp_path / "traces" / "profile-host.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"offload::forward", "offload::backward"} <= names and any(n.startswith("aten::mm") for n in names)
    with pytest.raises(ValueError, match="trace_dir"):
        step.StepBench(profile=True)


def test_the_speculative_steps_share_is_of_adams_time_wherever_it_ran():
    from offload.bench.step import speculation_hidden
    # An early-returning step: 2 ms of Adam on the training thread, 40 on the worker; speculation took 21 ms off.
    after = {"step_s": 0.060, "optimizer_s": 0.002, "adam_s": 0.042}
    assert speculation_hidden({"step_s": 0.039}, after) == pytest.approx(0.5)
    assert speculation_hidden({"step_s": 0.081}, after) == pytest.approx(-0.5)  # slower: negative


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_bench_step_prints_any_subset_of_its_variants(offload):
    """--variants picks any of them (the GPU plan ran nvme,nvme-early without host): each comparison line needs
    only its own pair."""
    from offload.bench import step
    names = list(step.StepBench(offload=offload, world=1)._all_variants())
    row = {k: 0.01 for k in ("step_s", "optimizer_s", "adam_s", "gather_s", "nvme_wait_s", "speculative_s",
                             "param_wait_s", "param_read_s", "optimizer_io_s", "collective_bytes",
                             "wasted_read_bytes", "wasted_write_bytes")}
    row |= {"copies_hidden": 0.5, "speculation_kept": 1.0, "speculation_recomputed": 0.0,
            "speculation_cancelled": 2.0, "nvme_bytes": 2**20, "early": 1.0, "adam_threads": 2.0}
    bench = asdict(step.StepBench(offload=offload, world=1))
    for first in names:
        for second in names:
            chosen = dict.fromkeys([first, second])
            result = step.StepResult(bench, 10**6, 0.01, 0.01, 1.0, variants={n: dict(row) for n in chosen},
                                     samples={n: [0.01] * 3 for n in chosen})
            out = io.StringIO()
            step.print_table(result, out)
            assert "offload ZeRO-3" in out.getvalue()
            if set(chosen) == {"host", "clip-speculative-kept"}:  # the GPU plan's pair: the early step its baseline
                assert ("against the host step's 10.0 (1.00x), 1 kept / 0 recomputed / 2 stepped by the step "
                        "itself per step") in out.getvalue()


def test_bench_step_device_budget_splits_auto_state_and_a_budget_too_small_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "step.json"
    tiny = ["--warmup", "1", "--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2", "--steps", "1",
            "--rounds", "1", "--world", "1", "--unit-bytes", "64Ki", "--variants", "host,ratio-auto"]
    # 10 MiB holds the shards, the gathers and the embedding's state, not the blocks' too: auto splits the state.
    assert main(["bench", "step", *tiny, "--device-budget", "10Mi", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"]["device_budget"] == 10 << 20
    auto, host = report["memory"]["ratio-auto"], report["memory"]["host"]
    assert host["device"] < auto["device"] <= 10 << 20
    assert 0 < auto["host"] < host["host"]  # part of the state stayed on the host
    assert "device budget (offload.budgets.device): 10 MiB" in capsys.readouterr().out
    # A budget below the shards and one gathered unit: the engine's own message, exit 2, no rank traceback.
    assert main(["bench", "step", *tiny, "--device-budget", "1Mi", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "offload.budgets.device: 1,048,576 bytes cannot hold" in err and "Traceback" not in err
    assert main(["bench", "step", "--device-budget", "1Gi", "--baseline", "deepspeed"]) == 2
    assert "DeepSpeed has no such budget" in capsys.readouterr().err


def test_bench_step_goes_on_when_plain_pytorch_does_not_fit(tmp_path, capsys, monkeypatch):
    """A model offload is for may not fit on the GPU without it: the variants still run and compare, and the table
    says why torch has no time (the out-of-memory error is injected: this machine has no GPU to fill)."""
    from offload.bench import step
    calls = []

    def out_of_memory(b):  # fits in the first round (a fake time), not in the second
        calls.append(b)
        if len(calls) == 1:
            return [0.001], 0
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")

    monkeypatch.setattr(step, "_torch_timed", out_of_memory)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--warmup", "1", "--hidden", "64", "--layers", "2", "--seq", "16", "--micro", "2",
                 "--steps", "1", "--rounds", "3", "--world", "1", "--variants", "host,ratio-half", "--out",
                 str(out)]) == 0
    assert len(calls) == 2  # and not again once it did not fit
    report = json.loads(out.read_text())
    assert report["torch_step_s"] is None and report["ratio"] is None and report["samples"]["torch"] == []
    assert report["torch_note"] == ("plain PyTorch ran out of cpu memory (CUDA out of memory. Tried to allocate "
                                    "20.00 GiB)")
    assert all(len(report["samples"][v]) == 3 and report["variants"][v]["step_s"] > 0 for v in ("host", "ratio-half"))
    # cuBLAS's failed allocations are RuntimeErrors and count too; any other error is no "did not fit".
    monkeypatch.setattr(step, "_torch_timed", lambda b: (_ for _ in ()).throw(
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")))
    assert step._torch_steps(step.StepBench(world=1))[2].startswith("plain PyTorch ran out of cpu memory")
    monkeypatch.setattr(step, "_torch_timed", lambda b: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        step._torch_steps(step.StepBench(world=1))
    text = capsys.readouterr().out
    assert "the offload variants run without it" in text and "= torch did not fit" in text


def test_bench_step_muon_runs_muon_on_both_sides(tmp_path):
    """--optimizer muon: plain PyTorch steps torch.optim.Muon on the matrices offload's type Muon takes and the
    fused AdamW on the rest; offload runs the config's type Muon, in the variants whose step it takes."""
    from offload.bench import step
    bench = step.StepBench(optimizer="muon", hidden=64, layers=2, seq=16, micro=2, world=1, steps=1, repeats=1,
                           unit_bytes=8 << 10)
    assert tuple(bench.variants()) == step.MUON_VARIANTS
    model = bench.build_model(on_device=False)
    muon, adamw = step._torch_optimizers(bench, model)
    assert isinstance(muon, torch.optim.Muon) and all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    assert sum(len(g["params"]) for o in (muon, adamw) for g in o.param_groups) == len(list(model.parameters()))
    assert step.engine_config(bench, {"device": "cpu"})["optimizer"]["type"] == "Muon"
    result = step.run(step.StepBench(**{**bench.__dict__, "only": ("host",)}), tmp_path / "step.json")
    assert result.offload_step_s > 0 and result.torch_step_s
    assert json.loads((tmp_path / "step.json").read_text())["bench"]["optimizer"] == "muon"
