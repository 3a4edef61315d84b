"""An engine without an optimizer (DeepSpeed's ZeRO-Inference: a frozen teacher, an RLHF reference or reward model):
its parameters sharded and offloaded, forward only, beside a trained engine in the same process."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.engine import EngineError
from offload.machine.launch import run_ranks


def _inference_config(world, param_device, nvme_path=None):
    config = base_config(2, 1, world)
    del config["optimizer"]
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "none"}
    zero["offload_param"] = {"device": param_device, **({"nvme_path": nvme_path, "max_in_cpu": 0}
                                                        if param_device == "nvme" else {})}
    return config


def _reference_beside_actor(rank, world, param_device, nvme_path):
    torch.manual_seed(0)
    model = make_model("gpt")
    plain = copy.deepcopy(model)  # the reference's weights, never sharded
    reference, optimizer, _, scheduler = offload.initialize(model=copy.deepcopy(model),
                                                            config=_inference_config(world, param_device, nvme_path))
    actor = offload.initialize(model=model, config=base_config(2, 1, world))[0]
    same = []
    for tokens in batches(3, 2, seed=rank + 1):
        actor.backward(loss_of(actor, "gpt", tokens))  # the trained engine's hooks and the reference's apart
        actor.step()
        with torch.no_grad():
            same.append(torch.equal(reference(tokens[:, :-1], tokens[:, 1:]), plain(tokens[:, :-1], tokens[:, 1:])))
    refused = []
    for call in (lambda: reference.backward(loss_of(reference, "gpt", tokens)), reference.step):
        try:
            call()
        except EngineError as e:
            refused.append(str(e))
    memory = reference.memory_summary()
    reference.close()
    actor.close()
    return same, optimizer, scheduler, refused, memory


@pytest.mark.parametrize("world,param_device", [(1, "cpu"), (2, "nvme")])
def test_a_reference_engine_without_an_optimizer_runs_the_plain_models_forward(tmp_path, world, param_device):
    results = run_ranks(_reference_beside_actor, world, param_device=param_device, nvme_path=str(tmp_path / "swap"))
    for same, optimizer, scheduler, refused, memory in results:
        assert same == [True, True, True]  # bitwise the plain model's loss, step after step of the actor
        assert optimizer is None and scheduler is None  # as deepspeed.initialize returns them
        assert [r.split(":")[0] for r in refused] == ["backward()", "step()"]
        assert "built without an optimizer" in refused[0] and "ZeRO-Inference" in refused[0]
        tier = "nvme" if param_device == "nvme" else "host"
        assert memory[tier]["total"] > 0  # the parameters live off the device


def test_a_scheduler_without_an_optimizer_is_refused_by_name():
    config = _inference_config(1, "cpu")
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    with pytest.raises(offload.ConfigError, match="scheduler: there is no optimizer to schedule"):
        offload.initialize(model=make_model("gpt"), config=config)
