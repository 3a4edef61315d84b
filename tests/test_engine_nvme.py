"""Optimizer state on NVMe (and split between host and NVMe by the host budget): the same training as torch,
a pipelined step over sub-groups, and a failed transfer that loses nothing."""

import errno
import os

import pytest
import torch
from engine_cases import base_config, batches, check_parity, loss_of, make_model, train_engine, train_reference

import offload
from offload.aio.base import SwapIOError
from offload.aio.checksum import ChecksumError
from offload.machine.launch import run_ranks
from offload.store.tier import Tier


def nvme_config(path, world=1, accum=1, engine="auto", host=None, nvme=None, buffers=2):
    config = base_config(2, accum, world, sub_group_size=3000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path),
                                                        "buffer_count": buffers}
    config["offload"]["aio_engine"] = engine
    config["offload"]["budgets"] = {"host": host, "nvme": nvme}
    return config


@pytest.mark.parametrize("world,engine,buffers", [(1, "io_uring", 2), (2, "threads", 3), (2, "auto", 1)])
def test_nvme_optimizer_matches_torch(tmp_path, world, engine, buffers):
    config = nvme_config(tmp_path, world, accum=2, engine=engine, buffers=buffers)
    results = run_ranks(train_engine, world, name="gpt", config=config, steps=8, micro=2, accum=2)
    ref = train_reference("gpt", 8, 4 * world, 2, world=world)
    check_parity(results, ref)
    assert list(tmp_path.iterdir()) == [], "close() removes the swap directories"


def _split(rank, world, path, host):
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=nvme_config(path, world, host=host))
    tiers = dict(optimizer.store.placement.tiers)
    swap_files = [p for p in path.rglob("*.swap")]
    for tokens in batches(3, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        engine.step()
    out = tiers, len(swap_files), engine.memory_summary(), engine.full_state_dict()
    engine.close()
    return out


def test_host_budget_keeps_what_fits_on_the_host_and_the_rest_on_nvme(tmp_path):
    all_nvme = run_ranks(_split, 1, path=tmp_path / "a", host=None)[0]
    assert set(all_nvme[0]) == {"nvme"} and all_nvme[1] == 1
    host_part = all_nvme[2]["host"]["total"]  # accumulators, copies and NVMe buffers: what any split needs
    split = run_ranks(_split, 1, path=tmp_path / "b", host=host_part + 60_000)[0]
    tiers, _, summary, state = split
    assert tiers["host"] > 0 and tiers["nvme"] > 0
    assert summary["host"]["peak"] <= host_part + 60_000
    assert summary["nvme"]["total"] < all_nvme[2]["nvme"]["total"]
    ref = train_reference("gpt", 3, 2, 2, world=1)
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value)
        torch.testing.assert_close(all_nvme[3][key], value)


def test_budgets_that_cannot_work_fail_at_initialize_with_the_numbers(tmp_path):
    with pytest.raises(offload.ConfigError, match=r"offload.budgets.nvme: 10,000 bytes cannot hold the optimizer "
                                                  r"state on NVMe: [\d,]+ bytes"):
        offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path, nvme=10_000))
    with pytest.raises(offload.ConfigError, match="offload.budgets.host: 1,000 bytes cannot hold this rank's "
                                                  "gradient accumulators"):
        offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path, host=1_000))
    config = base_config(2, 1, 1)  # one micro-batch a step: no accumulators beside the state (about 500,000 bytes)
    config["offload"]["budgets"] = {"host": 450_000}
    with pytest.raises(offload.ConfigError, match="cannot hold the optimizer state on the host.*device: nvme"):
        offload.initialize(model=make_model("gpt"), config=config)


def test_the_steps_first_reads_start_when_the_last_backward_does(tmp_path):
    """They are issued ahead (one per buffer here: the sub-groups are of one size) and taken over by the step; a
    master read in between waits for them and drops them (the step reads again), and the training is bitwise the
    same either way."""
    def run(interleave: bool) -> tuple[dict, int, int]:
        engine, optimizer, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path, buffers=3))
        groups = sum(g.tier is Tier.NVME for g in optimizer.store.groups)
        for tokens in batches(4, 2):
            engine.backward(loss_of(engine, "gpt", tokens))
            if interleave:
                engine.full_state_dict()  # reads masters through the buffers the reads ahead hold
            engine.step()
        out = engine.full_state_dict(), optimizer.store.reads_ahead, groups
        engine.close()
        return out

    plain, ahead, groups = run(interleave=False)
    assert groups > 3 and ahead == 4 * 3  # every step: one read per buffer before its step began
    mixed, _, _ = run(interleave=True)
    for key, value in plain.items():
        assert torch.equal(mixed[key], value), key


def _run_steps(engine, steps, start=0):
    for tokens in batches(start + steps, 2)[start:]:
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_mid_step_loses_nothing_and_the_step_can_be_retried(tmp_path, monkeypatch, err):
    import offload.aio.base as base
    engine, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path, engine="threads"))
    _run_steps(engine, 2)
    before = engine.full_state_dict()
    real = os.pwritev
    calls = {"n": 0}

    def failing(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] == 3:  # the third write piece of the step: earlier sub-groups are already written
            raise OSError(err, os.strerror(err))
        return real(fd, bufs, off)

    monkeypatch.setattr(base.os, "pwritev", failing)
    tokens = batches(3, 2)[2]
    engine.backward(loss_of(engine, "gpt", tokens))
    with pytest.raises(SwapIOError, match=rf"write of .* in .*optimizer-rank0\.swap failed: .*errno {err}"):
        engine.step()
    after = engine.full_state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} changed by a step that failed"
    monkeypatch.undo()
    engine.step()  # retry the same step now that the disk works
    retried = engine.full_state_dict()
    engine.close()

    clean, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path / "clean", engine="threads"))
    _run_steps(clean, 3)
    expected = clean.full_state_dict()
    clean.close()
    for key, value in expected.items():
        assert torch.equal(retried[key], value), key


def test_a_corrupted_swap_file_is_a_checksum_error_naming_it(tmp_path):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path))
    _run_steps(engine, 1)
    swap = next(tmp_path.rglob("optimizer-rank0.swap"))
    first = engine.optimizer.store.groups[0]
    where = engine.optimizer.store._file.slots[first.index].current_offset + 100  # in its current slot
    with open(swap, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))
        os.fsync(f.fileno())
    os.posix_fadvise(os.open(swap, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    engine.backward(loss_of(engine, "gpt", batches(2, 2)[1]))
    with pytest.raises(ChecksumError, match="optimizer-rank0.swap"):
        engine.step()
    engine.close()
