"""Misuse of initialize and of the engine fails at once with a message that says what to do."""

import pytest
import torch
from engine_cases import base_config, make_model

import offload
from offload import ConfigError, EngineError
from offload.machine.launch import run_ranks


def _config(**zero):
    return base_config(2, 1, 1, **zero)


def test_step_without_backward():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=_config())
    with pytest.raises(EngineError, match=r"step\(\) was called without a backward\(\)"):
        engine.step()
    engine.close()


def test_model_with_no_trainable_parameters():
    model = make_model("gpt").requires_grad_(False)
    with pytest.raises(EngineError, match="no trainable parameters"):
        offload.initialize(model=model, config=_config())


def _bad_batch(rank, world):
    config = {**base_config(2, 1, world), "train_batch_size": 6, "gradient_accumulation_steps": 2}
    try:
        offload.initialize(model=make_model("gpt"), config=config)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_batch_config_that_does_not_divide_by_the_world_size():
    for message in run_ranks(_bad_batch, 2):
        assert "train_batch_size" in message and "6" in message


@pytest.mark.parametrize("zero,match", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "parameter offload needs stage 3 \\(got stage 2\\)"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "optimizer offload needs stage 1, 2 or 3 \\(got stage 0\\)"),
    ({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}}, "needs the optimizer offloaded"),
])
def test_unsupported_stage_and_offload(zero, match):
    with pytest.raises(ConfigError, match=match):
        offload.initialize(model=make_model("gpt"), config=_config(**zero))


def test_optimizer_missing_twice_or_unsupported():
    config = _config()
    del config["optimizer"]
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=config)
    assert optimizer is None  # forward only (ZeRO-Inference: tests/test_inference_engine.py)
    with pytest.raises(EngineError, match="step\\(\\): this engine was built without an optimizer"):
        engine.step()
    engine.close()
    model = make_model("gpt")
    with pytest.raises(EngineError, match="optimizer section and initialize\\(\\) was given optimizer="):
        offload.initialize(model=model, config=_config(), optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(EngineError, match="LBFGS is not stepped shard by shard here"):
        offload.initialize(model=model, config=config, optimizer=torch.optim.LBFGS(model.parameters(), lr=0.1))
    with pytest.raises(EngineError, match="amsgrad"):
        offload.initialize(model=model, config=config, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True))


def test_bad_loss_and_closed_engine():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=_config())
    tokens = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(EngineError, match="scalar loss"):
        engine.backward(engine(tokens))
    with torch.no_grad():
        loss = engine(tokens[:, :-1], tokens[:, 1:])
    with pytest.raises(EngineError, match="does not require grad"):
        engine.backward(loss)
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine(tokens)




def test_a_float_input_to_a_16_bit_model_says_to_cast_it():
    """The engine moves inputs to the device but casts floating ones only with fp16.auto_cast (as DeepSpeed):
    torch's dtype error then carries a note saying what to do; cast, the same batch trains."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = base_config(2, 1, 1)
    config["bf16"] = {"enabled": True}
    engine, *_ = offload.initialize(model=model, config=config)
    batch = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="same dtype") as failed:
        engine(batch)
    assert failed.value.__notes__ == ["offload: the model's parameters are bfloat16 (the config's precision), and "
                                      "floating inputs are not cast to it (here float32): cast them, e.g. "
                                      "batch.to(torch.bfloat16)"]
    engine.backward(engine(batch.to(torch.bfloat16)).float().sum())
    engine.step()
    engine.close()
