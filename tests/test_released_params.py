"""Touching a ZeRO-3 parameter outside forward ([Note: a released parameter] in offload/zero/unit.py): a released
parameter is an empty tensor, as DeepSpeed's partitions are, never a view of freed memory (which segfaulted with two
ranks); its whole shape stays in ``ds_shape``; ``model.state_dict()`` saves and loads and says where the weights
are; and training goes on exactly as if nothing had been touched. A parameter at or below
stage3_param_persistence_threshold is whole after each step with the step's values, as DeepSpeed's persistent ones
([Note: small parameters stay whole])."""

import logging

import pytest
import torch
import torch.nn.functional as F
from engine_cases import STREAM_CHECK, base_config, batches, loss_of, make_model

import offload
from offload.engine import errors
from offload.machine.launch import run_ranks

EMULATED_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}


def _touch(rank, world, params, touch, path):
    config = base_config(2, 1, world, stage3_param_persistence_threshold=128)  # the 1-D parameters, not the 2-D
    config["zero_optimization"]["offload_param"] = {"device": params, "nvme_path": f"{path}/swap",
                                                    "max_in_cpu": 0}  # nvme: every shard homed on the disk
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    losses, out = [], {"kept": []}
    small = {n: p for n, p in engine.module.named_parameters() if len(p.ds_shape) == 1}
    out["small_before_a_step"] = sorted(n for n, p in small.items() if p.numel())
    for step, tokens in enumerate(batches(3, 2 * world)):
        rows = tokens[rank * 2:(rank + 1) * 2].to(engine.accel.device)
        losses.append(engine.backward(loss_of(engine, "gpt", rows)).item())
        engine.step()
        if touch:  # every small parameter whole, with this step's values
            values = {n: p.detach().cpu().clone() for n, p in small.items()}
            full = engine.full_state_dict()
            out["kept"].append(sorted(n for n, v in values.items() if not torch.equal(v, full[n].to(v.dtype))))
        if touch and step == 0:
            name, weight = next((n, p) for n, p in engine.module.named_parameters() if len(p.ds_shape) == 2)
            out["name"], out["shape"], out["ds_shape"] = name, tuple(weight.shape), tuple(weight.ds_shape)
            out["sum"] = float(weight.sum())  # reads the parameter outside forward: a segfault before
            state = engine.module.state_dict()
            out["empty"] = sorted(k for k, v in state.items() if v.numel() == 0)
            torch.save(state, f"{path}/rank{rank}.pt")
            out["loaded"] = {k: tuple(v.shape) for k, v in torch.load(f"{path}/rank{rank}.pt").items()}
    out["losses"] = losses
    out["full"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.parametrize("world,params,env", [(2, "none", {}), (2, "nvme", {}), (1, "cpu", EMULATED_GPU),
                                              (1, "cpu", {}), (1, "none", {})],
                         ids=["two-ranks", "two-ranks-params-on-nvme", "one-rank-gathered-from-the-host",
                              "one-rank-read-in-place", "one-rank-params-on-the-device"])
def test_reading_a_released_parameter_gives_the_empty_partition_and_training_goes_on_unchanged(tmp_path, world,
                                                                                               params, env):
    touched = run_ranks(_touch, world, env=env, params=params, touch=True, path=str(tmp_path))
    plain = run_ranks(_touch, world, env=env, params=params, touch=False, path=str(tmp_path))
    for rank, ref in zip(touched, plain, strict=True):
        assert rank["shape"] == (0,) and len(rank["ds_shape"]) == 2 and rank["sum"] == 0.0
        assert rank["small_before_a_step"] == [] and rank["kept"] == [[], [], []]
        assert not [k for k in rank["empty"] if len(ref["full"][k].shape) == 1]
        assert rank["name"] in rank["empty"] and rank["loaded"][rank["name"]] == (0,)
        assert rank["losses"] == ref["losses"]
        for key, value in ref["full"].items():
            assert torch.equal(rank["full"][key], value), key
            if key == rank["name"]:
                assert tuple(value.shape) == rank["ds_shape"]


def test_model_state_dict_says_once_where_the_weights_are(caplog, tmp_path):
    """At W = 1 on the emulated GPU with the parameters on the host, units are gathered and released as with more
    ranks. Offload's own reads of the module's state_dict (the whole weights, a checkpoint's buffers) are no user's
    call and say nothing (they did, once each, before the user had called anything)."""
    import os
    os.environ["OFFLOAD_EMULATED_DISCRETE_DEVICE"] = "1"
    try:
        config = base_config(2, 1, 1)
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        engine = offload.initialize(model=make_model("gpt"), config=config)[0]
        with caplog.at_level(logging.WARNING, logger="offload.zero"):
            engine.full_state_dict()
            engine.load_full_state_dict(engine.full_state_dict())
            engine.save_checkpoint(tmp_path, tag="t")
            engine.load_checkpoint(tmp_path, tag="t")
            assert not [r for r in caplog.records if "partitioned parameters" in r.getMessage()]
            engine.module.state_dict()
            engine.module.state_dict()
        engine.close()
    finally:
        del os.environ["OFFLOAD_EMULATED_DISCRETE_DEVICE"]
    said = [r.getMessage() for r in caplog.records if "partitioned parameters as empty tensors" in r.getMessage()]
    assert len(said) == 1 and "engine.save_16bit_model(dir)" in said[0] and "offload export-weights" in said[0]


OPS = {"linear": lambda w: F.linear(torch.randn(2, 4), w), "bias": lambda w: F.linear(torch.randn(2, 4),
                                                                                    torch.randn(3, 4), w),
       "embedding": lambda w: F.embedding(torch.tensor([1]), w), "layer_norm": lambda w: F.layer_norm(
           torch.randn(2, 4), (4,), w), "mul": lambda w: torch.randn(2, 4) * w,
       "conv": lambda w: F.conv1d(torch.randn(1, 2, 5), w), "matmul": lambda w: torch.randn(2, 4) @ w}


@pytest.mark.parametrize("op", list(OPS))
def test_what_torch_says_of_an_op_on_a_released_parameter_is_recognised(op):
    """The engine turns such an error inside forward into one that says what to do (errors.released_parameter_read);
    these are torch's own messages for an empty operand."""
    with pytest.raises(RuntimeError) as caught:
        OPS[op](torch.empty(0))
    assert errors.reads_a_released_parameter(str(caught.value)), str(caught.value)


def test_other_errors_are_not_taken_for_a_released_parameter():
    with pytest.raises(RuntimeError) as caught:
        F.linear(torch.randn(2, 4), torch.randn(3, 5))
    assert not errors.reads_a_released_parameter(str(caught.value)), str(caught.value)


def _early(rank, world, path):
    config = base_config(2, 1, world, stage3_param_persistence_threshold=128)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config["offload"]["early_step"] = "on"
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    small = {n: p for n, p in engine.module.named_parameters() if len(p.ds_shape) == 1}
    seen = []
    for tokens in batches(3, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        whole = {n: p.detach().clone() for n, p in small.items() if p.numel()}
        full = engine.full_state_dict()
        seen.append((sorted(whole), sorted(n for n, v in whole.items() if not torch.equal(v, full[n]))))
        engine.step()
        seen.append((sorted(n for n, p in small.items() if p.numel()), []))
    engine.close()
    return {"seen": seen, "small": sorted(small)}


def test_after_a_step_that_returns_before_adam_small_parameters_wait_for_their_next_use():
    """``early_step: on`` (units gathered from the host): after step() they are released, their values not yet
    known; the next forward and backward gather the step's values, which they then keep (no step yet: released)."""
    got = run_ranks(_early, 1, env=EMULATED_GPU, path="")[0]
    assert got["seen"][:2] == [([], []), ([], [])]
    for after_use, after_step in zip(got["seen"][2::2], got["seen"][3::2]):
        assert after_use == (got["small"], []) and after_step == ([], [])


def _small_model(rank, world):
    """A model wholly under the default persistence threshold (1e5 elements): one unit, kept whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}}
    engine = offload.initialize(model=model, config=config)[0]
    gen = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 16, generator=gen)).square().mean())
        engine.step()
        full = engine.full_state_dict()  # a collective: every rank calls it
        seen.append({n: bool(p.numel()) and torch.equal(p.detach(), full[n])
                     for n, p in engine.module.named_parameters()})
    engine.close()
    return seen


def test_a_small_models_weights_read_whole_with_each_steps_values_on_two_ranks():
    """#57 item 4: every parameter of a small model is under stage3_param_persistence_threshold's default, so after
    each step it reads whole, with that step's values, as DeepSpeed's does (it read empty after the first step)."""
    for seen in run_ranks(_small_model, 2):
        assert all(all(step.values()) for step in seen), seen
