"""Every placement of parameters and optimizer state trains exactly like torch: params on {device, cpu, nvme} x
optimizer on {cpu, nvme, split between host and NVMe by the host budget}, W = 1 and 2."""

import pytest
from engine_cases import base_config, check_parity, make_model, train_engine, train_reference

from offload.commands.estimate import estimate, model_units
from offload.config import Config
from offload.machine.launch import run_ranks


def tier_config(tmp_path, world, params, optimizer, host_budget=None):
    config = base_config(2, 2, world, sub_group_size=3000)
    zero = config["zero_optimization"]
    zero["offload_param"] = {"device": params}
    if params == "nvme":  # every unit on NVMe (max_in_cpu 0), fewer read buffers than units
        zero["offload_param"].update(nvme_path=str(tmp_path / "params"), max_in_cpu=0, buffer_count=3)
    zero["offload_optimizer"] = {"device": "cpu" if optimizer == "cpu" else "nvme", "nvme_path": str(tmp_path),
                                 "buffer_count": 2}
    if optimizer == "split":
        config["offload"]["budgets"] = {"host": host_budget}
    return config


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("params", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme", "split"])
def test_every_placement_matches_torch(tmp_path, world, params, optimizer):
    budget = None
    if optimizer == "split":  # what an all-NVMe rank needs on the host, plus room for half its optimizer state
        all_nvme = Config.load(tier_config(tmp_path, world, params, "nvme")).resolve(world_size=world)
        plan = estimate(model_units(make_model("gpt"), all_nvme), all_nvme, world,
                        discrete=False)  # equal to the plan of the engine on this CPU
        budget = plan.total("host") + plan.tiers["nvme"]["optimizer state (two slots per sub-group)"] // 4
    config = tier_config(tmp_path, world, params, optimizer, budget)
    results = run_ranks(train_engine, world, name="gpt", config=config, steps=6, micro=2, accum=2)
    tiers, memory = results[0]["tiers"], results[0]["memory"]
    expected = {"cpu": {"host"}, "nvme": {"nvme"}, "split": {"host", "nvme"}}[optimizer]
    assert set(tiers) == expected
    assert (memory["device"]["shards"] == 0) == (params != "none")
    assert ("parameter shards (two slots per unit)" in memory["nvme"]) == (params == "nvme")
    if budget is not None:
        assert memory["host"]["peak"] <= budget
    ref = train_reference("gpt", 6, 4 * world, 2, world=world)
    check_parity(results, ref)


def test_frozen_host_shards_count_in_the_plan_and_its_host_budget_check():
    """Shards kept on the host that the optimizer does not step (here: a frozen embedding) are planned: a host
    budget of exactly the plan's total starts, one byte less is the plan's ConfigError, not a bug error later."""
    import offload
    from offload.store.placement import MachineOffer, Shards, StageLayout, plan
    from offload.zero.plan import plan_units

    def frozen_model():
        model = make_model("gpt")
        model.wte.weight.requires_grad_(False)
        return model

    config = base_config(2, 1, 1)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    resolved = Config.load(config).resolve(world_size=1)
    units = plan_units(frozen_model(), resolved.offload.unit_bytes, 4)
    trained = {u.index for u in units if any(s.param.requires_grad for s in u.slots)}
    assert len(trained) < len(units)
    placement = plan(Shards([(u.index, u.numel) for u in units], trained, 4), resolved, StageLayout(parts=1),
                     MachineOffer(discrete=False))  # this CPU
    assert placement.host["parameter shards not stepped on the host"] > 0 and not placement.problems

    config["offload"]["budgets"] = {"host": sum(placement.host.values())}
    engine, *_ = offload.initialize(model=frozen_model(), config=config)
    host = engine.memory_summary()["host"]
    assert host["total"] == sum(placement.host.values())
    engine.close()
    config["offload"]["budgets"] = {"host": sum(placement.host.values()) - 1}
    with pytest.raises(offload.ConfigError, match="offload.budgets.host: .* cannot hold the parameter shards kept "
                                                  "on the host that the optimizer does not step there"):
        offload.initialize(model=frozen_model(), config=config)
