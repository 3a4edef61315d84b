"""The config's type Muon ([Note: Muon over shards] in offload/optim/muon_pass.py): torch.optim.Muon on the hidden
matrices and AdamW on the rest, with DeepSpeed's names and split, equal to the two torch optimizers stepping the
same model in one process: bit for bit where the gradients are (one rank, one micro-batch a step), at every stage,
the state on the host or the device, clipping on and off; and two ranks, whose gradients sum in another order
than one process's (which Muon's bf16 orthogonalisation then magnifies), to the last places of a step."""

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    backward_over,
    base_config,
    batches,
    clip_at_exact_norm_,
    engine_device,
    make_any,
    resume_engine,
    train_engine,
)

import offload
from offload.config import ConfigError
from offload.engine.errors import EngineError
from offload.machine.launch import run_ranks
from offload.optim.muon import MuonHyper, orthogonalized

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9's")

STEPS, MICRO, ACCUM = 5, 2, 2
MUON_LR, ADAM_LR, WD, MOMENTUM = 0.02, 3e-3, 0.1, 0.9


@pytest.mark.parametrize("shape", [(96, 32), (32, 128), (48, 48)])
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_the_orthogonalisation_and_step_size_are_torchs_bit_for_bit(shape, adjust):
    """A tall, a wide and a square matrix through one step of torch.optim.Muon and of ours, from one gradient."""
    torch.manual_seed(0)
    start, grad = torch.randn(shape), torch.randn(shape)
    ref = start.clone().requires_grad_()
    opt = torch.optim.Muon([ref], lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn=adjust)
    ref.grad = grad.clone()
    opt.step()
    hyper = MuonHyper(lr=0.05, weight_decay=0.1, momentum=0.9, adjust_lr_fn=adjust)
    blended = grad.lerp(torch.zeros(shape).lerp_(grad, 1 - 0.9), 0.9)
    ours = start.clone()
    ours.mul_(1 - hyper.lr * hyper.weight_decay)
    ours.add_(orthogonalized(blended, hyper), alpha=-hyper.scaled_lr(shape))
    assert torch.equal(ours, ref.detach())


def is_muon(name, p):
    return p.ndim == 2 and "embed" not in name and "lm_head" not in name  # DeepSpeed's rule


def reference(steps, rows, clip, world, adam_lr=ADAM_LR):
    """Plain single-process PyTorch on the whole global batch: torch.optim.Muon and torch.optim.AdamW, on one
    thread as the ranks run (a bf16 product's rounding depends on how many threads split it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(steps, rows, clip, world, adam_lr)
    finally:
        torch.set_num_threads(threads)


def _reference(steps, rows, clip, world, adam_lr):
    model = make_any("gpt").to(engine_device(world))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], lr=MUON_LR, weight_decay=WD, momentum=MOMENTUM)
    adam = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], lr=adam_lr, betas=(0.9, 0.95),
                             weight_decay=WD)
    losses = []
    for tokens in batches(steps, rows):
        losses.append(backward_over(model, "gpt", tokens.to(engine_device(world)), MICRO))
        if clip:  # the exact norm: torch's own rounds by the CPU (see clip_at_exact_norm_)
            clip_at_exact_norm_([p for _, p in named], clip)
        muon.step()
        adam.step()
        for _, p in named:
            p.grad = None
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()}}


def muon_config(world, stage, state, clip, accum=1, adam_lr=ADAM_LR, **params):
    config = base_config(MICRO, accum, world, clip=clip, stage=stage, sub_group_size=3000)
    config["optimizer"] = {"type": "Muon", "params": {"lr": 1.0, "muon_lr": MUON_LR, "adam_lr": adam_lr,
                                                      "betas": [0.9, 0.95], "weight_decay": WD,
                                                      "momentum": MOMENTUM, **params}}
    config["zero_optimization"]["offload_optimizer"] = {"device": state}
    return config


def check_bitwise(results, ref):
    assert results[0]["losses"] == ref["losses"]
    for key, value in ref["state"].items():
        assert torch.equal(results[0]["state"][key], value), key


@pytest.mark.parametrize("stage,state,clip", [(3, "cpu", 1.0), (3, "cpu", 0.0), (2, "none", 1.0), (1, "cpu", 0.0)])
def test_the_engine_steps_muon_bitwise_as_torch(stage, state, clip):
    """One rank, one micro-batch a step: the gradients are torch's to the bit, and so is every Muon step; the state
    on the host and on the device, clipping on and off, the step whole after backward. AdamW's rate is 0: its
    native kernel agrees with torch's only to rounding, which the bf16 orthogonalisation would then magnify (the
    two halves together: ``test_muon_and_adamw_together_train_as_plain_torch``)."""
    results = run_ranks(train_engine, 1, name="gpt", config=muon_config(1, stage, state, clip, adam_lr=0.0),
                        steps=STEPS, micro=MICRO, accum=1)
    check_bitwise(results, reference(STEPS, MICRO, clip, 1, adam_lr=0.0))
    assert results[0]["overlapped"] == 0 and "Muon's step gathers each matrix" in results[0]["mode"]


@pytest.mark.parametrize("stage,state", [(3, "cpu"), (2, "cpu"), (1, "none")])
def test_matrices_cut_across_two_ranks_step_as_torch(stage, state):
    """Each rank holds a slice of a matrix; the slices are gathered whole for its orthogonalisation. Two
    micro-batches a step on each rank: one step agrees to the last places (a wrong slice would be off by the
    whole update, about 5e-3); at stage 3, the losses to 1e-4 over five."""
    config = muon_config(2, stage, state, 1.0, accum=ACCUM, adam_lr=0.0)
    one = run_ranks(train_engine, 2, name="gpt", config=config, steps=1, micro=MICRO, accum=ACCUM)
    ref = reference(1, MICRO * ACCUM * 2, 1.0, 2, adam_lr=0.0)
    for key, value in ref["state"].items():
        torch.testing.assert_close(one[0]["state"][key], value, rtol=0, atol=1e-5, msg=key)
    if stage != 3:
        return
    five = run_ranks(train_engine, 2, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=ACCUM)
    ref = reference(STEPS, MICRO * ACCUM * 2, 1.0, 2, adam_lr=0.0)
    torch.testing.assert_close(torch.tensor(five[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)


def test_muon_and_adamw_together_train_as_plain_torch():
    """Both halves stepping: AdamW's kernel rounds otherwise than torch's and Muon's bf16 orthogonalisation
    magnifies that, so after five steps the weights agree to a fraction of one Muon step (about 5e-3)."""
    results = run_ranks(train_engine, 1, name="gpt", config=muon_config(1, 3, "cpu", 1.0), steps=STEPS,
                        micro=MICRO, accum=1)
    ref = reference(STEPS, MICRO, 1.0, 1)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
    for key, value in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][key], value, rtol=0, atol=5e-3, msg=key)


def test_state_on_a_discrete_device_steps_muon_as_plain_torch():
    """Half the state on the emulated discrete device (every copy on its own stream): those units' momentum and
    orthogonalisation in the device's memory, the rest on the host."""
    config = muon_config(1, 3, "cpu", 0.0, adam_lr=0.0)  # the norm of a split is summed in two parts
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    gpu = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
    results = run_ranks(train_engine, 1, env=gpu,
                        name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1)
    assert results[0]["tiers"]["device"] > 0
    check_bitwise(results, reference(STEPS, MICRO, 0.0, 1, adam_lr=0.0))


def test_a_resumed_muon_run_is_bitwise_the_unbroken_one(tmp_path):
    """The momentum (exp_avg) and the kept directions go through the checkpoint; the groups' Muon keys too."""
    config = muon_config(2, 3, "cpu", 1.0, accum=ACCUM)
    whole = run_ranks(train_engine, 2, name="gpt", config=config, steps=4, micro=MICRO, accum=ACCUM)
    run_ranks(train_engine, 2, name="gpt", config=config, steps=2, micro=MICRO, accum=ACCUM,
              save_dir=str(tmp_path))
    resumed = run_ranks(resume_engine, 2, name="gpt", config=config, load_dir=str(tmp_path), steps=4, start=2,
                        micro=MICRO, accum=ACCUM)
    for key, value in whole[0]["state"].items():
        assert torch.equal(resumed[0]["state"][key], value), key


def test_the_groups_split_as_deepspeeds_with_a_scripts_tags_and_group_keys():
    """Each group's Muon half, then its AdamW half; muon_lr / adam_lr over lr, a group's own key over both; a
    script's use_muon tag over the rule."""
    model = make_any("gpt")
    model.wte.weight.use_muon = False  # the rule would take it (its name says neither embed nor lm_head)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim != 2]
    engine, optimizer, _, _ = offload.initialize(
        model=model, config=muon_config(1, 3, "cpu", 1.0),
        model_parameters=[{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-4}])
    groups = [(g["use_muon"], len(g["params"]), g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    n_matrices = len(decay) - 1
    assert groups == [(True, n_matrices, MUON_LR, WD), (False, 1, ADAM_LR, WD), (False, len(rest), 5e-4, 0.0)]
    assert optimizer.param_groups[0]["momentum"] == MOMENTUM and optimizer.hyper(0).rule == "muon"
    assert optimizer.hyper(1).rule == "adam" and optimizer.hyper(1).betas == (0.9, 0.95)
    # each parameter marked as it was decided, as DeepSpeed marks them; the script's own mark kept
    assert [p.use_muon for p in decay] == [p is not model.wte.weight for p in decay]
    assert not any(p.use_muon for p in rest) and model.wte.weight.use_muon is False
    engine.close()
    with offload.zero.Init():  # built a unit at a time: the parameters keep their shapes, so the split is the same
        model = make_any("gpt")
    engine, optimizer, _, _ = offload.initialize(model=model, config=muon_config(1, 3, "cpu", 1.0))
    assert [len(g["params"]) for g in optimizer.param_groups] == [n_matrices + 1, len(rest)]
    engine.close()


def _muon_alone(params):
    """The matrices (the test GPT names none embed or lm_head: every 2-D parameter is one)."""
    return torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR, weight_decay=WD, momentum=MOMENTUM)


def test_a_scripts_torch_muon_steps_bitwise_as_torchs():
    """torch.optim.Muon handed to initialize: its matrices stepped as the type Muon steps them, the parameters it
    does not hold left as they are (as torch leaves them)."""
    config = base_config(MICRO, 1, 1, clip=0.0, sub_group_size=3000)
    del config["optimizer"]
    results = run_ranks(train_engine, 1, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1,
                        optimizer=_muon_alone)
    check_bitwise(results, reference(STEPS, MICRO, 0.0, 1, adam_lr=0.0))


def test_what_muon_does_not_take_is_said(tmp_path):
    cases = [
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}},
         "Muon's state is stepped on the host or the device"),
        ({"offload": {"stream_state": 0.5}}, "every gradient is in, so no state is streamed"),
        ({"offload": {"overlap_step": "on"}}, "runs whole after backward"),
        ({"offload": {"early_step": "on"}}, "runs whole after backward"),
        ({"offload": {"delayed_update": {"warmup_steps": 2}}}, "runs whole after backward"),
        ({"offload": {"optimizer_state": {"moments": "bf16"}}}, "Muon's state is float32"),
        ({"offload": {"speculative_step": "on"}}, "Muon is not speculated"),
    ]
    for change, message in cases:
        config = muon_config(1, 3, "cpu", 1.0)
        for key, value in change.items():
            config[key] = {**config.get(key, {}), **value}
        with pytest.raises(ConfigError, match=message):
            offload.initialize(model=make_any("gpt"), config=config)
    config = base_config(MICRO, ACCUM, 1)
    config["optimizer"]["params"]["momentum"] = 0.9
    with pytest.raises(ConfigError, match="momentum: is Muon's; type AdamW has none"):
        offload.initialize(model=make_any("gpt"), config=config)
    config = muon_config(1, 3, "cpu", 1.0, ns_method="gram")
    with pytest.raises(ConfigError, match="ns_method"):
        offload.initialize(model=make_any("gpt"), config=config)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    model[0].weight.use_muon = True
    with pytest.raises(EngineError, match=r"tagged use_muon but has shape \(4, 3, 3, 3\)"):
        offload.initialize(model=model, config=muon_config(1, 3, "cpu", 1.0))
