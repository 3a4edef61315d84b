"""offload.hf.Trainer with a PEFT (LoRA) model saves the adapter, as the plain Trainer does, and
``PeftModel.from_pretrained`` loads it onto the base model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("peft") is None:  # found, not imported: PEFT's import (2 s) is paid by the test alone
    pytest.skip("peft is not installed", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402
from test_hf_trainer import DS, arguments, data  # noqa: E402
from test_pretrained import tiny  # noqa: E402

import offload.hf  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _lora(seed=0):
    torch.manual_seed(seed)
    import peft
    return peft.get_peft_model(tiny("llama"), peft.LoraConfig(**LORA))


def test_a_lora_model_saves_its_adapter_as_the_plain_trainer_does_and_reloads(tmp_path):
    plain = transformers.Trainer(model=_lora(), args=arguments(tmp_path / "plain"), train_dataset=data())
    plain.train()
    plain.save_model(str(tmp_path / "plain" / "final"))
    ours = offload.hf.Trainer(model=_lora(), args=arguments(tmp_path / "ours"), offload_config=DS,
                              train_dataset=data())
    ours.train()
    out = tmp_path / "ours" / "final"
    ours.save_model(str(out))
    theirs = tmp_path / "plain" / "final"
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == sorted(
        p.name for p in theirs.iterdir() if p.suffix in (".json", ".safetensors"))
    assert not (out / "model.safetensors").exists()
    saved, reference = load_file(out / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(saved) == sorted(reference) and saved
    for key, value in saved.items():  # the same run: the same adapter, to Adam's rounding on the CPU
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
    # what the engine trained, loaded onto the base model by PEFT itself
    engine_state = ours.engine.full_state_dict()
    torch.manual_seed(0)
    import peft
    reloaded = peft.PeftModel.from_pretrained(tiny("llama"), out)
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p.detach(), engine_state[name]), name
    ours.engine.close()
