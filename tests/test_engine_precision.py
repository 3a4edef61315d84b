"""bf16 and fp16 compute copies over fp32 master weights; fp16 dynamic loss scaling skips overflowed steps."""

import math

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model, train_engine, train_reference

import offload
from offload.config.sections import FP16Config
from offload.machine.launch import run_ranks
from offload.optim.loss_scale import LossScaler


def test_bf16_trains_like_fp32():
    config = {**base_config(2, 2, 2), "bf16": {"enabled": True}}
    results = run_ranks(train_engine, 2, name="gpt", config=config, steps=12, micro=2, accum=2)
    ref = train_reference("gpt", 12, 8, 2, world=2)
    assert results[0]["losses"][-1] < results[0]["losses"][0] - 0.3
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=0.05)
    for key, value in ref["state"].items():
        assert results[0]["state"][key].dtype == torch.float32  # the fp32 master weights
        torch.testing.assert_close(results[0]["state"][key], value, rtol=0, atol=0.02)


def fp16_overflow(rank, world):
    config = {**base_config(2, 1, world), "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1,
                                                    "loss_scale_window": 2}}
    engine, _, _, _ = offload.initialize(model=make_model("gpt"), config=config)
    assert engine.params.read(0).dtype == torch.float16
    log = []
    for step, tokens in enumerate(batches(5, 2 * world)):
        rows = tokens[rank * 2:(rank + 1) * 2]
        before = engine.full_state_dict()
        loss = loss_of(engine, "gpt", rows)
        if step == 2 and rank == world - 1:
            loss = loss * math.inf  # one rank's gradients overflow: every rank must skip
        engine.backward(loss)
        engine.step()
        after = engine.full_state_dict()
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        # the optimizer's overflow, DeepSpeed's flag accelerate reads so as not to step the LR schedule
        assert engine.optimizer.overflow is (step == 2)
        log.append((engine.loss_scale, engine.skipped_steps, unchanged, loss.item()))
    engine.close()
    return log


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale():
    for log in run_ranks(fp16_overflow, 2):
        scales, skipped, unchanged, _ = zip(*log)
        # /2 on the overflow; x2 only on the 3rd clean step of a run (window 2, DeepSpeed's count), not reached
        assert scales == (256.0, 256.0, 128.0, 128.0, 128.0)
        assert skipped == (0, 0, 1, 1, 1)
        assert unchanged == (False, False, True, False, False)


def _scales(scaler: LossScaler, overflows: str) -> list[float]:
    seen = []
    for mark in overflows:
        scaler.update(overflow=mark == "x")
        seen.append(scaler.scale)
    return seen


def test_the_dynamic_scale_counts_clean_steps_as_deepspeed_does():
    """DeepSpeed 0.19.8's DynamicLossScaler doubles on the step whose clean run since the last overflow, less one,
    is a positive multiple of the window (the (window + 1)-th clean step, then every window), and hysteresis 2 halves
    on the second overflow; these sequences are its, worked by hand from its rule (x: an overflow)."""
    scaler = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=2,
                                               loss_scale_window=2))
    assert _scales(scaler, ".xx...x...") == [256, 256, 128, 128, 128, 256, 256, 256, 256, 512]
    fresh = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=1, loss_scale_window=3))
    assert _scales(fresh, "........") == [256, 256, 256, 512, 512, 512, 1024, 1024]  # from the start too
    # hysteresis is refilled by a doubling only, not by a clean step (consecutive_hysteresis off)
    third = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=2, loss_scale_window=2))
    assert _scales(third, "xx...x...x...") == [256, 128, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 1024]
    held = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=2, loss_scale_window=9))
    assert _scales(held, "x.x") == [256, 256, 128]
    resumed = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=2,
                                                loss_scale_window=2))
    resumed.load_state_dict(scaler.state_dict())
    again = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=2, loss_scale_window=2))
    _scales(again, ".xx...x...")
    assert _scales(resumed, "..x...") == _scales(again, "..x...")


@pytest.mark.parametrize("hysteresis,expected", [(1, [128.0, 64.0]), (2, [256.0, 128.0])])
def test_hysteresis_delays_the_cut(hysteresis, expected):
    scaler = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=8, hysteresis=hysteresis))
    seen = []
    for _ in range(2):
        scaler.update(overflow=True)
        seen.append(scaler.scale)
    assert seen == expected


def test_scale_never_drops_below_min_and_static_scale_never_moves():
    scaler = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=2, hysteresis=1, min_loss_scale=2))
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0
    static = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128))
    static.update(overflow=True)
    static.update(overflow=False)
    assert (static.scale, static.dynamic) == (128.0, False)


def master_at_start(rank, world, precision):
    model = make_model("gpt")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine, _, _, _ = offload.initialize(model=model, config={**base_config(2, 1, world), precision: {"enabled": True}})
    master = engine.full_state_dict()
    engine.close()
    return weights, master


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_master_starts_as_the_models_fp32_weights_not_their_16_bit_rounding(precision, dtype):
    """DeepSpeed casts the module to 16 bits before it builds its master, so its master starts rounded; here the
    master is the weights the model held (docs/deepspeed-api.md: why, and the line that gives DeepSpeed's start)."""
    weights, master = run_ranks(master_at_start, 1, precision=precision)[0]
    assert master.keys() == weights.keys()
    rounded = 0
    for key, value in weights.items():
        assert master[key].dtype == torch.float32 and torch.equal(master[key], value), key
        rounded += int((value.to(dtype).float() != value).sum())
    assert rounded > 0  # the 16-bit rounding would have changed them
