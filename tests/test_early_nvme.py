"""The early step with the optimizer state on NVMe (see [Note: the early step on NVMe] in offload/optim/early_step.py):
the state's reads, Adam and writes run on the landing worker after engine.step() returned, in the forward's order.

Bitwise the whole step, with the worker lagging far behind (``OFFLOAD_EMULATED_HOST_DELAY_S``) so that a forward
reading a unit before its Adam, a read ahead starting before the last pass let go of the buffers, or a reader that
did not drain would see other values; and a transfer that fails after step() returned is said, never hidden."""

from __future__ import annotations

import os

import pytest
import torch
from engine_cases import base_config, batches, check_bitwise, describe_engine, loss_of, make_model, train_engine

import offload
from offload.machine.launch import run_ranks
from offload.optim.early_step import EarlyStepLost
from offload.store.tier import Tier

HOST_LAG = {"OFFLOAD_EMULATED_HOST_DELAY_S": "0.003"}


def nvme_config(path, world: int = 1, accum: int = 1, early: str = "on", speculative: str = "auto",
                host: int | None = None, clip: float = 1.0) -> dict:
    config = base_config(2, accum, world, clip=clip, sub_group_size=3000)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2}
    config["offload"].update(early_step=early, speculative_step=speculative, aio_engine="threads",
                             budgets={"host": host})
    return config


@pytest.mark.parametrize("world,accum,speculative,clip", [(1, 1, "off", 1.0), (1, 1, "auto", 2.0),
                                                           (1, 2, "auto", 1.0), (2, 1, "auto", 1.0)],
                         ids=["W1-after-backward", "W1-adaptive-mixed", "W1-accum2-adaptive", "W2-adaptive"])
def test_the_early_nvme_step_trains_bitwise_as_the_whole_step(tmp_path, world, accum, speculative, clip):
    """``auto`` speculation on NVMe runs only after a step whose clipping did not fire (and on the first step that
    can step during backward, the second: the first shows how many backward calls make a step), so the second step
    speculates and recomputes (it clips) and the next returns early; at W = 1 with a max norm of 2.0
    the steps after the first do not clip, so they speculate and keep, their pass run in backward and finished in
    the step."""
    runs = {early: run_ranks(train_engine, world, env=HOST_LAG, name="gpt", steps=5, micro=2, accum=accum,
                             config=nvme_config(tmp_path / early, world, accum, early, speculative, clip=clip))
            for early in ("on", "off")}
    assert "NVMe reads, Adam and writes run beside the next forward" in runs["on"][0]["mode"]
    assert "step() returns after Adam" in runs["off"][0]["mode"]
    counts = runs["on"][0]["counts"]
    assert counts.get("optimizer_early", 0) > 0 and "optimizer_early" not in runs["off"][0]["counts"]
    if speculative == "auto" and clip == 1.0:  # every step clips: the second speculates and recomputes
        assert counts.get("speculation_recomputed", 0) > 0, counts
    if clip == 2.0:
        assert counts.get("speculation_kept", 0) > 0, counts
    check_bitwise(runs["on"], runs["off"])


def test_host_and_nvme_sub_groups_step_early_in_the_forwards_order(tmp_path, monkeypatch):
    """A host budget keeps the first sub-groups on the host and the rest on NVMe: the early step walks both in unit
    order, and a reader right after step() (here the whole state dict) sees the finished step."""
    monkeypatch.setenv("OFFLOAD_EMULATED_HOST_DELAY_S", "0.003")
    probe = describe_engine(0, 1, nvme_config(tmp_path / "probe", early="off"))
    host = probe["memory"]["host"]["total"] + 60_000

    def run(early: str) -> tuple[dict, dict, list[float]]:
        engine, optimizer, *_ = offload.initialize(model=make_model("gpt"),
                                                   config=nvme_config(tmp_path / early, early=early, host=host,
                                                                      speculative="off"))
        tiers = dict(optimizer.store.placement.tiers)
        losses, states = [], []
        for tokens in batches(4, 2):
            losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
            engine.step()
            states.append(engine.full_state_dict())
        if early == "on":  # the reads went ahead (in the forward's order) and each sub-group was read once a step
            state_bytes = sum(g.nbytes for g in optimizer.store.groups if g.tier is Tier.NVME)
            assert optimizer.store.reads_ahead > 0
            assert engine.telemetry.snapshot().bytes["nvme_read"] == 4 * state_bytes
        engine.close()
        return tiers, states, losses

    tiers, early_states, early_losses = run("on")
    assert tiers.get("host", 0) > 0 and tiers.get("nvme", 0) > 0
    _, whole_states, whole_losses = run("off")
    assert early_losses == whole_losses
    for early, whole in zip(early_states, whole_states):
        for key, value in whole.items():
            assert torch.equal(early[key], value), key


def test_auto_keeps_a_step_with_nvme_state_whole_and_says_why(tmp_path):
    mode = run_ranks(describe_engine, 1, config=nvme_config(tmp_path, early="auto"), device="cpu")[0]["mode"]
    assert "step() returns after Adam" in mode
    assert "'auto' keeps a step whose optimizer state or parameters are on NVMe whole" in mode


def _count_calls(monkeypatch, module, name: str, fail_at: int | None = None, error: BaseException | None = None
                 ) -> dict[str, int]:
    """Count ``module.name``'s calls; the ``fail_at``-th raises ``error``."""
    real, calls = getattr(module, name), {"n": 0}

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("what", ["first write", "last write", "a read", "Adam"])
def test_a_failure_after_step_returned_loses_the_step_and_says_so(tmp_path, monkeypatch, what):
    """The last write fails in the pass's final wait, a read in the pass itself, Adam (out of memory, say) outside
    any transfer: each is the same lost step, said by the next step and by a checkpoint, and close() still
    releases everything."""
    import offload.aio.base as base
    from offload.aio.base import SwapIOError
    from offload.optim.update import ShardUpdate
    engine, optimizer, *_ = offload.initialize(model=make_model("gpt"), config=nvme_config(tmp_path))
    tokens = batches(3, 2)
    engine.backward(loss_of(engine, "gpt", tokens[0]))
    engine.step()
    engine.backward(loss_of(engine, "gpt", tokens[1]))
    engine.step()
    engine.optimizer.drain()
    before = {u: optimizer.store.read_master(u) for u in optimizer.store.units(lambda g: True)}  # step 2's, now current
    io = OSError(5, os.strerror(5))
    if what == "first write":
        _count_calls(monkeypatch, base.os, "pwritev", 1, io)
    elif what == "last write":  # into the last sub-group's other slot: the pass's last write, failing in finish
        last = [g for g in optimizer.store.groups if g.tier is Tier.NVME][-1]
        slot = optimizer.store._file.slots[last.index]
        real = base.os.pwritev

        def failing(fd, bufs, offset):
            if slot.next_offset <= offset < slot.next_offset + slot.nbytes:
                raise io
            return real(fd, bufs, offset)

        monkeypatch.setattr(base.os, "pwritev", failing)
    elif what == "a read":  # the first of the step's reads, issued ahead when its backward begins
        _count_calls(monkeypatch, base.os, "preadv", 1, io)
    else:
        _count_calls(monkeypatch, ShardUpdate, "step_shard", 3, MemoryError("no memory for Adam"))
    engine.backward(loss_of(engine, "gpt", tokens[2]))
    engine.step()  # returns before its pass has run
    engine.backward(loss_of(engine, "gpt", tokens[0]))  # the pass fails beside this backward
    with pytest.raises(EarlyStepLost, match=r"step 3's optimizer state failed after step\(\) had returned .*"
                                            r"holds the optimizer state of step 2.*load the last checkpoint") as e:
        engine.step()  # the fault stays armed until here: the pass may still run when the backward ends
    monkeypatch.undo()
    assert isinstance(e.value.__cause__, MemoryError if what == "Adam" else SwapIOError), e.value.__cause__
    said = "the update (MemoryError) of" if what == "Adam" else "an NVMe transfer of"  # what failed, by its kind
    assert str(e.value).startswith(said + " step 3's"), str(e.value)
    with pytest.raises(EarlyStepLost):  # every later reader is told too: nothing half-stepped is saved
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert all(g.resident is None for g in optimizer.store.groups if g.tier is Tier.NVME)
    for unit, master in before.items():  # no slot flipped: the swap file holds step 2's state
        assert torch.equal(optimizer.store.read_master(unit), master), unit
    engine.close()
    assert not list(tmp_path.glob("**/*.swap")), "close() still removes the swap files"
