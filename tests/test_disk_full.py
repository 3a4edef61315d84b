"""A disk that fills: a save that does not fit fails on every rank with one plain message and leaves the disk as
it was; the last complete checkpoint resumes; swap files already running are never touched."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.commands.cli import main
from offload.files import training_checkpoint
from offload.files.training_checkpoint import CheckpointDiskFull, CheckpointError
from offload.machine.launch import run_ranks

CHECKPOINT = 1_500_000  # bytes of one gpt-tiny checkpoint (fp32 master and moments: 12 bytes a parameter)


def _leave_free(mnt, nbytes):
    """Fill ``mnt`` until about ``nbytes`` are free."""
    free = shutil.disk_usage(mnt).free
    with open(mnt / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - nbytes))
        f.flush()


def _fill(mnt):
    """Fill ``mnt`` to the last block."""
    with open(mnt / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(mnt / "filler2", "wb") as f:  # the last partial megabyte
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_offload_train_on_a_disk_that_fills_exits_1_with_one_line_and_resumes_from_the_last(tmp_path, small_fs,
                                                                                           capsys):
    save = small_fs(8)
    _leave_free(save, int(CHECKPOINT * 1.6))  # the first checkpoint fits, the second does not
    before = sorted(p.name for p in save.iterdir())
    args = ["train", "--out", str(tmp_path / "out"), "--steps", "6", "--save-every", "2", "--save-dir", str(save),
            "--print-every", "3"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"offload train: checkpoint 'global_step4' did not fit in {save}: its file system is full "
                          "(ENOSPC); a checkpoint of this run takes about "), err
    assert f"the last complete checkpoint is {save / 'global_step2'} (resume from it)" in err
    # the partial save is gone: only what was there, the first checkpoint and its pointer
    assert sorted(p.name for p in save.iterdir()) == sorted(
        before + [".lock", "global_step2", "latest", "zero_to_fp32.py"])
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert len(record["losses"]) == 4  # steps 3 and 4 ran; the save after step 4 failed
    (save / "filler").unlink()
    assert main([*args, "--resume"]) == 0
    assert (save / "latest").read_text() == "global_step6"


def _save_with_rank_1_out_of_room(rank, world, save_dir, err=errno.ENOSPC):
    """A good save, then one whose rank 1 runs out of disk mid-file (injected: ``err`` at its third array)."""
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, world))[0]
    for batch in batches(2, 2, seed=rank + 1):
        engine.backward(loss_of(engine, "gpt", batch))
        engine.step()
        if engine.global_steps == 1:
            engine.save_checkpoint(save_dir, tag="good")
    real = training_checkpoint.RankWriter.add
    calls = [0]

    def add(self, unit, kind, values):
        calls[0] += 1
        if calls[0] > 2:
            raise OSError(err, os.strerror(err))
        real(self, unit, kind, values)

    if rank == 1:
        training_checkpoint.RankWriter.add = add
    try:
        engine.save_checkpoint(save_dir, tag="bad")
        error = None
    except CheckpointDiskFull as e:
        error = (str(e), e.errno, type(e.__cause__).__name__ if e.__cause__ else None)
    except (OSError, CheckpointError) as e:
        error = (f"{type(e).__name__}: {e}", None, None)
    training_checkpoint.RankWriter.add = real
    left = sorted(os.listdir(save_dir))  # before anything else: the partial save is removed at once
    engine.close()
    return error, left


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_with_one_message_and_removes_it(tmp_path):
    (error0, left0), (error1, left1) = run_ranks(_save_with_rank_1_out_of_room, 2, timeout=150,
                                                 save_dir=str(tmp_path))
    assert error0[0] == error1[0] and error0[1] == error1[1] == errno.ENOSPC  # the same message on every rank
    assert error1[2] == "OSError" and error0[2] is None  # the rank that failed keeps its own error as the cause
    assert error0[0].startswith(f"checkpoint 'bad' did not fit in {tmp_path}: its file system is full (ENOSPC)")
    assert f"the last complete checkpoint is {tmp_path / 'good'}" in error0[0]
    assert left0 == left1 == [".lock", "good", "latest", "zero_to_fp32.py"]


def test_swap_files_already_running_never_meet_the_full_disk(tmp_path, small_fs):
    """NVMe swap files are preallocated at start: a disk filled afterwards leaves every step as it was."""
    def run(nvme_path, fill):
        torch.manual_seed(0)
        config = base_config(2, 1, 1, offload_optimizer={"device": "nvme", "nvme_path": str(nvme_path)},
                             offload_param={"device": "nvme", "nvme_path": str(nvme_path), "max_in_cpu": 0})
        engine = offload.initialize(model=make_model("gpt"), config=config)[0]
        losses = []
        for step, batch in enumerate(batches(4, 2)):
            if fill and step == 1:
                _fill(nvme_path)
                with pytest.raises(OSError) as full:  # the disk is full for anything new
                    (nvme_path / "more").write_bytes(b"\0" * (1 << 20))
                assert full.value.errno == errno.ENOSPC
            loss = loss_of(engine, "gpt", batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses

    assert run(small_fs(64), fill=True) == run(tmp_path / "swap", fill=False)


def test_another_write_error_on_one_rank_fails_every_rank_and_removes_the_partial_save(tmp_path):
    (error0, left0), (error1, left1) = run_ranks(_save_with_rank_1_out_of_room, 2, timeout=150,
                                                 save_dir=str(tmp_path), err=errno.EIO)
    assert error1[0] == "OSError: [Errno 5] Input/output error"  # its own error
    assert error0[0].startswith("CheckpointError: rank 0: another rank could not write its part of checkpoint 'bad'")
    assert left0 == left1 == [".lock", "good", "latest", "zero_to_fp32.py"]
