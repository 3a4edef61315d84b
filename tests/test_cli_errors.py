"""The command line as a careful user meets it: every user error is one paragraph and exit code 2 (checked where
the argument is parsed, before any work), a damaged checkpoint is reported as such, and nothing the user had is
lost or mixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from offload.commands.cli import main


def _files(tmp: Path) -> dict[str, str]:
    """Bad inputs of every kind, made once per test."""
    (tmp / "a-file").write_text("x")
    (tmp / "bad.json").write_text("{ not json")
    (tmp / "inf-lr.json").write_text('{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}')
    np.save(tmp / "float.npy", np.linspace(0, 1, 100))
    with open(tmp / "pickled.npy", "wb") as f:
        np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    return {name: str(tmp / name) for name in ("a-file", "bad.json", "inf-lr.json", "float.npy", "pickled.npy",
                                               "odd.bin")}


CASES = [  # (argv with {placeholders}, exit code, a fragment of the message)
    (["train", "--micro-batch", "0"], 2, "'0' is not a positive whole number"),
    (["train", "--lr", "-1"], 2, "'-1' is not a finite number >= 0"),
    (["train", "--lr", "nan"], 2, "'nan' is not a finite number >= 0"),
    (["train", "--seq", "0"], 2, "argument --seq"),
    (["train", "--steps", "-3"], 2, "argument --steps"),
    (["train", "--heads", "0"], 2, "argument --heads"),
    (["train", "--config", "{bad.json}"], 2, "is not valid JSON"),
    (["train", "--config", "{inf-lr.json}"], 2, "optimizer.params.lr: expected a finite number, got inf"),
    (["train", "--out", "{a-file}/out"], 2, "is a file, so the directory cannot be created there"),
    (["train", "--data", "{float.npy}"], 2, "holds float64 values; token ids are integers"),
    (["train", "--data", "{pickled.npy}"], 2, "is not an array of token ids saved with numpy.save"),
    (["train", "--data", "{odd.bin}"], 2, "its size must be even"),
    (["train", "--tag", "global_step2"], 2, "add --resume"),
    (["train", "--offload-optimizer", "nvme", "--nvme-path", "{a-file}"], 2, "is not a directory"),
    (["train", "--model", "gpt-small", "--hidden", "16384", "--heads", "64", "--layers", "64"], 2,
     "GiB is available; use --init-empty"),  # far larger than this machine: said before anything is built
    (["config", "check", "{inf-lr.json}"], 2, "expected a finite number"),
    (["export-weights", "{tmp}/none", "{tmp}/out", "--max-shard-size", "0"], 2, "'0' is not a positive size"),
    (["export-weights", "{tmp}/none", "{tmp}/out"], 2, "holds no complete checkpoint"),
    (["estimate", "--params", "abc"], 2, "'abc' is not a positive size"),
    (["estimate", "--params", "1e15"], 2, "units of"),
    (["tune-nvme", "--path", "{a-file}"], 2, "is a file; give a directory"),
    (["tune-nvme", "--path", "{tmp}/swap", "--quick", "--file-size", "1000"], 2, "smaller than this grid's largest "
                                                                                 "block (8 MiB)"),
    (["bench", "step", "--world", "0"], 2, "argument --world"),
    (["bench", "step", "--stage", "5"], 2, "give ZeRO stages 0-3"),
    (["bench", "adam", "--sizes", "0"], 2, "is not a positive size"),
    (["bench", "adam", "--world", "2"], 2, "unrecognized arguments: --world"),  # another benchmark's flag
    (["inspect", "{tmp}/none"], 2, "holds no complete checkpoint"),
    # Outputs that cannot be written are said before any work: a directory where a file goes, a file in the way
    # of a directory, and a directory where permissions pass but nothing can be created (/proc).
    (["bench", "step", "--out", "{tmp}", "--world", "1"], 2, "is a directory, not a file"),
    (["bench", "adam", "--out", "/proc/adam.json"], 2, "--out /proc/adam.json: no file can be created in /proc"),
    (["bench", "nvme", "--path", "/proc"], 2, "--path /proc: no file can be created in /proc"),
    (["bench", "all", "--quick", "--out", "{a-file}/results"], 2, "is a file, so the directory cannot be created"),
    (["estimate", "--params", "1e8", "--json", "{a-file}/x.json"], 2, "a-file is a file; choose another path"),
    (["demo", "--trace", "/proc/trace.json"], 2, "--trace /proc/trace.json: no file can be created in /proc"),
    (["tune-nvme", "--path", "{tmp}/swap", "--out", "/proc/tuned"], 2, "no file can be created in /proc"),
    (["export-weights", "{tmp}/none", "/proc/exported"], 2, "the output directory /proc/exported: no file can be"),
    (["train", "--out", "/proc/run"], 2, "--out /proc/run: no file can be created in /proc"),
]


@pytest.mark.parametrize("argv,code,message", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_a_user_error_is_one_paragraph_and_exit_2(tmp_path, capsys, argv, code, message):
    names = {**_files(tmp_path), "tmp": str(tmp_path)}
    for name, path in names.items():
        argv = [a.replace("{" + name + "}", path) for a in argv]
    if argv[0] == "train":
        argv += ["--out", str(tmp_path / "run")] if "--out" not in argv else []
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's usage errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # found before any work: no step ran, nothing was written


def test_the_real_entry_point_has_no_tracebacks_and_a_version(tmp_path):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "offload", *argv], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)
    proc = run("train", "--seq", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--seq" in proc.stderr
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("offload ")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    assert main(["train", "--steps", "2", "--save-every", "1", "--out", str(root / "run"), "--print-every", "1"]) == 0
    return root / "run" / "checkpoints"


def test_inspect_verifies_what_it_lists(checkpoint, tmp_path, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    assert "every checksum verified" in capsys.readouterr().out
    damaged = tmp_path / "damaged"
    import shutil
    shutil.copytree(checkpoint, damaged)
    rank_file = damaged / "global_step2" / "rank0.bin"
    rank_file.write_bytes(rank_file.read_bytes()[:-64])  # truncated
    assert main(["inspect", str(damaged)]) == 1
    captured = capsys.readouterr()
    assert "damaged" in captured.err and "rank0.bin" in captured.err and captured.out == ""


def test_a_closed_pipe_is_not_a_traceback(checkpoint):
    proc = subprocess.run(f"{sys.executable} -m offload inspect {checkpoint} | head -c 10", shell=True,
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_resume_past_the_last_step_says_so_and_keeps_the_record(checkpoint, tmp_path, capsys):
    out = checkpoint.parent
    before = json.loads((out / "record.json").read_text())["losses"]
    assert main(["train", "--steps", "2", "--resume", "--out", str(out)]) == 0
    assert "nothing left to do: the checkpoint is at step 2 and --steps is 2" in capsys.readouterr().out
    assert json.loads((out / "record.json").read_text())["losses"] == before
    # a tag to step around a damaged latest
    assert main(["train", "--steps", "2", "--resume", "--tag", "global_step1", "--out", str(tmp_path / "o"),
                 "--save-dir", str(checkpoint)]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_export_refuses_a_directory_with_weights_and_replaces_them_whole(checkpoint, tmp_path, capsys):
    out = tmp_path / "weights"
    assert main(["export-weights", str(checkpoint), str(out), "--max-shard-size", "20Ki"]) == 0
    sharded = sorted(p.name for p in out.iterdir())
    assert len(sharded) > 2 and "model.safetensors.index.json" in sharded
    assert all(os.stat(out / name).st_mode & 0o777 == 0o644 for name in sharded)  # the usual permissions
    assert main(["export-weights", str(checkpoint), str(out)]) == 2
    assert "already holds weights" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sharded  # untouched
    assert main(["export-weights", str(checkpoint), str(out), "--replace"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # the old shards and index went together


def test_the_tuning_progress_redraws_only_on_a_terminal():
    import io

    from offload.bench.tune import _progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, tty = io.StringIO(), Terminal()
    for done in range(1, 41):
        _progress(done, 40, f"cell {done}", log)
        _progress(done, 40, f"cell {done}", tty)
    assert "\r" not in log.getvalue() and log.getvalue().count("\n") == 10  # a line per tenth of the sweep
    assert tty.getvalue().count("\r") == 40 and tty.getvalue().endswith("\n")


def test_a_damaged_or_foreign_checkpoint_and_an_uncreatable_export_are_user_errors(checkpoint, tmp_path, capsys):
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    data = bytearray((damaged / "global_step2" / "rank0.bin").read_bytes())
    data[100] ^= 1
    (damaged / "global_step2" / "rank0.bin").write_bytes(bytes(data))
    run = ["train", "--steps", "3", "--resume", "--out", str(tmp_path / "o"), "--save-dir", str(damaged)]
    assert main(run) == 2
    assert "rank0.bin is damaged" in capsys.readouterr().err
    assert main(run + ["--tag", "global_step1"]) == 0  # stepped around it
    capsys.readouterr()
    assert main(["train", "--steps", "3", "--resume", "--hidden", "128", "--out", str(tmp_path / "o2"),
                 "--save-dir", str(checkpoint)]) == 2  # another model
    assert "does not fit this model" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["export-weights", str(checkpoint), str(tmp_path / "a-file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload export-weights: ") and "Traceback" not in err


def test_an_existing_output_file_that_cannot_be_written_is_said_before_any_work(tmp_path, capsys, monkeypatch):
    """A read-only result file from an earlier run (this test runs as root, for whom every file is writable: the
    permission is the injected fault)."""
    from offload.commands import cli_types
    old = tmp_path / "adam.json"
    old.write_text("{}")
    real = os.access
    monkeypatch.setattr(cli_types.os, "access", lambda p, mode: False if str(p) == str(old) else real(p, mode))
    assert main(["bench", "adam", "--out", str(old)]) == 2
    assert f"--out {old}: {old} exists and is not writable" in capsys.readouterr().err
