"""The clip factor ([Note: the clip factor] in offload/optim/loss_scale.py): from a given norm, torch's own
factor to the bit; the engine's norm the exact float64 norm of its gradients, the same on every CPU, and torch's
CPU-dependent float32 norm within its rounding bound."""

import math

import numpy as np
import pytest
import torch
from engine_cases import backward_over, base_config, batches, exact_norm, make_any, train_engine

from offload.machine.launch import run_ranks
from offload.optim.loss_scale import clip_coefficient, gradient_factor

MICRO = 2


def torchs_factor(norm: np.float32, clip: float) -> float:
    """What torch's clipping multiplies a gradient of ones by, given ``norm`` as the total norm."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    torch.nn.utils.clip_grads_with_norm_([p], clip, torch.tensor(norm, dtype=torch.float32))
    return float(p.grad)


@pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"), reason="torch >= 2.6's")
@pytest.mark.parametrize("clip", [1.0, 0.05, 0.3, 7.5])
def test_the_factor_from_a_norm_is_torchs_bit_for_bit(clip):
    """Norms around the clip (where the factor crosses 1), far above it and far below it, and on each float32
    neighbour of the clip itself: a plain float64 ``clip / (norm + 1e-6)`` differs from torch's float32 steps in
    a few percent of these."""
    rng = np.random.default_rng(0)
    norms = np.concatenate([clip * np.exp(rng.uniform(-0.1, 0.1, 400)), clip * np.exp(rng.uniform(-12, 12, 400))])
    near = np.float32(clip) + np.arange(-8, 9, dtype=np.float32) * np.spacing(np.float32(clip))
    for norm in [*norms.astype(np.float32), *near, np.float32(0.0)]:
        assert clip_coefficient(float(norm), clip) == torchs_factor(norm, clip), (norm, clip)
    plain = sum(np.float32(min(1.0, clip / (float(n) + 1e-6))) != np.float32(torchs_factor(n, clip))
                for n in norms.astype(np.float32))
    assert plain > 0  # the reason for the float32 steps: the test can tell them apart


def test_the_factor_folds_the_unscale_in_and_does_not_clip_a_non_finite_norm():
    norm, factor = gradient_factor(sum_sq=400.0, nonfinite=0, loss_scale=4.0, clip=1.0)
    assert norm == 5.0 and factor == 0.25 * clip_coefficient(5.0, 1.0)
    norm, factor = gradient_factor(sum_sq=400.0, nonfinite=3, loss_scale=4.0, clip=1.0)
    assert math.isnan(norm) and factor == 0.25
    assert gradient_factor(sum_sq=0.25, nonfinite=0, loss_scale=1.0, clip=0.0) == (0.5, 1.0)


def _train_with_norms(rank, world, **kwargs):
    norms = []
    return train_engine(rank, world, after_step=lambda i, engine: norms.append(engine.get_global_grad_norm()),
                        finished=lambda engine: {"norms": norms}, **kwargs)


def test_the_engines_norm_is_the_exact_one_and_torchs_within_its_rounding():
    """One rank, one micro-batch: the first step's gradients are plain PyTorch's to the bit, and the engine's norm
    of them is their float64 norm to float64 rounding, whatever the CPU: n squares summed in float64 are off by at
    most n units of 2**-53 (n the parameter count; about 1.3e-11 here). torch's float32 sum of a tensor's squares
    may be off by its size in float32 units (recursive summation's bound): that is what moves with the CPU's
    vector width, and why references clip at the exact norm (clip_at_exact_norm_). One step: the next ones start
    from the native Adam's weights, which are torch's only to rounding."""
    got = run_ranks(_train_with_norms, 1, name="gpt", config=base_config(MICRO, 1, 1, clip=0.0), steps=1,
                    micro=MICRO, accum=1)[0]["norms"][0]
    model = make_any("gpt")
    backward_over(model, "gpt", batches(1, MICRO)[0], MICRO)
    grads = [p.grad for p in model.parameters()]
    exact = exact_norm(grads)
    torchs = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    count = sum(g.numel() for g in grads)
    assert abs(got - exact) <= count * 2.0 ** -53 * exact, (got, exact)
    assert abs(torchs - exact) <= max(g.numel() for g in grads) * 2.0 ** -24 * exact, (torchs, exact)
