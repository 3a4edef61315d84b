"""Adam for state on a discrete device ([Note: Adam on a discrete device] in offload/optim/adam.py): torch's fused
kernel over a shard's segments, bitwise what plain PyTorch's fused optimizer does after clipping."""

import pytest
import torch

from offload.optim.adam import AdamHyper, adam_step, device_adam_step


def _segments(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(4099), torch.randn(37), torch.randn(1)]


@pytest.mark.parametrize("adamw_mode,weight_decay", [(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.05)])
def test_bitwise_torchs_fused_optimizer_after_a_clip(adamw_mode, weight_decay):
    """The factor multiplies each gradient first, as clip_grad_norm_ does before torch's optimizer steps."""
    start = _segments()
    reference = [p.clone().requires_grad_() for p in start]
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_opt = kind(reference, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, fused=True)
    params = [p.clone() for p in start]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in start], [torch.zeros_like(p) for p in start]
    hyper = AdamHyper(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, adamw_mode=adamw_mode)
    for step, factor in enumerate((1.0, 0.37, 1.0, 0.5), start=1):
        grads = [torch.randn_like(p) for p in start]
        kept = [g.clone() for g in grads]
        for p, g in zip(reference, grads):
            p.grad = g.mul(factor)
        torch_opt.step()
        device_adam_step(params, grads, exp_avgs, exp_avg_sqs, step, hyper, grad_scale=factor)
        assert all(torch.equal(g, k) for g, k in zip(grads, kept))  # the gradients are read, not scaled in place
        for mine, theirs in zip(params, reference):
            assert torch.equal(mine, theirs.detach()), f"step {step}"
        for p, m, v in zip(reference, exp_avgs, exp_avg_sqs):
            assert torch.equal(torch_opt.state[p]["exp_avg"], m) and torch.equal(torch_opt.state[p]["exp_avg_sq"], v)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_without_bias_correction_it_is_the_native_kernels_update(adamw_mode):
    """torch's kernels always correct for bias; without it the update is torch's ops, the native kernel's math."""
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, bias_correction=False)
    params, native = _segments(), _segments()
    state = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    for step in (1, 2, 3):
        grads = [torch.randn_like(p) for p in params]
        device_adam_step(params, grads, state[0], state[1], step, hyper, grad_scale=0.5)
        for i, (p, g) in enumerate(zip(native, grads)):
            adam_step(p, g, state[2][i], state[3][i], step, hyper, grad_scale=0.5)
    for mine, theirs in zip(params, native):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_nothing_to_step_and_a_bad_step_number():
    device_adam_step([], [], [], [], 1, AdamHyper())  # a shard with no trainable segment
    p = torch.zeros(3)
    with pytest.raises(ValueError, match=r"step must be a whole number >= 1 \(the step being taken\), got 0"):
        device_adam_step([p], [p], [p], [p], 0, AdamHyper())
