"""CPUAdam as a torch.optim.Optimizer: a drop-in for torch.optim.AdamW on CPU tensors."""

import copy

import pytest
import torch
from torch.testing import assert_close

from offload.optim import CPUAdam


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 5))
    x, y = torch.randn(16, 33), torch.randint(0, 5, (16,))
    return model, x, y


def train(model, opt, x, y, steps, scheduler=None):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def test_drop_in_for_adamw_with_param_groups_and_a_scheduler():
    ours, x, y = model_and_data()
    ref = copy.deepcopy(ours)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.ndim == 2]
        no_decay = [p for n, p in m.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    opt = CPUAdam(groups(ours), lr=3e-3, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW(groups(ref), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=60)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=3e-3, total_steps=60)
    losses = train(ours, opt, x, y, 60, sched)
    ref_losses = train(ref, ref_opt, x, y, 60, ref_sched)
    assert losses[-1] < 0.5 * losses[0]
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_adam_mode_is_l2_like_torch_adam():
    ours, x, y = model_and_data(1)
    ref = copy.deepcopy(ours)
    train(ours, CPUAdam(ours.parameters(), lr=1e-3, weight_decay=0.01, adamw_mode=False), x, y, 30)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False), x, y, 30)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_continues_identically():
    model, x, y = model_and_data(2)
    opt = CPUAdam(model.parameters(), lr=1e-3)
    train(model, opt, x, y, 5)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    continued = train(model, opt, x, y, 5)

    model2, _, _ = model_and_data(2)
    model2.load_state_dict(saved_model)
    opt2 = CPUAdam(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(saved_opt)
    assert train(model2, opt2, x, y, 5) == continued
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_state_dicts_move_between_torch_adamw_and_cpuadam():
    model, x, y = model_and_data(3)
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    train(model, torch_opt, x, y, 5)
    ours = CPUAdam(model.parameters(), lr=1e-3)
    ours.load_state_dict(torch_opt.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    train(ref, ref_opt, x, y, 5)
    assert_close(torch.tensor(train(model, ours, x, y, 5)), torch.tensor(train(ref, ref_opt, x, y, 5)),
                 rtol=1e-5, atol=1e-6)
    back = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    back.load_state_dict(ours.state_dict())
    assert set(back.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_params_without_grad_are_skipped_and_closure_is_called():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = CPUAdam([a, b], lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        loss = (a * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 8.0 and calls == [1]
    assert not torch.equal(a, torch.ones(4)) and torch.equal(b, torch.ones(4))
    assert b not in opt.state


@pytest.mark.parametrize("param, message", [
    (torch.nn.Parameter(torch.ones(4, dtype=torch.float64)), "needs float32 params"),
    (torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), "needs float32 params"),
    (torch.nn.Parameter(torch.ones(4, 4).t()), "needs contiguous params"),
    (torch.nn.Parameter(torch.ones(4, device="meta")), "updates CPU tensors"),
])
def test_unusable_params_are_refused_at_construction(param, message):
    with pytest.raises(ValueError, match=message):
        CPUAdam([param])


def test_bad_hyperparameters_and_loaded_amsgrad():
    with pytest.raises(ValueError, match="invalid Adam lr"):
        CPUAdam([torch.nn.Parameter(torch.ones(2))], lr=-1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = CPUAdam([p])
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="does not implement amsgrad"):
        opt.step()


def test_non_contiguous_grad_is_handled():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    q = torch.nn.Parameter(torch.zeros(3, 3))
    p.grad = torch.arange(9.0).reshape(3, 3).t()
    q.grad = p.grad.contiguous()
    CPUAdam([p], lr=0.1).step()
    torch.optim.AdamW([q], lr=0.1, foreach=False).step()
    assert_close(p, q, rtol=1e-6, atol=1e-7)
