"""The optimizer step overlapped with backward: exact (bitwise the same as stepping after backward), used only
when nothing global gates the update, and the engine says which mode it runs and why."""

import errno
import os

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    describe_engine,
    loss_of,
    make_model,
    train_engine,
    train_reference,
)

import offload
import offload.aio.base as aio_base
from offload.aio.base import SwapIOError
from offload.machine.launch import run_ranks
from offload.store.tier import Tier


def overlap_config(world, overlap, clip=0.0, optimizer="cpu", path=None, host=None):
    config = base_config(2, 2, world, clip=clip)
    config["offload"]["overlap_step"] = overlap
    if optimizer == "split":
        config["zero_optimization"]["sub_group_size"] = 3000
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path)}
        config["offload"]["budgets"] = {"host": host}
    return config


@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_step_is_bitwise_the_step_after_backward_and_matches_torch(world):
    runs = {mode: run_ranks(train_engine, world, name="gpt", config=overlap_config(world, mode), steps=6, micro=2,
                            accum=2) for mode in ("on", "off")}
    ref = train_reference("gpt", 6, 4 * world, 2, clip=0.0, world=world)
    for overlapped, after in zip(runs["on"], runs["off"]):
        assert overlapped["overlapped"] >= 6 * len(overlapped["state"]) // 4 and after["overlapped"] == 0
        assert overlapped["losses"] == after["losses"]
        for key, value in after["state"].items():
            assert torch.equal(overlapped["state"][key], value), key
            torch.testing.assert_close(value, ref["state"][key])


def test_split_state_steps_its_host_and_nvme_parts_during_backward(tmp_path):
    config = overlap_config(1, "on", optimizer="split", path=tmp_path, host=900_000)
    plan = run_ranks(describe_engine, 1, config=config)[0]
    assert plan["mode"].startswith("overlapped") and plan["tiers"]["host"] > 0 and plan["tiers"]["nvme"] > 0
    runs = {mode: run_ranks(train_engine, 1, name="gpt", config={**config, "offload": {**config["offload"],
                                                                                       "overlap_step": mode}},
                            steps=4, micro=2, accum=2) for mode in ("on", "off")}
    # every step but the first, which shows how many backward calls make a step (see [Note: more backward calls
    # than micro-batches])
    assert runs["on"][0]["overlapped"] == 3 * runs["on"][0]["units"]
    for key, value in runs["off"][0]["state"].items():
        assert torch.equal(runs["on"][0]["state"][key], value), key


@pytest.mark.parametrize("change,reason", [
    ({"gradient_clipping": 1.0, "offload": {"unit_bytes": 8192, "speculative_step": "off"}},
     "gradient clipping needs the global norm"),
    ({"fp16": {"enabled": True}, "offload": {"unit_bytes": 8192, "speculative_step": "off"}},
     "fp16 needs the overflow check"),
    ({"offload": {"unit_bytes": 8192, "overlap_step": "off"}}, "offload.overlap_step is off"),
])
def test_the_engine_says_why_it_does_not_overlap(change, reason):
    config = {**overlap_config(1, "on"), **change}
    mode = run_ranks(describe_engine, 1, config=config)[0]["mode"]
    assert mode.startswith("after backward") and reason in mode


def test_auto_overlaps_where_nothing_gates_the_update():
    # on a GPU too since the Adam left the host thread for the landing worker
    mode = run_ranks(describe_engine, 1, config=overlap_config(1, "auto"))[0]["mode"]
    assert mode.startswith("overlapped")


def test_a_host_thread_still_adding_the_previous_micro_batch_does_not_step_early():
    # A slow host thread (emulated by delaying each of its tasks) is still adding the first micro-batch's
    # gradients when the last micro-batch's backward begins; those must not trigger the overlapped step.
    slow = {**STREAM_CHECK, "OFFLOAD_EMULATED_COPY_DELAY_S": "0.02"}
    runs = {mode: run_ranks(train_engine, 1, env=slow, name="gpt", config=overlap_config(1, mode), steps=3,
                            micro=2, accum=2) for mode in ("on", "off")}
    assert runs["on"][0]["overlapped"] > 0
    assert runs["on"][0]["losses"] == runs["off"][0]["losses"]
    for key, value in runs["off"][0]["state"].items():
        assert torch.equal(runs["on"][0]["state"][key], value), key


def nvme_config(path, world, overlap, buffers=2, engine="auto"):
    config = overlap_config(world, overlap)
    config["zero_optimization"]["sub_group_size"] = 3000
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path),
                                                        "buffer_count": buffers}
    config["offload"]["aio_engine"] = engine
    return config


@pytest.mark.parametrize("world,buffers", [(1, 1), (2, 3)])
def test_nvme_sub_groups_step_during_backward_bitwise_as_after_it(tmp_path, world, buffers):
    runs = {mode: run_ranks(train_engine, world, name="gpt", config=nvme_config(tmp_path / mode, world, mode, buffers),
                            steps=5, micro=2, accum=2) for mode in ("on", "off")}
    ref = train_reference("gpt", 5, 4 * world, 2, clip=0.0, world=world)
    for overlapped, after in zip(runs["on"], runs["off"]):
        assert set(overlapped["tiers"]) == {"nvme"} and overlapped["mode"].startswith("overlapped")
        # every unit's gradient lands during backward, so every NVMe sub-group steps there (from the second step:
        # the first shows how many backward calls make a step)
        assert overlapped["overlapped"] == 4 * overlapped["units"] and after["overlapped"] == 0
        assert overlapped["losses"] == after["losses"]
        for key, value in after["state"].items():
            assert torch.equal(overlapped["state"][key], value), key
            torch.testing.assert_close(value, ref["state"][key])


def _steps(engine, data):
    for tokens in data:
        for half in tokens.split(2):
            engine.backward(loss_of(engine, "gpt", half))
            engine.step()


@pytest.mark.parametrize("fail_at", [2, 5])
def test_a_write_failing_under_backward_fails_the_step_which_can_be_retried(tmp_path, monkeypatch, fail_at):
    """fail_at 2: a write waited for on the host thread during backward; 5: one waited for by step()."""
    def build(path):
        engine, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(path, 1, "on", engine="threads"))
        return engine

    data = batches(3, 4)
    engine = build(tmp_path / "a")
    groups = sum(g.tier is Tier.NVME for g in engine.optimizer.store.groups)
    assert groups >= 5
    _steps(engine, data[:2])
    before = engine.full_state_dict()
    real, calls = os.pwritev, {"n": 0}

    def failing(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, off)

    monkeypatch.setattr(aio_base.os, "pwritev", failing)
    first, last = data[2].split(2)
    engine.backward(loss_of(engine, "gpt", first))
    engine.step()
    engine.backward(loss_of(engine, "gpt", last))  # the overlapped one: NVMe sub-groups step and write here
    with pytest.raises(SwapIOError, match=r"write of .* in .*optimizer-rank0\.swap failed: .*errno 28"):
        engine.step()
    monkeypatch.undo()
    masters = engine.full_state_dict()
    for key, value in before.items():
        assert torch.equal(masters[key], value), f"{key}: the failed step changed the master weights"
    engine.step()  # the same step again, now that the disk works
    retried = engine.full_state_dict()
    engine.close()
    clean = build(tmp_path / "b")
    _steps(clean, data)
    expected = clean.full_state_dict()
    clean.close()
    for key, value in expected.items():
        assert torch.equal(retried[key], value), key


def test_a_half_applied_step_is_finished_by_the_next_one_never_applied_twice():
    # Backward fails after the later units' shards were stepped during it: they keep that update; the retried
    # backward (overlapped again) and step update only the others, so each shard is stepped once for step 2. (The
    # first step shows the engine that a step takes one backward call: only then does the update begin during one,
    # see [Note: more backward calls than micro-batches].)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=overlap_config(1, "on") | {
        "train_batch_size": 2, "gradient_accumulation_steps": 1})
    opt = engine.optimizer
    first, tokens = batches(2, 2)
    engine.backward(loss_of(engine, "gpt", first))
    engine.step()
    start = {i: opt.master_of(i) for i in opt.shards}

    def fail(_grad):
        raise RuntimeError("injected backward failure")

    def hook(_module, _inputs, out):
        out.register_hook(fail)

    handle = engine.module.blocks[0].register_forward_hook(hook)
    with pytest.raises(offload.EngineError, match="half applied"):
        engine.backward(loss_of(engine, "gpt", tokens))
    handle.remove()
    failed = {i: opt.master_of(i) for i in opt.shards}
    stepped = {i for i in opt.shards if not torch.equal(failed[i], start[i])}
    assert 0 < len(stepped) < len(opt.shards)

    engine.zero_grad()
    engine.backward(loss_of(engine, "gpt", tokens))
    engine.step()
    assert opt.adam_steps == 2
    for i in opt.shards:
        after = opt.master_of(i)
        if i in stepped:
            assert torch.equal(after, failed[i]), opt.shards[i].name
        else:
            assert not torch.equal(after, start[i]), opt.shards[i].name
