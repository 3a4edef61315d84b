"""Weights written into a live engine: ``load_full_state_dict`` and ``gathered_parameters(modifier_rank=...)``.

Each is checked against plain PyTorch doing the same thing to its model mid-training (the optimizer's moments
kept), on every placement of the parameters, at one rank and two."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.engine.errors import EngineError
from offload.machine.launch import run_ranks

MICRO = 2


def _other_weights() -> dict[str, torch.Tensor]:
    return make_model("gpt", seed=5).state_dict()


def _edit(module: torch.nn.Module, whole: bool = True) -> None:
    """What the tests write into the gathered model: a whole weight (unless not ``whole``), and one element of
    another (in one rank's shard only: the other ranks have nothing of their own to write back)."""
    with torch.no_grad():
        if whole:
            module.blocks[1].mlp[0].weight.copy_(torch.linspace(-0.2, 0.2, 128 * 32).view(128, 32))
        module.blocks[0].ln1.bias[3] = 0.75


def _reference(change: str, steps: tuple[int, int]) -> dict[str, Any]:
    """torch AdamW on the whole batch: ``steps[0]`` steps, the change to its weights, ``steps[1]`` more."""
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for i, tokens in enumerate(batches(sum(steps), 2 * MICRO)):
        if i == steps[0]:
            if change == "load":
                model.load_state_dict(_other_weights())
            else:
                _edit(model, whole=change == "edit")
        loss = loss_of(model, "gpt", tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _train(rank: int, world: int, change: str, config: dict[str, Any], steps: tuple[int, int]) -> dict[str, Any]:
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    losses = []
    for i, tokens in enumerate(batches(sum(steps), 2 * MICRO)):
        if i == steps[0]:
            if change == "load":
                missing, unexpected = engine.load_full_state_dict(_other_weights())
                assert missing == [] and unexpected == []
            else:
                with engine.gathered_parameters(modifier_rank=0) as module:
                    if rank == 0:
                        _edit(module, whole=change == "edit")
                    else:  # what another rank writes is not kept
                        with torch.no_grad():
                            module.blocks[2].mlp[0].weight.fill_(9.0)
        total = torch.zeros(1, dtype=torch.float64)
        for a in range(2 // world):
            rows = tokens[(a * world + rank) * MICRO:(a * world + rank + 1) * MICRO]
            total += engine.backward(loss_of(engine, "gpt", rows)).item()
            engine.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / 2)
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def _config(world: int, placement: str, tmp: str) -> dict[str, Any]:
    config = base_config(MICRO, 2 // world, world)
    zero = config["zero_optimization"]
    if placement == "host":
        zero["offload_param"] = {"device": "cpu"}
    elif placement == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": tmp, "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": tmp}
        zero["sub_group_size"] = 5000
    elif placement == "stage2":
        zero["stage"] = 2
    return config


def _check(got: dict[str, Any], ref: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("change", ["load", "edit"])
@pytest.mark.parametrize("placement", ["in-place", "host", "nvme", "stage2"])
def test_weights_written_mid_training_train_on_as_torch_does(change, placement, tmp_path):
    """One rank: the shards read in place (the CPU's default), gathered from the host, from NVMe, and stage 2's
    resident units; the training after the change equals torch's, so masters and moments are what they should be."""
    got = _train(0, 1, change, _config(1, placement, str(tmp_path)), (2, 2))
    _check(got, _reference(change, (2, 2)))


@pytest.mark.parametrize("change", ["load", "edit", "edit-one"])
@pytest.mark.parametrize("placement", ["host", "stage2"])
def test_two_ranks_keep_the_modifier_ranks_writes(change, placement, tmp_path):
    """``edit-one`` writes into one rank's shard only; every rank still takes part in spreading it (stage 2's
    resident partitions, the small parameters kept whole: the threshold keeps the 1-D ones)."""
    config = _config(2, placement, str(tmp_path))
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 128
    results = run_ranks(_train, 2, change=change, config=config, steps=(1, 2))
    ref = _reference(change, (1, 2))
    for got in results:
        _check(got, ref)


def test_what_no_one_wrote_keeps_its_fp32_master_and_a_failed_block_keeps_nothing():
    """bf16 compute: passing through the block does not round the masters of what was not written; a block that
    raises leaves every master as it was, in-place shards included."""
    config = base_config(MICRO, 1, 1)
    config["bf16"] = {"enabled": True}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    engine.backward(loss_of(engine, "gpt", batches(1, MICRO)[0]))
    engine.step()
    before = engine.full_state_dict()
    with engine.gathered_parameters(modifier_rank=0) as module:
        _edit(module)
    after = engine.full_state_dict()
    written = {"blocks.1.mlp.0.weight", "blocks.0.ln1.bias"}
    for key in before.keys() - written:
        assert torch.equal(after[key], before[key]), key
    assert torch.equal(after["blocks.1.mlp.0.weight"],
                       torch.linspace(-0.2, 0.2, 128 * 32).view(128, 32).to(torch.bfloat16).float())
    bias = before["blocks.0.ln1.bias"].clone()
    bias[3] = 0.75
    assert torch.equal(after["blocks.0.ln1.bias"], bias)

    with pytest.raises(KeyError), engine.gathered_parameters(modifier_rank=0) as module:
        with torch.no_grad():
            module.blocks[2].mlp[0].weight.zero_()
        raise KeyError("the block fails")
    for key, value in engine.full_state_dict().items():
        assert torch.equal(value, after[key]), key
    with engine.gathered_parameters() as module:  # the compute copies too
        assert torch.equal(module.blocks[2].mlp[0].weight.float(), after["blocks.2.mlp.0.weight"].bfloat16().float())
    engine.close()


def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(MICRO, 1, 1))
    state = engine.full_state_dict()
    bad = _other_weights()
    del bad["wpe.weight"]
    bad["extra.weight"] = torch.zeros(2)
    bad["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(EngineError, match=r"missing keys: wpe\.weight; unexpected keys: extra\.weight; blocks\.0\."
                                          r"attn\.qkv\.weight has shape \(3, 3\), the model's is \(96, 32\)"):
        engine.load_full_state_dict(bad)
    for key, value in engine.full_state_dict().items():
        assert torch.equal(value, state[key]), key

    partial = {"wpe.weight": torch.ones(16, 32)}  # strict=False: what the dict leaves out keeps its values
    missing, unexpected = engine.load_full_state_dict(partial, strict=False)
    assert "wte.weight" in missing and unexpected == []
    after = engine.full_state_dict()
    assert torch.equal(after["wpe.weight"], torch.ones(16, 32))
    assert all(torch.equal(after[k], state[k]) for k in state if k != "wpe.weight")
    with pytest.raises(ValueError, match="modifier_rank 1 is not a rank of this group"):
        with engine.gathered_parameters(modifier_rank=1):
            pass
    engine.close()
