"""`offload train`, the main job: runs end to end with and without NVMe, writes what it says, resumes
exactly from its checkpoints, and refuses bad arguments before any work starts."""

import json

import numpy as np
import pytest

from offload.commands.cli import main


def _train(tmp_path, *extra, out="out"):
    return main(["train", "--out", str(tmp_path / out), "--nvme-path", str(tmp_path / "swap"), "--print-every", "5",
                 *extra])


def _record(tmp_path, out="out"):
    return json.loads((tmp_path / out / "record.json").read_text())


def test_train_on_the_embedded_default_learns_and_writes_record_trace_and_plot(tmp_path, capsys):
    assert _train(tmp_path, "--steps", "20", "--expect-loss-drop") == 0  # the loss fell
    record = _record(tmp_path)
    assert len(record["losses"]) == 20 and record["losses"][-1] < record["losses"][0] - 0.5
    assert record["tokens_per_s"] > 0 and record["peak_rss_bytes"] > 0 and record["seconds_per_step"]["optimizer"] > 0
    assert json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "tok/s" in text and "host" in text and "peak RSS" in text
    # A newcomer's first lines say what runs in a few words each; why the step runs as it does is asked for.
    first = text.splitlines()[:3]
    assert first[2] == "step: after backward, step() returns after Adam (--verbose says why)"
    assert all(len(line) <= 100 for line in first), first
    assert "gradient clipping needs the global norm first" in record["step_mode"]


def test_verbose_says_why_the_step_runs_as_it_does(tmp_path, capsys):
    assert _train(tmp_path, "--steps", "1", "--verbose") == 0
    step = capsys.readouterr().out.splitlines()[2]
    assert step.startswith("step: after backward (gradient clipping needs the global norm first; not speculative")
    assert step[len("step: "):] == _record(tmp_path)["step_mode"]


def test_train_with_params_and_optimizer_on_nvme_and_a_hugging_face_model(tmp_path):
    assert _train(tmp_path, "--model", "llama-tiny", "--steps", "6", "--offload-optimizer", "nvme",
                  "--offload-param", "nvme", "--max-in-cpu", "0") == 0
    record = _record(tmp_path)
    assert record["memory"]["nvme"]["total"] > 0 and record["bytes_per_step"]["nvme_read"] > 0
    assert record["memory"]["nvme"]["parameter shards (two slots per unit)"] > 0
    assert all(np.isfinite(record["losses"]))
    assert not any((tmp_path / "swap").iterdir())  # the swap directory is cleaned on exit


def test_compile_trains_the_same_losses_with_the_blocks_compiled_and_says_what_dynamo_made(tmp_path, capsys):
    _train(tmp_path, "--steps", "6", out="eager")
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "6", "--compile", "aot_eager", out="compiled") == 0
    eager, compiled = _record(tmp_path, "eager"), _record(tmp_path, "compiled")
    assert eager["compile"] is None
    report = compiled["compile"]
    assert report["compiled"] == ["blocks.0", "blocks.1"] and report["graphs"] >= 1
    assert report["graph_breaks"] == 0 and report["recompiles"] == 0, report
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert "compiled: 2 module(s) ('blocks.0', 'blocks.1')" in capsys.readouterr().out


def test_resume_continues_exactly_where_the_checkpoint_left_off(tmp_path):
    _train(tmp_path, "--steps", "8", out="straight")
    _train(tmp_path, "--steps", "4", "--save-every", "2", out="half")
    _train(tmp_path, "--steps", "8", "--resume", out="half")
    straight, resumed = _record(tmp_path, "straight"), _record(tmp_path, "half")
    # the record keeps the first run's steps and adds the resumed ones: the whole run, as if it never stopped
    assert resumed["first_step"] == 0 and resumed["losses"] == straight["losses"]


def test_pre_tokenized_data(tmp_path):
    np.save(tmp_path / "tokens.npy", (np.arange(4000) * 7 % 50).astype(np.uint16))
    assert _train(tmp_path, "--data", str(tmp_path / "tokens.npy"), "--steps", "10") == 0
    assert _record(tmp_path)["params"] < 120_000  # a 50-token vocabulary, not 256


@pytest.mark.parametrize("extra,message", [
    (["--model", "gpt5"], "unknown model 'gpt5'; choose one of"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--config", "/no/such.json"], "no such file"),
    (["--resume"], "holds no checkpoint"),
    (["--hidden", "66"], "must be a multiple of --heads"),
])
def test_bad_arguments_are_clear_errors_before_any_work(tmp_path, capsys, extra, message):
    assert _train(tmp_path, *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_config_that_cannot_fit_its_budgets_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "tight.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "offload": {"budgets": {"host": "64KiB"}}}))
    assert _train(tmp_path, "--config", str(config)) == 2
    err = capsys.readouterr().err
    assert "the config cannot run here" in err and "offload.budgets.host" in err


def test_the_progress_bar_redraws_in_place_on_a_terminal_and_keeps_lines_in_a_log():
    import io

    from offload.commands.train import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term, log = Terminal(), io.StringIO()
    for stream in (term, log):
        bar = ProgressBar(4, stream)
        for done in range(1, 5):
            bar.update(done, f"step {done}/4 loss {5 - done}", keep=done in (1, 4))
    assert log.getvalue() == "step 1/4 loss 4\nstep 4/4 loss 1\n"
    shown = term.getvalue()
    assert shown.count("\r") == 4 and shown.count("\n") == 2  # every step drawn, two lines kept
    assert "[############............] step 2/4" in shown and shown.endswith("step 4/4 loss 1\n")


KILLED = """
import os, signal, sys
from offload.files import training_checkpoint
from offload.commands.cli import main
saves = []
def hook(name):
    if name == "meta-written":
        saves.append(name)
        if len(saves) == 4:  # the fourth save (step 8) dies before it is published: `latest` is step 6's
            os.kill(os.getpid(), signal.SIGKILL)
training_checkpoint.phase_hook = hook
main(sys.argv[1:])
"""


def test_a_killed_run_keeps_its_loss_history_and_its_swap_directory_is_reclaimed(tmp_path):
    import subprocess
    import sys
    common = ["--steps", "10", "--print-every", "5", "--offload-optimizer", "nvme"]
    assert main(["train", "--out", str(tmp_path / "straight"), "--nvme-path", str(tmp_path / "swap0"), *common]) == 0
    args = ["train", "--out", str(tmp_path / "killed"), "--nvme-path", str(tmp_path / "swap"), "--save-every", "2",
            *common]
    proc = subprocess.run([sys.executable, "-c", KILLED, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr
    # What a kill leaves: the record up to the last save, and the run's swap directory.
    assert len(_record(tmp_path, "killed")["losses"]) == 6
    assert [p.name.startswith("offload-swap-") for p in (tmp_path / "swap").iterdir()] == [True]
    assert main([*args, "--resume"]) == 0
    straight, resumed = _record(tmp_path, "straight"), _record(tmp_path, "killed")
    assert resumed["first_step"] == 0 and resumed["losses"] == straight["losses"]
    assert list((tmp_path / "swap").iterdir()) == []  # the dead run's directory reclaimed, this run's removed
