"""Keeping the last N checkpoints (offload.checkpoints.keep_last, --keep-last): older ones go only after a new one is
published, never the one `latest` names or one being written, and a kill at any point of a save leaves a
checkpoint to resume from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from offload.commands.cli import main
from offload.files.training_checkpoint import retire_old


def _tags(path):
    return sorted((p.name for p in path.iterdir() if (p / "meta.json").is_file()), key=lambda t: int(t[11:]))


def _published(root, tag, at):
    (root / tag).mkdir()
    (root / tag / "meta.json").write_text("{}")
    os.utime(root / tag / "meta.json", ns=(at, at))


def test_the_newest_are_kept_and_the_one_latest_names_too(tmp_path):
    for i, tag in enumerate(["global_step1", "global_step2", "global_step3", "global_step4"]):
        _published(tmp_path, tag, 10**9 * (i + 1))
    (tmp_path / ".tmp-global_step5").mkdir()  # a save being written: not a checkpoint yet
    (tmp_path / "latest").write_text("global_step1")  # a newer save did not move `latest` (save_latest=False)
    assert retire_old(tmp_path, None) == []
    assert retire_old(tmp_path, 2) == ["global_step2"]
    assert _tags(tmp_path) == ["global_step1", "global_step3", "global_step4"]
    assert (tmp_path / ".tmp-global_step5").is_dir()


def test_offload_train_keeps_the_last_n(tmp_path):
    save = tmp_path / "ckpt"
    assert main(["train", "--out", str(tmp_path / "out"), "--steps", "5", "--save-every", "1", "--keep-last", "2",
                 "--save-dir", str(save)]) == 0
    assert _tags(save) == ["global_step4", "global_step5"] and (save / "latest").read_text() == "global_step5"


KILLED = """
import os, signal, sys
from offload.files import training_checkpoint
from offload.commands.cli import main
at, phase = sys.argv.pop(1).split(":")
saves = []
def hook(name):
    if name == phase:
        saves.append(name)
        if len(saves) == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
training_checkpoint.phase_hook = hook
main(sys.argv[1:])
"""


def test_a_save_killed_after_its_rename_keeps_latest_and_resumes_as_the_run_that_never_stopped(tmp_path):
    """The fourth save (step 8) killed after its directory is renamed in but before `latest` moves: the newer
    directory is there, `latest` still names step 6, and retention (which runs after `latest`) has not run."""
    common = ["--steps", "10", "--print-every", "5", "--save-every", "2", "--keep-last", "2"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common, "--save-dir", str(tmp_path / "s")]) == 0
    save = tmp_path / "ckpt"
    args = ["train", "--out", str(tmp_path / "killed"), *common, "--save-dir", str(save)]
    proc = subprocess.run([sys.executable, "-c", KILLED, "4:renamed", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert _tags(save) == ["global_step4", "global_step6", "global_step8"]
    assert (save / "latest").read_text() == "global_step6"
    assert main([*args, "--resume"]) == 0
    assert _tags(save) == ["global_step8", "global_step10"] and (save / "latest").read_text() == "global_step10"
    straight = json.loads((tmp_path / "straight" / "record.json").read_text())["losses"]
    assert json.loads((tmp_path / "killed" / "record.json").read_text())["losses"] == straight
