"""Several ``engine.backward`` calls before one ``engine.step()`` (a GAN's discriminator on real and then on fake
images) step on the sum of their gradients, as PyTorch does, at every stage and tier, W = 1 and 2; a call that can
no longer join its step is refused by name (see [Note: more backward calls than micro-batches] in
offload/engine/accumulation.py)."""

from typing import Any

import pytest
import torch
from engine_cases import base_config, batches, engine_device, loss_of, make_model

import offload
from offload.machine.launch import run_ranks

MICRO = 2


def calls_config(tmp_path, world: int, stage: int, optimizer: str, accum: int = 1, clip: float = 0.0,
                 params: str = "none", overlap: str = "auto") -> dict[str, Any]:
    device: dict[str, Any] = {"device": optimizer}
    if optimizer == "nvme":
        device.update(nvme_path=str(tmp_path / "opt"), buffer_count=2)
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": 3000, "offload_optimizer": device}
    if params != "none":
        zero["offload_param"] = {"device": params, **({"nvme_path": str(tmp_path / "par")} if params == "nvme" else {})}
    config = base_config(MICRO, accum, world, clip=clip, unit_bytes=4096, **zero)
    config["offload"]["overlap_step"] = overlap
    return config


def _rows(tokens: torch.Tensor, rank: int) -> torch.Tensor:
    return tokens[rank * MICRO:(rank + 1) * MICRO]


def train_calls(rank: int, world: int, config: dict[str, Any], calls: list[int]) -> dict[str, Any]:
    """Step i takes ``calls[i]`` backward calls, each on a batch of its own; every call's loss as it is."""
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    data = iter(batches(sum(calls), MICRO * world))
    refused = []
    for i, n in enumerate(calls):
        for c in range(n):
            tokens = _rows(next(data), rank).to(engine.accel.device)
            try:
                engine.backward(loss_of(engine, "gpt", tokens))
            except offload.EngineError as e:
                refused.append((i, c, str(e)))
        engine.step()
    out = {"state": engine.full_state_dict(), "refused": refused, "steps": engine.global_steps,
           "mode": engine.step_mode}
    engine.close()
    return out


def reference(world: int, calls: list[int], accum: int = 1, skip: frozenset[tuple[int, int]] = frozenset(),
              clip: float = 0.0) -> dict[str, torch.Tensor]:
    """torch AdamW stepping once per step on the sum of that step's losses (each / accum, as the engine scales)."""
    device = engine_device(world)
    model = make_model("gpt").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = iter(batches(sum(calls), MICRO * world))
    for i, n in enumerate(calls):
        for c in range(n):
            tokens = next(data).to(device)
            if (i, c) not in skip:
                (loss_of(model, "gpt", tokens) / accum).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def check(results: list[dict[str, Any]], ref: dict[str, torch.Tensor]) -> None:
    for rank in results:
        for key, value in ref.items():
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")


CASES = [  # (world, stage, optimizer, params)
    (1, 0, "none", "none"), (1, 1, "cpu", "none"), (1, 2, "cpu", "none"), (1, 3, "cpu", "none"),
    (1, 3, "none", "none"), (1, 3, "nvme", "none"), (1, 3, "cpu", "cpu"), (1, 3, "cpu", "nvme"),
    (2, 0, "none", "none"), (2, 1, "cpu", "none"), (2, 2, "cpu", "none"), (2, 3, "cpu", "none"),
    (2, 3, "nvme", "none"),
]


@pytest.mark.parametrize("world,stage,optimizer,params", CASES)
def test_two_backward_calls_before_a_step_give_torchs_sum(tmp_path, world, stage, optimizer, params):
    config = calls_config(tmp_path, world, stage, optimizer, params=params)
    results = run_ranks(train_calls, world, config=config, calls=[2, 2, 2])
    assert all(r["refused"] == [] and r["steps"] == 3 for r in results)
    check(results, reference(world, [2, 2, 2]))


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_with_clipping_the_sum_is_clipped(tmp_path, optimizer):
    """Clipping gates the update (the NVMe sub-groups speculate during backward): the norm is the sum's."""
    config = calls_config(tmp_path, 1, 3, optimizer, clip=0.05)
    results = run_ranks(train_calls, 1, config=config, calls=[2, 2, 2])
    assert results[0]["refused"] == []
    check(results, reference(1, [2, 2, 2], clip=0.05))


@pytest.mark.parametrize("stage", [1, 3])
def test_calls_past_the_accumulation_add_to_it(tmp_path, stage):
    """Accumulation 2, three calls a step: each scaled by 1/2, as every micro-batch is, and all three applied."""
    config = calls_config(tmp_path, 2, stage, "cpu", accum=2)
    results = run_ranks(train_calls, 2, config=config, calls=[3, 3])
    assert all(r["refused"] == [] and r["steps"] == 2 for r in results)
    check(results, reference(2, [3, 3], accum=2))


def test_steps_with_fewer_calls_than_before_still_sum_theirs(tmp_path):
    """The loop's calls vary (2, 1, 2, 1): none is lost or taken twice, whatever the overlap planned."""
    config = calls_config(tmp_path, 1, 3, "cpu", overlap="on")
    results = run_ranks(train_calls, 1, config=config, calls=[2, 1, 2, 1])
    assert results[0]["refused"] == [] and results[0]["mode"].startswith("overlapped")
    check(results, reference(1, [2, 1, 2, 1]))


def test_a_call_after_the_update_began_is_refused_by_name_and_the_step_applies_the_rest(tmp_path):
    """Steps of one call teach the engine that a step's first call is its last, so the update begins during it;
    a second call then cannot join the step: refused before it runs, and step() applies the first alone."""
    config = calls_config(tmp_path, 1, 3, "cpu", overlap="on")
    results = run_ranks(train_calls, 1, config=config, calls=[1, 1, 2, 1])
    (step, call, message), = results[0]["refused"]
    assert (step, call) == (2, 1)
    assert message.startswith("engine.backward() call 2 since the last step comes after the call that completed "
                              "this step (no step before took more than 1)"), message
    assert "they were not taken. Call engine.step() now" in message
    assert results[0]["steps"] == 4
    check(results, reference(1, [1, 1, 2, 1], skip=frozenset({(2, 1)})))


def test_with_the_overlap_off_calls_may_grow_at_any_step(tmp_path):
    config = calls_config(tmp_path, 1, 3, "cpu", overlap="off")
    results = run_ranks(train_calls, 1, config=config, calls=[1, 1, 3, 1])
    assert results[0]["refused"] == []
    check(results, reference(1, [1, 1, 3, 1]))
