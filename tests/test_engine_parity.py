"""ZeRO-3 with the CPU optimizer step equals plain single-process PyTorch AdamW on the same global batch."""

import pytest
import torch

from engine_cases import base_config, train_engine, train_reference
from ranks import run_ranks

STEPS, MICRO, ACCUM = 20, 2, 2
MODELS = ["gpt", pytest.param("llama", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("transformers"), reason="transformers is not installed"))]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_torch_adamw(name, world):
    config = base_config(MICRO, ACCUM, world)
    results = run_ranks(train_engine, world, name=name, config=config, steps=STEPS, micro=MICRO, accum=ACCUM)
    ref = train_reference(name, STEPS, MICRO * ACCUM * world, MICRO)
    assert results[0]["units"] >= 4, "the test model should be cut into several units"
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    assert ref["losses"][-1] < ref["losses"][0] - 0.1, "the reference run should learn something"
    for rank in results:
        assert rank["state"].keys() == ref["state"].keys()
        for key, value in ref["state"].items():
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")
