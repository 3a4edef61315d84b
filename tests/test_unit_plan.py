"""How a model is cut into units (offload/zero/plan.py): tiny runs (a LayerNorm between two large layers) fold into
a neighbouring unit instead of being units of their own, training is unchanged, and a checkpoint of the old cut
loads into the new one."""

import pytest
import torch
from engine_cases import base_config, check_parity, make_model, train_engine, train_reference

import offload
from offload.engine.build import leaf_modules
from offload.machine.launch import run_ranks
from offload.models import GPT, GPTConfig
from offload.zero.plan import plan_units

FOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold, and ours
DISCRETE = {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}  # W = 1 gathers too (else a CPU reads units in place)


def _gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=4096, context=512, hidden_size=1024, layers=12, heads=16))


def test_tiny_runs_fold_into_the_next_unit_or_the_last_one():
    """The 156M GPT of the GPU runs at 4 MiB bf16 units: 75 units, 25 of them one LayerNorm (2048 elements); folded,
    50, none below the fold limit, each LayerNorm an anchor of the unit it was folded into, in forward order."""
    model = _gpt()
    whole = plan_units(model, 4 << 20, 2)
    folded = plan_units(model, 4 << 20, 2, fold_below=FOLD)
    assert (len(whole), sum(p.numel <= FOLD for p in whole)) == (75, 25)
    assert len(folded) == 50 and min(p.numel for p in folded) > FOLD
    names = [n for n, _ in model.named_parameters()]
    assert sorted(s.name for p in folded for s in p.slots) == sorted(names)  # each parameter in exactly one unit
    for plan in folded:  # the slots tile the unit
        assert [s.offset for s in plan.slots] == [sum(t.numel for t in plan.slots[:i]) for i in range(len(plan.slots))]
    first = next(p for p in folded if "blocks.0.ln1" in p.anchors)
    assert first.anchors == ["blocks.0.ln1", "blocks.0.attn.qkv"]  # before the module that runs next
    last = folded[-1]
    assert last.anchors[-1] == "ln_f" and last.anchors[0] == "blocks.11.mlp.2"  # after the last block's last layer
    # A fold limit is a sixteenth of a unit at most: at tiny units nothing folds.
    assert len(plan_units(model, 16 << 10, 2, fold_below=FOLD)) == len(plan_units(model, 16 << 10, 2))


@pytest.mark.parametrize("world", [1, 2])
def test_folded_units_train_as_torch_does(world):
    """8 KiB units of the test GPT: each block's LayerNorms (64 elements) fold into their neighbours."""
    config = base_config(2, 1, world, stage3_param_persistence_threshold=FOLD)
    got = run_ranks(train_engine, world, env=DISCRETE, name="gpt", config=config, steps=3, micro=2, accum=1)
    assert got[0]["units"] < len(plan_units(make_model("gpt"), 8192, 4))
    check_parity(got, train_reference("gpt", 3, 2 * world, 2, world=world))


def test_a_checkpoint_of_the_unfolded_cut_loads_into_the_folded_one(tmp_path):
    """Checkpoints saved before units folded (or with another threshold) load parameter by parameter."""
    torch.manual_seed(0)
    before = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))[0]
    before.save_checkpoint(tmp_path)
    state = before.full_state_dict()
    before.close()
    torch.manual_seed(1)
    after = offload.initialize(model=make_model("gpt", seed=1),
                               config=base_config(2, 1, 1, stage3_param_persistence_threshold=FOLD))[0]
    after.load_checkpoint(tmp_path)
    for key, value in after.full_state_dict().items():
        assert torch.equal(value, state[key]), key
    after.close()


class Experts(torch.nn.Module):
    """An MoE block in miniature: four experts, of which a token would use one; larger than a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(64, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)
        self.moe = Experts()
        self.tail_moe = Experts()


@pytest.mark.parametrize("leaf", [{"classes": [f"{__name__}.Experts"]}, {"classes": ["Experts"]},
                                  {"names": ["moe", "tail_moe"]}, {"name_suffixes": ["moe"]}])
def test_deepspeeds_leaf_modules_are_gathered_whole(leaf):
    """zero_optimization.leaf_module (DeepSpeed 0.19.8's, by class, name or name suffix): each such module is one
    unit anchored at itself, never split across units, whatever its size."""
    config = offload.Config.load({"train_micro_batch_size_per_gpu": 1,
                                  "zero_optimization": {"stage": 3, "leaf_module": leaf}})
    model = Stack()
    split = plan_units(model, 16 << 10, 4)  # a 16 KiB unit holds one expert: the blocks split
    assert all(["moe"] != p.anchors for p in split)
    whole = plan_units(model, 16 << 10, 4, atomic=leaf_modules(config.zero_optimization.leaf_module))
    for name in ("moe", "tail_moe"):
        unit = next(p for p in whole if name in p.anchors)
        assert unit.anchors == [name]
        assert sorted(s.name for s in unit.slots) == sorted(f"{name}.{n}" for n, _ in model.get_submodule(
            name).named_parameters())
