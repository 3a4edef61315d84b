"""ZeRO stages 0, 1 and 2 run through the same engine and train exactly like single-process torch AdamW.

Each case trains 20 steps with accumulation 2 and clipping (or without clipping, where the
step overlaps backward) and compares losses, every parameter and the evaluation logits.
The engine's telemetry shows what each stage does differently: stage 0 all-reduces,
stage 1 reduces once per step, stage 2 every micro-batch; parameters stay resident.
"""

import importlib.util

import pytest
import torch
from conftest import REPO
from engine_cases import base_config, check_parity, make_model, train_engine, train_reference

import offload
from offload.config import Config, ConfigError
from offload.machine.launch import run_ranks

STEPS, MICRO, ACCUM = 20, 2, 2
needs_transformers = pytest.mark.skipif(not importlib.util.find_spec("transformers"),
                                        reason="transformers is not installed")

CASES = [  # (model, world, stage, optimizer device)
    ("gpt", 2, 0, "none"), ("gpt", 2, 1, "none"), ("gpt", 2, 1, "cpu"), ("gpt", 2, 1, "nvme"),
    ("gpt", 2, 2, "none"), ("gpt", 2, 2, "cpu"), ("gpt", 2, 2, "nvme"),
    ("gpt", 1, 0, "none"), ("gpt", 1, 1, "nvme"), ("gpt", 1, 2, "cpu"),
    ("gpt", 4, 0, "none"), ("gpt", 4, 1, "cpu"), ("gpt", 4, 2, "cpu"),
    pytest.param("llama", 2, 1, "cpu", marks=needs_transformers),
    pytest.param("llama", 2, 2, "nvme", marks=needs_transformers),
    ("features", 2, 2, "cpu"),
]


def stage_config(tmp_path, world, stage, optimizer, clip=1.0):
    device = {"device": optimizer}
    if optimizer == "nvme":
        device.update(nvme_path=str(tmp_path), buffer_count=2)
    return base_config(MICRO, ACCUM, world, clip=clip, stage=stage, offload_optimizer=device, sub_group_size=3000,
                       unit_bytes=4096 if world == 2 else 8192)


@pytest.mark.parametrize("name,world,stage,optimizer", CASES)
def test_every_stage_matches_torch(tmp_path, name, world, stage, optimizer):
    config = stage_config(tmp_path, world, stage, optimizer)
    results = run_ranks(train_engine, world, name=name, config=config, steps=STEPS, micro=MICRO, accum=ACCUM)
    ref = train_reference(name, STEPS, MICRO * ACCUM * world, MICRO, world=world)
    check_parity(results, ref)
    first = results[0]
    assert first["memory"]["device"]["parameters"] > 0 and "shards" not in first["memory"]["device"]
    assert first["gathers"] == 0, "stages 0-2 never gather a unit around its use"
    if name == "gpt":  # every unit trains: one reduction per unit per step (stage 2: per micro-batch)
        counts, units = first["counts"], first["units"]
        per_step = {0: ("all_reduce", units), 1: ("reduce_scatter", units), 2: ("reduce_scatter", units * ACCUM)}
        kind, n = per_step[stage]
        assert counts.get(kind, 0) == n * STEPS
        assert counts.get("all_gather", 0) == units * STEPS  # the updated partitions spread after each step
        assert {"all_reduce", "reduce_scatter"} - {kind} & counts.keys() == set()


@pytest.mark.parametrize("stage", [1, 2])
def test_the_step_overlaps_backward_without_clipping(tmp_path, stage):
    config = stage_config(tmp_path, 2, stage, "cpu", clip=0.0)
    results = run_ranks(train_engine, 2, name="gpt", config=config, steps=6, micro=MICRO, accum=ACCUM)
    assert results[0]["mode"].startswith("overlapped") and results[0]["overlapped"] > 0
    check_parity(results, train_reference("gpt", 6, MICRO * ACCUM * 2, MICRO, clip=0.0, world=2))


def test_a_device_budget_that_cannot_hold_the_parameters_is_a_clear_error():
    config = base_config(MICRO, 1, 1, stage=2)
    config["offload"]["budgets"] = {"device": 10_000}
    with pytest.raises(ConfigError, match="which ZeRO stage 2 keeps on the device.*use stage 3"):
        offload.initialize(model=make_model("gpt"), config=config)


def test_a_closed_stage_2_engine_leaves_the_trained_values_in_the_model():
    """Stages 0-2 keep every parameter in the model's own (flat) storage, so the module stays usable."""
    model = make_model("gpt")
    engine, *_ = offload.initialize(model=model, config=base_config(MICRO, 1, 1, stage=2))
    tokens = torch.randint(0, 96, (2, 17))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    state = engine.full_state_dict()
    engine.close()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), state[key].cpu())  # on a GPU the model stays there


def test_the_shipped_zero_offload_config_trains():
    """configs/zero2_cpu_offload.json: stage 2, optimizer on the host, every block checkpointed."""
    config = Config.load(REPO / "configs/zero2_cpu_offload.json").to_dict()
    config["train_micro_batch_size_per_gpu"] = MICRO
    del config["scheduler"]  # its warmup starts at lr 0
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    assert engine.stage.number == 2 and engine.optimizer.offload and engine.activations is not None
    tokens = torch.randint(0, 96, (MICRO, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        losses.append(engine.backward(engine(tokens[:, :-1], tokens[:, 1:])).item())
        engine.step()
    assert engine.activations.saves == 3 * 3 and losses[-1] < losses[0]
    engine.close()
