"""Readers of the whole state the moment an early step returns (see [Note: early step] in offload/optim/early_step.py):
a checkpoint saved, or the engine closed, while that step's Adam still waits on the landing worker.

The worker lags far behind here (``OFFLOAD_EMULATED_HOST_DELAY_S``), and each run checks that Adam had indeed not
finished when the reader began, so a save that did not drain would write a step half applied, and a close that
did not would free the state under Adam.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from engine_cases import batches, loss_of, make_model
from test_early_step import DISCRETE, HOST_LAG, early_config

import offload
from offload.machine.launch import run_ranks

STEPS = 3


def _moments(engine: Any) -> torch.Tensor:
    """Every unit's exp_avg and exp_avg_sq, in unit order (drains first, as every reader of the state must)."""
    engine.optimizer.drain()
    return torch.cat([torch.cat(g.views(m)[1:]).clone()
                      for g in engine.optimizer.store.one_at_a_time(read=True, write=False) for m in g.members])


def _compute_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The gathered compute-dtype parameters: what a checkpoint's ``shard`` files hold, besides the masters."""
    with engine.gathered_parameters() as module:
        return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def _early_adams(engine: Any) -> int:
    return engine.telemetry.snapshot().counts.get("optimizer_early", 0)


def _train(engine: Any, rank: int, world: int) -> None:
    for tokens in batches(STEPS, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[2 * rank:2 * rank + 2].to(engine.accel.device)))
        engine.step()


def _save_as_step_returns(rank: int, world: int, config: dict[str, Any], save_dir: str) -> dict[str, Any]:
    """Train, save straight after the last step() returned; the live state after (the synchronous run's)."""
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    _train(engine, rank, world)
    pending = STEPS * len(engine.optimizer.shards) - _early_adams(engine)
    engine.save_checkpoint(save_dir)
    out = {"pending": pending, "early": engine.step_mode, "state": engine.full_state_dict(),
           "moments": _moments(engine), "weights": _compute_weights(engine), "adam_steps": engine.optimizer.adam_steps,
           "steps": engine.global_steps}
    engine.close()
    return out


def _loaded(rank: int, world: int, config: dict[str, Any], save_dir: str) -> dict[str, Any]:
    engine = offload.initialize(model=make_model("gpt", seed=5), config=config)[0]  # other values until loaded
    engine.load_checkpoint(save_dir)
    out = {"state": engine.full_state_dict(), "moments": _moments(engine), "weights": _compute_weights(engine),
           "adam_steps": engine.optimizer.adam_steps, "steps": engine.global_steps}
    engine.close()
    return out


@pytest.mark.parametrize("world,params", [(1, "cpu"), (1, "none"), (2, "none")],
                         ids=["W1-in-place", "W1-device-homes", "W2"])
def test_a_checkpoint_saved_as_an_early_step_returns_holds_that_whole_step(tmp_path, world, params):
    """Masters, Adam's moments, the compute weights and the counters, loaded into a fresh engine, bit for bit
    those of the run whose step() returned after Adam."""
    early = run_ranks(_save_as_step_returns, world, env=HOST_LAG, config=early_config(world, "on", params, accum=1),
                      save_dir=str(tmp_path / "early"))
    whole = run_ranks(_save_as_step_returns, world, config=early_config(world, "off", params, accum=1),
                      save_dir=str(tmp_path / "whole"))
    assert "step() returns before Adam" in early[0]["early"] and "step() returns after Adam" in whole[0]["early"]
    assert all(rank["pending"] > 0 for rank in early), "Adam had finished before the save: the test proves nothing"
    loaded = run_ranks(_loaded, world, config=early_config(world, "off", params, accum=1),
                       save_dir=str(tmp_path / "early"))
    for got, want in zip(loaded, whole, strict=True):
        assert (got["steps"], got["adam_steps"]) == (want["steps"], want["adam_steps"]) == (STEPS, STEPS)
        assert torch.equal(got["moments"], want["moments"]), "Adam's moments of a step half applied were saved"
        for kind in ("state", "weights"):
            assert got[kind].keys() == want[kind].keys()
            for key, value in want[kind].items():
                assert torch.equal(got[kind][key], value), f"{kind}: {key}"


def _close_as_step_returns(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    _train(engine, rank, world)
    queued = STEPS * len(engine.optimizer.shards)
    pending = queued - _early_adams(engine)
    streams = list(engine.accel._streams)
    engine.close()
    out = {"queued": queued, "pending": pending, "ran": _early_adams(engine),
           "errors": [f"{s.name}: {s._error!r}" for s in streams if s._error is not None],
           "threads": [t.name for t in threading.enumerate() if t.name.startswith("offload-") and t.is_alive()]}
    engine.close()  # a second close is a no-op
    try:
        engine.step()
    except offload.EngineError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.parametrize("params,env", [("cpu", HOST_LAG), ("none", {**HOST_LAG, **DISCRETE})],
                         ids=["in-place", "discrete-device-homes"])
def test_closing_as_an_early_step_returns_runs_its_adam_and_stops_every_thread(params, env):
    """close() promises every hook removed and every buffer freed: with Adam still queued, it first lets it run
    (none of it is dropped, none fails on freed state) and stops every worker thread; it returns (a hang fails
    after the timeout), and the engine refuses work after."""
    got = run_ranks(_close_as_step_returns, 1, timeout=60, env=env, config=early_config(1, "on", params, accum=1))[0]
    assert got["pending"] > 0, "Adam had finished before close(): the test proves nothing"
    assert got["ran"] == got["queued"], f"close() dropped {got['queued'] - got['ran']} queued shard steps"
    assert got["errors"] == [] and got["threads"] == [], got
    assert "this engine was closed" in got.get("refused", ""), got
