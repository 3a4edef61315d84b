"""A script's other torch.optim optimizer ([Note: a torch optimizer's own step] in offload/optim/generic.py): each
elementwise one stepped by its own code on the shards, bit for bit plain PyTorch's where the gradients are (one
rank, one micro-batch a step), its state and scalars through a checkpoint; the others refused by name."""

import copy
import functools

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    backward_over,
    base_config,
    batches,
    clip_at_exact_norm_,
    make_any,
    resume_engine,
    train_engine,
)

import offload
from offload.engine.errors import EngineError
from offload.machine.launch import run_ranks

STEPS, MICRO = 3, 2
OPTIMIZERS = {
    "SGD momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD nesterov": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True),
    "SGD": functools.partial(torch.optim.SGD, lr=0.1),
    "Adadelta": functools.partial(torch.optim.Adadelta, lr=1.0, weight_decay=0.01),
    "Adamax": functools.partial(torch.optim.Adamax, lr=0.01),
    "ASGD": functools.partial(torch.optim.ASGD, lr=0.05, t0=2),
    "NAdam": functools.partial(torch.optim.NAdam, lr=0.01, decoupled_weight_decay=True, weight_decay=0.1),
    "RAdam": functools.partial(torch.optim.RAdam, lr=0.01),
    "RMSprop": functools.partial(torch.optim.RMSprop, lr=0.005, momentum=0.5, weight_decay=0.01),
    "Rprop": functools.partial(torch.optim.Rprop, lr=0.005),
}


def reference(make, steps, rows, clip):
    """Plain PyTorch on one thread, as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_any("gpt")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make(params)
        losses = []
        for tokens in batches(steps, rows):
            losses.append(backward_over(model, "gpt", tokens, MICRO))
            if clip:  # the exact norm: torch's own rounds by the CPU (see clip_at_exact_norm_)
                clip_at_exact_norm_(params, clip)
            opt.step()
            opt.zero_grad()
        return {"losses": losses, "state": model.state_dict()}
    finally:
        torch.set_num_threads(threads)


def client_config(world, stage, state, clip, accum=1):
    config = base_config(MICRO, accum, world, clip=clip, stage=stage, sub_group_size=3000)
    del config["optimizer"]
    config["zero_optimization"]["offload_optimizer"] = state
    return config


def check_bitwise(results, ref):
    assert results[0]["losses"] == ref["losses"]
    for key, value in ref["state"].items():
        assert torch.equal(results[0]["state"][key], value), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_elementwise_torch_optimizer_trains_bitwise_as_torch(name):
    """Stage 3, the state on the host: every step bit for bit torch's, NAdam's and ASGD's scalars carried from
    step to step; without clipping auto steps each unit as its gradient lands, as for the native kernels."""
    results = run_ranks(train_engine, 1, name="gpt", config=client_config(1, 3, {"device": "cpu"}, 0.0),
                        steps=STEPS, micro=MICRO, accum=1, optimizer=OPTIMIZERS[name])
    check_bitwise(results, reference(OPTIMIZERS[name], STEPS, MICRO, 0.0))
    assert results[0]["mode"].startswith("overlapped with the last micro-batch's backward")


def test_clipping_that_fires_scales_the_gradients_as_torchs():
    """The norm is over ten times the clip here: the factor is clip_grad_norm_'s from the exact norm, bit for bit
    on every CPU ([Note: the clip factor] in offload/optim/loss_scale.py)."""
    make = OPTIMIZERS["SGD momentum"]
    results = run_ranks(train_engine, 1, name="gpt", config=client_config(1, 3, {"device": "cpu"}, 0.05),
                        steps=STEPS, micro=MICRO, accum=1, optimizer=make)
    check_bitwise(results, reference(make, STEPS, MICRO, 0.05))


@pytest.mark.parametrize("stage,state", [(2, {"device": "none"}), (1, {"device": "nvme", "buffer_count": 2})])
def test_the_state_on_the_device_or_on_nvme_steps_as_torch(tmp_path, stage, state):
    if state["device"] == "nvme":
        state["nvme_path"] = str(tmp_path)
    make = OPTIMIZERS["NAdam"]
    results = run_ranks(train_engine, 1, name="gpt", config=client_config(1, stage, state, 0.0), steps=STEPS,
                        micro=MICRO, accum=1, optimizer=make)
    check_bitwise(results, reference(make, STEPS, MICRO, 0.0))


def test_two_ranks_accumulating_train_as_torch_and_resume_bitwise(tmp_path):
    """W = 2, two micro-batches a step (their gradients summed in another order than one process's: close, not
    bitwise); a run resumed from a checkpoint after step 2 is bitwise the unbroken one, ASGD's eta and mu with it."""
    make = OPTIMIZERS["ASGD"]
    config = client_config(2, 3, {"device": "cpu"}, 1.0, accum=2)
    whole = run_ranks(train_engine, 2, name="gpt", config=config, steps=4, micro=MICRO, accum=2, optimizer=make)
    ref = reference(make, 4, MICRO * 4, 1.0)
    torch.testing.assert_close(torch.tensor(whole[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for key, value in ref["state"].items():
        torch.testing.assert_close(whole[0]["state"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    run_ranks(train_engine, 2, name="gpt", config=config, steps=2, micro=MICRO, accum=2, optimizer=make,
              save_dir=str(tmp_path))
    resumed = run_ranks(resume_engine, 2, name="gpt", config=config, load_dir=str(tmp_path), steps=4, start=2,
                        micro=MICRO, accum=2, optimizer=make)
    for key, value in whole[0]["state"].items():
        assert torch.equal(resumed[0]["state"][key], value), key


def test_what_cannot_be_stepped_a_shard_at_a_time_is_refused_by_name():
    config = client_config(1, 3, {"device": "cpu"}, 1.0)
    model = make_any("gpt")
    params = list(model.parameters())
    cases = [
        (torch.optim.LBFGS(params), "LBFGS is not stepped shard by shard here: it re-evaluates the loss"),
        (torch.optim.Adafactor(params), "factors each matrix's second moment"),
        (torch.optim.RMSprop(params, centered=True, momentum=0.9),
         "keeps step, square_avg, momentum_buffer, grad_avg per parameter"),
    ]

    class Custom(torch.optim.SGD):
        pass
    cases.append((Custom(params, lr=0.1), "Custom is not one of torch.optim's elementwise optimizers"))
    for client, message in cases:
        with pytest.raises(EngineError, match=message):
            offload.initialize(model=model, config=config, optimizer=client)


def test_a_torch_optimizer_named_by_the_configs_type_trains_as_the_object():
    """DeepSpeed's `"type": "SGD"` (any case), its params the class's keyword arguments: the same steps as the
    object handed to initialize."""
    config = client_config(1, 3, {"device": "cpu"}, 0.0)
    config["optimizer"] = {"type": "sgd", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True}}
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1)
    check_bitwise(results, reference(OPTIMIZERS["SGD nesterov"], STEPS, MICRO, 0.0))


def test_what_a_named_torch_optimizer_does_not_take_is_said():
    from offload.config import ConfigError
    config = client_config(1, 3, {"device": "cpu"}, 0.0)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "betas": [0.9, 0.99]}}
    with pytest.raises(ConfigError, match="torch.optim.SGD does not take these.*betas"):
        offload.initialize(model=make_any("gpt"), config=config)
    config["optimizer"]["params"] = {"lr": 0.05}
    config["offload"] = {"optimizer_state": {"moments": "bf16"}}
    with pytest.raises(ConfigError, match="a torch optimizer's state is float32"):
        offload.initialize(model=make_any("gpt"), config=config)


@pytest.mark.parametrize("name,held", [("SGD", ()), ("SGD momentum", ("exp_avg",)),
                                       ("RMSprop plain", ("exp_avg",)), ("RMSprop", ("exp_avg", "exp_avg_sq"))])
def test_the_slot_holds_only_the_buffers_the_optimizer_keeps(name, held):
    """SGD without momentum keeps the master alone (4 bytes an element), with momentum one buffer beside it (8);
    RMSprop its square average, and with momentum its momentum too: the probe says which."""
    make = functools.partial(torch.optim.RMSprop, lr=0.005) if name == "RMSprop plain" else OPTIMIZERS[name]
    engine, *_ = offload.initialize(model=make_any("gpt"), config=client_config(1, 3, {"device": "cpu"}, 0.0),
                                    optimizer=make)
    fmt = engine.optimizer.state_format
    engine.close()
    assert fmt.held == held and fmt.bytes_per_element == 4 + 4 * len(held)


@pytest.mark.parametrize("name", ["SGD momentum", "NAdam", "ASGD"])
@pytest.mark.parametrize("schedule", [{"overlap_step": "on"}, {"early_step": "on"}])
def test_stepped_during_backward_or_early_as_torch(name, schedule):
    """Without clipping nothing gates the update: each unit is stepped as its gradient lands (overlapped with
    backward), or after engine.step() returned (early, beside the next forward); bit for bit torch's, the scalars
    (NAdam's mu_product, ASGD's eta and mu) read as they were before the step whatever order the units run in."""
    config = client_config(1, 3, {"device": "cpu"}, 0.0)
    config["offload"].update(schedule)
    make = OPTIMIZERS[name]
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1, optimizer=make)
    assert results[0]["overlapped"] > 0
    check_bitwise(results, reference(make, STEPS, MICRO, 0.0))


@pytest.mark.parametrize("lane", ["device", "streamed"])
def test_state_on_the_emulated_gpu_or_streamed_through_it_steps_as_torch(lane):
    """Half the units' state kept on the emulated discrete device, or homed on the host and streamed through it:
    torch's own code on the device's views, the rest on the host's, bit for bit torch's."""
    state = {"device": "cpu", "ratio": 0.5} if lane == "device" else {"device": "cpu"}
    config = client_config(1, 3, state, 0.0)  # clipping that fires scales as torch's only closely (see above)
    config["offload"]["stream_state"] = 0.5 if lane == "streamed" else 0
    make = OPTIMIZERS["RMSprop"]
    env = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
    results = run_ranks(train_engine, 1, env=env, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1,
                        optimizer=make, finished=lanes_of)
    assert (("device", False) if lane == "device" else ("host", True)) in results[0]["lanes"]
    check_bitwise(results, reference(make, STEPS, MICRO, 0.0))


def lanes_of(engine):
    """Each sub-group's tier and whether it is streamed."""
    return {"lanes": [(g.tier.value, g.streamed) for g in engine.optimizer.sub_groups]}


def one_step_late(make, steps, rows, warmup):
    """The torch optimizer on master weights; the model the batches run through gets each step's new masters at once
    for the first ``warmup`` steps, then the masters from before the step (the previous update)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_any("gpt")
        master = copy.deepcopy(model)
        opt = make(list(master.parameters()))
        losses = []
        for step, tokens in enumerate(batches(steps, rows), 1):
            losses.append(backward_over(model, "gpt", tokens, MICRO))
            for m, p in zip(master.parameters(), model.parameters(), strict=True):
                m.grad, p.grad = p.grad, None
            before = [m.detach().clone() for m in master.parameters()]
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, m, old in zip(model.parameters(), master.parameters(), before, strict=True):
                    p.copy_(m if step <= warmup else old)
        return {"losses": losses, "state": master.state_dict()}
    finally:
        torch.set_num_threads(threads)


def test_the_delayed_update_steps_a_torch_optimizer_one_step_late():
    """offload.delayed_update (opt-in, not exact by design): after its warm-up each update of the torch optimizer's
    own step reaches the weights one step late, as a PyTorch loop that applies it one step late, bit for bit."""
    config = client_config(1, 3, {"device": "cpu"}, 0.0)
    config["offload"]["delayed_update"] = {"warmup_steps": 2}
    make = OPTIMIZERS["NAdam"]
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=5, micro=MICRO, accum=1, optimizer=make)
    assert results[0]["mode"].startswith("delayed update after 2 exact steps")
    check_bitwise(results, one_step_late(make, 5, MICRO, 2))
