"""Every placement of parameters and optimizer state trains exactly like torch: params on {device, cpu} x
optimizer on {cpu, nvme, split between host and NVMe by the host budget}, W = 1 and 2."""

import pytest
import torch

from engine_cases import base_config, train_engine, train_reference
from offload.launch import run_ranks

def tier_config(tmp_path, world, params, optimizer, host_budget=None):
    config = base_config(2, 2, world, sub_group_size=3000)
    zero = config["zero_optimization"]
    zero["offload_param"] = {"device": params}
    zero["offload_optimizer"] = {"device": "cpu" if optimizer == "cpu" else "nvme", "nvme_path": str(tmp_path),
                                 "buffer_count": 2}
    if optimizer == "split":
        config["offload"]["budgets"] = {"host": host_budget}
    return config


def _placement(rank, world, config):
    import offload
    from engine_cases import make_model
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=config)
    out = dict(optimizer.store.placement.tiers), engine.memory_summary()
    engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("params", ["none", "cpu"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme", "split"])
def test_every_placement_matches_torch(tmp_path, world, params, optimizer):
    budget = None
    if optimizer == "split":  # what an all-NVMe rank needs on the host, plus room for half its optimizer state
        tiers, memory = run_ranks(_placement, world, config=tier_config(tmp_path, world, params, "nvme"))[0]
        budget = memory["host"]["total"] + 12 * tiers["nvme"] // 2
    config = tier_config(tmp_path, world, params, optimizer, budget)
    tiers, memory = run_ranks(_placement, world, config=config)[0]
    expected = {"cpu": {"host"}, "nvme": {"nvme"}, "split": {"host", "nvme"}}[optimizer]
    assert set(tiers) == expected
    assert (memory["device"]["shards"] == 0) == (params == "cpu")
    if budget is not None:
        assert memory["host"]["peak"] <= budget
    results = run_ranks(train_engine, world, name="gpt", config=config, steps=6, micro=2, accum=2)
    ref = train_reference("gpt", 6, 4 * world, 2)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for rank in results:
        for key, value in ref["state"].items():
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")
        torch.testing.assert_close(rank["eval_logits"], ref["eval_logits"])
