"""Gradients a backward leaves on an engine's model without the engine starting it (a GAN's generator loss
backpropagated through the discriminator) stay in ``.grad`` as PyTorch leaves them: the script's
``module.zero_grad()``, ``optimizer.zero_grad()`` or ``p.grad = None`` clears them, and a loop that does not clear
them steps on them with the next backward's, as PyTorch does (whose optimizer is cleared after its step, as the
engine's step leaves no gradient), at every stage and tier, W = 1 and 2 (see [Note: a
backward this engine did not start] in offload/zero/runtime.py). Before, they were reduced into the shards at once,
and the discriminator stepped on them after the script had cleared them: a silent wrong result."""

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload.machine.launch import run_ranks

NZ, BATCH, ITERATIONS = 8, 8, 6
CLEARS = ("module", "optimizer", "grad_none", "none")


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
    net_d = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    return net_g, net_d


def _data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    samples = torch.Generator().manual_seed(1234)
    return [(torch.tanh(torch.randn(BATCH * world, 16, generator=samples) * 0.5 + 0.8),
             torch.randn(BATCH * world, NZ, generator=samples)) for _ in range(ITERATIONS)]


def _config(stage: int, tier: str, world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if tier == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_batch_size": BATCH * world, "zero_optimization": zero,
            "offload": {"unit_bytes": 4096}}


def _gan(rank: int, world: int, clear: str, config: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSpeedExamples' DCGAN loop: the discriminator cleared at the top of each iteration (``clear``), stepped
    on two backward calls, then the generator's loss backpropagated through it. ``config`` None: plain PyTorch on
    the whole batch, else under offload on this rank's rows."""
    net_g, net_d = _nets()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    if config is not None:
        eng_d, opt_d, _, _ = offload.initialize(model=net_d, optimizer=opt_d, config=config)
        eng_g, opt_g, _, _ = offload.initialize(model=net_g, optimizer=opt_g, config=config)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
    else:
        rows = slice(None)
    criterion = nn.BCELoss()

    def backward(loss: torch.Tensor, engine: Any) -> None:
        loss.backward() if config is None else engine.backward(loss)

    losses = []
    for real, noise in _data(world):
        real, noise = real[rows], noise[rows]
        if clear == "module":
            net_d.zero_grad()
        elif clear == "optimizer":
            opt_d.zero_grad()
        elif clear == "grad_none":
            for p in net_d.parameters():
                p.grad = None
        err_real = criterion(net_d(real).view(-1), torch.ones(len(real)))
        backward(err_real, config and eng_d)
        fake = net_g(noise)
        err_fake = criterion(net_d(fake.detach()).view(-1), torch.zeros(len(real)))
        backward(err_fake, config and eng_d)
        if config is None:  # the engine's step leaves no gradient behind (DeepSpeed's neither)
            opt_d.step()
            opt_d.zero_grad()
        else:
            eng_d.step()
        net_g.zero_grad()
        err_g = criterion(net_d(fake).view(-1), torch.ones(len(real)))
        backward(err_g, config and eng_g)
        opt_g.step() if config is None else eng_g.step()
        losses.append([err_real.item(), err_fake.item(), err_g.item()])
    with torch.no_grad():
        out = {"losses": losses, "generated": net_g(_data(1)[0][1]).double().sum().item()}
    if config is not None:
        out["d_state"] = eng_d.full_state_dict()
        eng_d.close()
        eng_g.close()
    return out


def _close(ours: dict[str, Any], ref: dict[str, Any]) -> None:
    # offload's Adam matches torch's within 1e-6 relative a step ([Note: one divide] in native/kernels.cpp)
    torch.testing.assert_close(torch.as_tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert ours["generated"] == pytest.approx(ref["generated"], rel=1e-5)


@pytest.mark.parametrize("stage,tier", [(0, "none"), (1, "cpu"), (2, "cpu"), (2, "none"), (3, "cpu"), (3, "none")])
@pytest.mark.parametrize("clear", CLEARS)
def test_the_generators_gradients_on_the_discriminator_are_cleared_as_in_pytorch(stage, tier, clear):
    ref = _gan(0, 1, clear, None)
    ours = _gan(0, 1, clear, _config(stage, tier, 1))
    _close(ours, ref)
    # the case is sensitive: clearing or not changes the training by far more than the tolerance
    other = _gan(0, 1, "none" if clear != "none" else "module", None)
    assert abs(other["generated"] - ref["generated"]) > 1e-3 * abs(ref["generated"])


@pytest.mark.parametrize("clear", ["module", "none"])
def test_two_ranks_clear_or_keep_them_as_pytorch_on_the_whole_batch(clear):
    ref = _gan(0, 2, clear, None)
    ranks = run_ranks(_gan, 2, clear=clear, config=_config(3, "cpu", 2))
    assert ranks[0]["generated"] == ranks[1]["generated"]
    # each rank's losses are its half's means, the whole batch's loss their mean
    _close({"losses": (torch.tensor(ranks[0]["losses"]) + torch.tensor(ranks[1]["losses"])) / 2,
            "generated": ranks[0]["generated"]}, ref)


def _accumulating(stage: int, clear_at: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Two micro-batches a step over one discriminator engine; ``model.zero_grad()`` after the first micro-batch
    (``between``) or after the second, where step() would go (``boundary``), then the next step as usual."""
    _, net_d = _nets()
    config = {"train_batch_size": 2 * BATCH, "train_micro_batch_size_per_gpu": BATCH,
              "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 2e-3}}, "offload": {"unit_bytes": 4096}}
    engine, *_ = offload.initialize(model=net_d, config=config)
    data = iter(_data(4))
    notes = []
    for micro in range(4):
        real, _ = next(data)
        engine.backward(nn.BCELoss()(net_d(real[:BATCH]).view(-1), torch.ones(BATCH)))
        if micro == 0 and clear_at == "between" or micro == 1 and clear_at == "boundary":
            net_d.zero_grad()
            notes.append("cleared")
        else:
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state, notes


def test_the_models_zero_grad_drops_a_complete_accumulation_as_in_pytorch():
    """After the last micro-batch, instead of step(): the gradients are dropped (as engine.zero_grad() drops
    them), and the next two micro-batches make the one step, as in PyTorch."""
    state, _ = _accumulating(3, "boundary")
    _, net_d = _nets()
    opt = torch.optim.Adam(net_d.parameters(), lr=2e-3)
    data = iter(_data(4))
    for micro in range(4):
        real, _ = next(data)
        (nn.BCELoss()(net_d(real[:BATCH]).view(-1), torch.ones(BATCH)) / 2).backward()
        if micro == 1:
            net_d.zero_grad()
        elif micro == 3:
            opt.step()
    for key, value in net_d.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7)


def test_the_models_zero_grad_between_micro_batches_says_once_what_it_cannot_clear(caplog):
    with caplog.at_level(logging.WARNING, logger="offload"):
        _accumulating(3, "between")
    assert caplog.text.count("model.zero_grad() after 1 of 2 micro-batches cannot clear their gradients") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload"):
        _accumulating(0, "between")  # stage 0 keeps them in .grad, which the model's zero_grad clears: nothing to say
    assert "cannot clear" not in caplog.text


def test_a_copy_of_the_model_takes_its_own_method_and_close_gives_the_model_its_own_back():
    _, net_d = _nets()
    engine, *_ = offload.initialize(model=net_d, optimizer=torch.optim.Adam(net_d.parameters()),
                                    config=_config(0, "none", 1))
    assert "zero_grad" in vars(net_d)
    copied = copy.deepcopy(net_d)
    copied.zero_grad()  # its own method, bound to the copy: no engine behind it
    assert copied.zero_grad.func is type(net_d).zero_grad and copied.zero_grad.args == (copied,)
    engine.close()
    assert "zero_grad" not in vars(net_d)
