"""The early step with parameter shards on NVMe (see [Note: an early step's parameter writes] in
offload/store/param_swap.py): each unit's new shard is written and made current on its own after engine.step()
returned, while the next forward reads the units the step has finished. Bitwise the whole step with the worker
lagging (a read of a unit before its step, or a read-ahead of the slot being replaced, would see other values), and
a parameter write that fails after step() returned is said by the forward that needs the unit, which the next
forward rewrites from its master."""

from __future__ import annotations

import errno

import pytest
import torch

import offload
from engine_cases import batches, loss_of, make_model, train_engine
from offload.launch import run_ranks
from test_engine_param_nvme import _patch_param_io, _steps, param_config

HOST_LAG = {"OFFLOAD_EMULATED_HOST_DELAY_S": "0.003"}


def early_config(path, early: str = "on", **kw) -> dict:
    config = param_config(path, **kw)
    config["offload"].update(early_step=early, speculative_step="off")
    return config


@pytest.mark.parametrize("world,optimizer", [(1, "cpu"), (1, "nvme"), (2, "cpu")])
def test_the_early_step_with_parameters_on_nvme_trains_bitwise_as_the_whole_step(tmp_path, world, optimizer):
    runs = {early: run_ranks(train_engine, world, env=HOST_LAG, name="gpt", steps=4, micro=2, accum=1,
                             config=early_config(tmp_path / early, early, world=world, optimizer=optimizer))
            for early in ("on", "off")}
    assert "NVMe reads, Adam and writes run beside the next forward" in runs["on"][0]["mode"]
    assert "step() returns after Adam" in runs["off"][0]["mode"]
    assert runs["on"][0]["counts"].get("optimizer_early", 0) > 0
    for early, whole in zip(runs["on"], runs["off"]):
        assert early["losses"] == whole["losses"]
        for key, value in whole["state"].items():
            assert torch.equal(early["state"][key], value), key
        assert torch.equal(early["eval_logits"], whole["eval_logits"])


def test_reads_still_run_ahead_once_each_units_step_has_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_EMULATED_HOST_DELAY_S", "0.003")
    engine, *_ = offload.initialize(model=make_model("gpt"), config=early_config(tmp_path, buffers=4))
    swap = engine.params.swap
    _steps(engine, 0, 1)
    ahead, on_demand = swap.stats.reads_ahead, swap.stats.reads_on_demand
    _steps(engine, 1, 4)
    assert swap.stats.reads_ahead - ahead > len(engine.units), "the later iterations' reads mostly went ahead"
    assert swap.stats.reads_on_demand - on_demand < 3 * len(engine.units)
    engine.full_state_dict()
    assert engine.params.stepping() == set()
    engine.close()


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_parameter_write_failing_after_step_returned_fails_that_forward_and_the_next_one_repairs(
        tmp_path, monkeypatch, optimizer):
    clean_losses, clean_state = _clean_early(tmp_path / "clean", 4, optimizer)
    engine, *_ = offload.initialize(model=make_model("gpt"),
                                    config=early_config(tmp_path / "run", optimizer=optimizer))
    losses = _steps(engine, 0, 2)
    engine.full_state_dict()  # step 2's writes are done
    _patch_param_io(monkeypatch, "pwritev", fail=errno.ENOSPC)
    losses += _steps(engine, 2, 3)  # step 3 returns; its parameter writes fail on the worker
    with pytest.raises(RuntimeError, match=r"parameter shard on NVMe is stale .* run the forward again"):
        loss_of(engine, "gpt", batches(4, 2)[3])
    monkeypatch.undo()
    assert engine.params.stale(), "the units whose write failed are marked stale"
    losses += _steps(engine, 3, 4)  # this forward rewrites them from their masters first
    assert not engine.params.stale()
    state = engine.full_state_dict()
    engine.close()
    assert losses == clean_losses
    for key, value in clean_state.items():
        assert torch.equal(state[key], value), key


def _clean_early(path, steps: int, optimizer: str) -> tuple[list[float], dict]:
    engine, *_ = offload.initialize(model=make_model("gpt"), config=early_config(path, optimizer=optimizer))
    losses = _steps(engine, 0, steps)
    state = engine.full_state_dict()
    engine.close()
    return losses, state
