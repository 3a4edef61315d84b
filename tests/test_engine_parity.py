"""ZeRO-3 with the CPU optimizer step equals plain single-process PyTorch AdamW on the same global batch.

Each case trains 20 steps with gradient accumulation 2 and clipping, then compares the
per-step losses, every parameter and buffer (fp32 master values), and the logits of an
evaluation forward under torch.no_grad().
"""

import importlib.util

import pytest
from engine_cases import base_config, check_parity, train_engine, train_reference

from offload.machine.launch import run_ranks

STEPS, MICRO, ACCUM = 20, 2, 2
needs_transformers = pytest.mark.skipif(not importlib.util.find_spec("transformers"),
                                        reason="transformers is not installed")
CASES = [("gpt", 1), ("gpt", 2), ("gpt", 4),
         pytest.param("llama", 1, marks=needs_transformers), pytest.param("llama", 2, marks=needs_transformers),
         pytest.param("llama", 4, marks=needs_transformers),
         ("features", 1), ("features", 2)]


@pytest.mark.parametrize("name,world", CASES)
def test_matches_torch_adamw(name, world):
    config = base_config(MICRO, ACCUM, world, unit_bytes=4096 if name == "features" else 8192)
    results = run_ranks(train_engine, world, name=name, config=config, steps=STEPS, micro=MICRO, accum=ACCUM)
    ref = train_reference(name, STEPS, MICRO * ACCUM * world, MICRO, world=world)
    assert results[0]["units"] >= 3, "the test model should be cut into several units"
    assert ref["losses"][-1] < ref["losses"][0] - 0.1, "the reference run should learn something"
    check_parity(results, ref)
