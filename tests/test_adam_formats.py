"""The native Adam with its state in fewer bytes (see [Note: state formats] in native/kernels.cpp), on every variant:
bf16 moments step in float32 and store rounded; the 16+16 master is the float32 master bit for bit; a bf16 master
rounds to nearest (and stalls on small updates: the negative control) or stochastically (unbiased, reproducible)."""

from pathlib import Path

import pytest
import torch

from offload.machine import native
from offload.machine.native import Stochastic
from offload.optim import AdamHyper, adam_step
from offload.store.state_format import join_master, split_master

HYPER = AdamHyper(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def state(n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), [torch.randn(n, generator=gen) * 1e-2 for _ in range(6)]


def fp32_step(p, g, m, v, step, **kw):
    """The float32 kernel on float32 copies: what every format's arithmetic is."""
    p, m, v = p.float().clone(), m.float().clone(), v.float().clone()
    adam_step(p, g, m, v, step, HYPER, **kw)
    return p, m, v


@pytest.mark.parametrize("n", [1, 15, 17, 100_003])
def test_bf16_moments_are_the_float32_step_stored_rounded_to_nearest(variant, n):
    p, grads = state(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, 1):
        want_p, want_m, want_v = fp32_step(p, g, m, v, step)
        out = torch.empty(n, dtype=torch.bfloat16)
        adam_step(p, g, m, v, step, HYPER, out16=out)
        assert torch.equal(p, want_p)  # the master: bitwise, from the same (widened) moments
        assert torch.equal(m, want_m.bfloat16()) and torch.equal(v, want_v.bfloat16())
        assert torch.equal(out, want_p.bfloat16())


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 100_003])
def test_the_16_16_master_is_the_float32_master_bit_for_bit_every_step(variant, moments, n):
    p, grads = state(n, seed=1)
    ref_p, ref_m, ref_v = p.clone(), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    hi, lo = split_master(p)
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    for step, g in enumerate(grads, 1):
        adam_step(ref_p, g, ref_m, ref_v, step, HYPER)
        out = torch.empty(n, dtype=torch.bfloat16)
        adam_step(hi, g, m, v, step, HYPER, out16=out, master_lo=lo)
        assert torch.equal(join_master(hi, lo), ref_p)
        assert torch.equal(m, ref_m) and torch.equal(v, ref_v)
        assert torch.equal(out, hi)
    # the weights the forward reads: the master rounded to nearest, ties away from zero where plain mixed precision
    # rounds them to even (one element in 65536)
    nearest = ref_p.bfloat16()
    assert torch.equal(hi, split_master(ref_p)[0])
    differ = hi != nearest
    ties = (ref_p.view(torch.int32) & 0xFFFF) == 0x8000
    assert (differ <= ties).all() and differ.sum() <= max(8, n // 4096)


def test_the_split_restores_every_float_and_rounds_ties_away_from_zero():
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38,
                             1e-45, -1e-45, 1.1754942e-38, 1e-40])
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000], dtype=torch.int64)
    tied = torch.where(ties >= 2**31, ties - 2**32, ties).to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2**31, 2**31, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32)
    randoms = bits.view(torch.float32)
    randoms = randoms[~randoms.isnan()]
    for values in (specials, tied, randoms):
        hi, lo = split_master(values)
        assert torch.equal(join_master(hi, lo).view(torch.int32), values.view(torch.int32))
    hi, _ = split_master(tied)  # 1 + half a bf16 unit (even below): up, where nearest-even keeps 1.0
    assert hi.view(torch.int16).tolist() == [0x3F81, 0x3F82, -0x407F, 0x0001]
    assert tied.bfloat16().view(torch.int16).tolist()[0] == 0x3F80
    hi, lo = split_master(torch.tensor([float("nan")]))
    assert hi.isnan().all() and lo.tolist() == [0]


def test_a_large_master_splits_and_joins_in_chunks_with_little_memory_beside_it(monkeypatch):
    """The split works through CHUNK elements at a time: the halves are the same across chunk edges (NaNs
    included), and a master of 32M elements takes its outputs and about one chunk's temporaries beside it, not
    the 50 bytes an element its int64 arithmetic would take all at once (1.6 GB; an 8B model's embedding: 26 GB)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from memwatch import AnonPeak

    from offload.store import state_format
    gen = torch.Generator().manual_seed(5)
    values = torch.randint(-2**31, 2**31, (3, 4321), generator=gen, dtype=torch.int64).to(torch.int32)
    values = values.view(torch.float32)
    whole = split_master(values)
    monkeypatch.setattr(state_format, "CHUNK", 1000)
    chunked = split_master(values)
    assert chunked[0].shape == values.shape and torch.equal(chunked[0].view(torch.int16), whole[0].view(torch.int16))
    assert torch.equal(chunked[1], whole[1])
    joined = join_master(*chunked)
    kept = ~values.isnan()
    assert torch.equal(joined.view(torch.int32)[kept], values.view(torch.int32)[kept])
    monkeypatch.undo()
    large = torch.rand(32 << 20)  # 128 MiB
    with AnonPeak() as peak:
        before = peak.peak
        hi, lo = split_master(large)
        back = join_master(hi, lo)
    assert torch.equal(back, large)
    assert peak.peak - before < 128 * 2**20 + 128 * 2**20 + 400 * 2**20  # halves, the join's output, temporaries


def test_the_kernels_split_is_the_python_one_and_a_nan_master_stays_nan(variant):
    n = 4099
    p, grads = state(n, seed=2)
    p[7] = float("nan")
    hi, lo = split_master(p)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = p.clone()
    adam_step(ref, grads[0], m.clone(), v.clone(), 1, HYPER)
    adam_step(hi, grads[0], m, v, 1, HYPER, master_lo=lo)
    want_hi, want_lo = split_master(ref)
    assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16)) and torch.equal(lo, want_lo)
    assert join_master(hi, lo)[7].isnan() and hi[7].isnan()


def test_a_bf16_master_rounded_to_nearest_is_the_float32_step_rounded(variant):
    n = 100_003
    p, grads = state(n, seed=4)
    p = p.bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, 1):
        want_p, want_m, want_v = fp32_step(p, g, m, v, step)
        adam_step(p, g, m, v, step, HYPER)
        assert torch.equal(p, want_p.bfloat16()) and torch.equal(m, want_m.bfloat16())


def _decayed(p0: torch.Tensor, decay: float, stochastic: Stochastic | None, threads: int | None = None
             ) -> torch.Tensor:
    """A bf16 master after a step that only multiplies it by ``decay`` (no gradient, step size 0): the float32
    product is p0 x decay, rounded into the master to nearest (``stochastic`` None) or stochastically."""
    n = p0.numel()
    zeros = torch.zeros(n, dtype=torch.bfloat16)
    out = p0.clone()
    native.adam_kernel(out, torch.zeros(n), zeros.clone(), zeros.clone(), None, grad_scale=1.0, decay=decay, l2=0.0,
                       one_minus_beta1=0.1, beta2=0.999, one_minus_beta2=0.001, bc2_sqrt=1.0, eps=1e-8,
                       step_size=0.0, threads=threads, stochastic=stochastic)
    return out


def _neighbours(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of each float32: toward zero (truncated) and the next away from it."""
    bits = exact.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


def test_stochastic_rounding_depends_on_the_seed_and_the_element_not_the_threads(variant):
    n = 1 << 16
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(5)).bfloat16()
    decay = 1.0 + 2**-9 + 2**-13
    exact = p0.float() * torch.tensor(decay, dtype=torch.float32)
    runs = [_decayed(p0, decay, Stochastic(9), threads) for threads in (1, 2, 3)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    down, up = _neighbours(exact)
    got = runs[0].float()
    assert ((got == down) | (got == up)).all()
    assert 0 < (got == up).sum() < n
    assert not torch.equal(runs[0], _decayed(p0, decay, Stochastic(10)))
    # the same elements, given as a buffer that starts at stream index 100, round as they did in place
    assert torch.equal(_decayed(p0[100:], decay, Stochastic(9, index0=100)), runs[0][100:])


def test_stochastic_rounding_is_unbiased_and_nearest_is_not(variant):
    n = 1 << 16
    ones = torch.ones(n, dtype=torch.bfloat16)
    decay = 1.0 + 2**-10  # an eighth of a bf16 unit above 1.0
    up = (_decayed(ones, decay, Stochastic(1)).float() > 1.0).double().mean().item()
    assert abs(up - 0.125) < 5 * (0.125 * 0.875 / n) ** 0.5, up
    assert torch.equal(_decayed(ones, decay, None), ones)  # to nearest: the update is lost


def test_every_variant_rounds_stochastically_alike():
    n = 4099
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(8)).bfloat16()
    before = native.active_variant()
    results = {}
    try:
        for name in native.supported_variants():
            native.select_variant(name)
            results[name] = _decayed(p0, 1.0 + 2**-9 + 2**-13, Stochastic(3, index0=12345))
    finally:
        native.select_variant(before)
    first = next(iter(results.values()))
    for name, out in results.items():
        assert torch.equal(out, first), name


@pytest.mark.parametrize("g", [1e-20, 1e30])
def test_extreme_gradients_step_the_bf16_moment_formats_as_float32_does(variant, g):
    """1e-20: the second moment (1e-43) is below bfloat16's smallest subnormal and is held as zero where float32
    keeps a subnormal, yet eps dominates the denominator either way, so the update is float32's to the bit; 1e30:
    g^2 overflows float32's arithmetic in every format (as in torch's Adam) and the step is the same too."""
    n = 257
    p = torch.randn(n, generator=torch.Generator().manual_seed(9))
    grad = torch.full((n,), g)
    ref_p, ref_m, ref_v = p.clone(), torch.zeros(n), torch.zeros(n)
    hi, lo = split_master(p)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    p16 = p.clone()
    m16b, v16b = m16.clone(), v16.clone()
    for step in (1, 2, 3):
        want_p, want_m, want_v = fp32_step(p16, grad, m16, v16, step)
        adam_step(ref_p, grad, ref_m, ref_v, step, HYPER)
        adam_step(p16, grad, m16, v16, step, HYPER)
        adam_step(hi, grad, m16b, v16b, step, HYPER, master_lo=lo)
        assert torch.equal(m16, want_m.bfloat16()) and torch.equal(v16, want_v.bfloat16())
        assert torch.equal(p16, want_p)
        # the float32 format's weights, to the bit, three steps on
        assert torch.equal(p16, ref_p) and torch.equal(join_master(hi, lo), ref_p)
    assert ref_p.isfinite().all()
    if g == 1e30:
        assert ref_v.isinf().all() and v16.isinf().all()
    else:
        assert (ref_v > 0).all() and (v16 == 0).all()


def _moved_share(fmt: str, steps: int = 100) -> tuple[float, float]:
    """lr 1e-6 on weights near 1.0 (a bf16 unit there is 2**-7 = 0.0078: each update is far below it): the share
    of weights the steps moved and their mean displacement, in one format."""
    n = 1 << 14
    gen = torch.Generator().manual_seed(11)
    start = (1.0 + torch.rand(n, generator=gen) * 0.5).bfloat16().float()
    grads = [torch.randn(n, generator=gen).abs() + 0.1 for _ in range(steps)]  # one sign: the weights drift down
    hyper = AdamHyper(lr=1e-6, betas=(0.9, 0.95))
    moments = torch.float32 if fmt == "fp32" else torch.bfloat16
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    if fmt == "16+16":
        hi, lo = split_master(start.clone())
        for step, g in enumerate(grads, 1):
            adam_step(hi, g, m, v, step, hyper, master_lo=lo)
        final = join_master(hi, lo)
    elif fmt in ("fp32", "bf16 moments"):
        final = start.clone()
        for step, g in enumerate(grads, 1):
            adam_step(final, g, m, v, step, hyper)
    else:
        master = start.bfloat16()
        for step, g in enumerate(grads, 1):
            adam_step(master, g, m, v, step, hyper,
                      stochastic=Stochastic(step) if fmt == "bf16 stochastic" else None)
        final = master.float()
    return (final != start).double().mean().item(), (start - final).double().mean().item()


def test_small_updates_move_the_exact_masters_stall_to_nearest_and_move_stochastically_in_expectation(variant):
    shares = {fmt: _moved_share(fmt) for fmt in ("fp32", "bf16 moments", "16+16", "bf16 nearest", "bf16 stochastic")}
    moved, drift = shares["fp32"]
    assert moved == 1.0 and 0 < drift
    assert shares["bf16 moments"][0] == moved and shares["16+16"][0] == moved
    assert shares["bf16 nearest"] == (0.0, 0.0)  # the negative control: every update lost to rounding
    sr_moved, sr_drift = shares["bf16 stochastic"]
    assert 0 < sr_moved < 1 and abs(sr_drift - drift) < 0.1 * drift, (sr_drift, drift)


BAD = [
    (dict(master=torch.ones(8, dtype=torch.float16)), "param has dtype torch.float16; a master weight is float32"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)),
     r"exp_avg_sq has dtype torch.float32; the moments share one dtype \(torch.bfloat16\)"),
    (dict(master_lo=torch.zeros(8, dtype=torch.int16)), "param_lo and stochastic rounding go with a bfloat16 master"),
    (dict(master=torch.ones(8, dtype=torch.bfloat16), master_lo=torch.zeros(8, dtype=torch.int16),
          stochastic=Stochastic(1)), r"a 16\+16 master \(param_lo\) is exact"),
    (dict(master=torch.ones(8, dtype=torch.bfloat16), master_lo=torch.zeros(8)),
     "param_lo has dtype torch.float32; the low halves of a 16\\+16 master are 16-bit"),
    (dict(master=torch.ones(8, dtype=torch.bfloat16), out16=torch.zeros(8, dtype=torch.float16)),
     "a bfloat16 master's copy is bfloat16"),
]


@pytest.mark.parametrize("override, message", BAD)
def test_bad_state_buffers_are_clear_errors(override, message):
    args = dict(master=torch.ones(8), grad=torch.ones(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
                out16=None, master_lo=None, stochastic=None)
    args.update(override)
    with pytest.raises(native.NativeError, match=message):
        adam_step(args["master"], args["grad"], args["exp_avg"], args["exp_avg_sq"], 1, HYPER, out16=args["out16"],
                  master_lo=args["master_lo"], stochastic=args["stochastic"])


def _bits(n: int, dtype: torch.dtype, gen: torch.Generator, scale: float) -> torch.Tensor:
    """Random values with the awkward ones spread through: NaN, both infinities, both zeros, subnormals, float32
    values on a bf16 tie (low half 0x8000) and just either side of one."""
    x = torch.randn(n, generator=gen) * scale
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39], dtype=torch.float32)
    at = torch.randint(0, n, (n // 16,), generator=gen)
    x[at] = specials[torch.randint(0, len(specials), (len(at),), generator=gen)]
    bits = x.view(torch.int32)
    tie = torch.randint(0, n, (n // 16,), generator=gen)
    bits[tie] = (bits[tie] & ~0xFFFF) | torch.randint(0x7FFF, 0x8002, (len(tie),), generator=gen, dtype=torch.int32)
    return x.to(dtype)


COMBOS = [(master, moments, grad, out, into)
          for master in ("fp32", "16+16", "bf16 nearest", "bf16 stochastic")
          for moments in (torch.float32, torch.bfloat16)
          for grad in (torch.float32, torch.bfloat16, torch.float16)
          for out in (None, torch.bfloat16, torch.float16)
          for into in (False, True)
          if not (out is torch.float16 and master != "fp32")]


def _one_step(master, moments, grad_dtype, out_dtype, into, offset, adamw, threads):
    """One step of a format from fixed random state, at ``offset`` elements into its buffers (so the vector passes
    start unaligned and end in a tail); what every buffer it wrote holds after."""
    n = 1000
    gen = torch.Generator().manual_seed(21)
    p = _bits(n + offset, torch.float32, gen, 1.0)[offset:]
    g = _bits(n + offset, grad_dtype, gen, 1e-2)[offset:]
    m = _bits(n + offset, moments, gen, 1e-2)[offset:]
    v = (_bits(n + offset, moments, gen, 1e-2).abs())[offset:]
    lo = None
    if master == "16+16":
        hi, lo = split_master(p)
        p = hi
    elif master != "fp32":
        p = p.bfloat16()
    state = [p, m, v] + ([lo] if lo is not None else [])
    out = torch.empty(n + offset, dtype=out_dtype)[offset:] if out_dtype is not None else None
    targets = [torch.full((t.numel() + offset,), 7, dtype=t.dtype)[offset:] for t in state] if into else None
    hyper = AdamHyper(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=adamw)
    adam_step(p, g, m, v, 3, hyper, grad_scale=0.75, pre_scale=0.5, out16=out, threads=threads, master_lo=lo,
              into=tuple(targets) if targets else None,
              stochastic=Stochastic(77, index0=5) if master == "bf16 stochastic" else None)
    written = (targets if into else state) + ([out] if out is not None else [])
    return [t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) for t in written]


def _combo_id(combo) -> str:
    master, moments, grad, out, into = combo
    name = lambda d: "none" if d is None else str(d).replace("torch.", "")  # noqa: E731
    return f"{master}-m_{name(moments)}-g_{name(grad)}-out_{name(out)}-{'elsewhere' if into else 'in_place'}"


@pytest.mark.parametrize("master, moments, grad, out, into", COMBOS, ids=[_combo_id(c) for c in COMBOS])
def test_every_variant_steps_every_format_as_the_portable_one_bit_for_bit(master, moments, grad, out, into):
    """Each format, gradient dtype, copy and in-place or elsewhere step, on every variant this CPU runs, against the
    portable build: element-wise arithmetic, so the vector width must not move a bit, NaN and subnormals included
    (the run's summary names the variants this CPU could not reach)."""
    before = native.active_variant()
    try:
        for offset, adamw, threads in ((0, True, 1), (3, False, 2)):
            native.select_variant("portable")
            want = _one_step(master, moments, grad, out, into, offset, adamw, threads)
            for name in native.supported_variants():
                native.select_variant(name)
                got = _one_step(master, moments, grad, out, into, offset, adamw, threads)
                for i, (a, b) in enumerate(zip(got, want, strict=True)):
                    assert torch.equal(a, b), (name, offset, i, (a != b).nonzero()[:5].flatten().tolist())
    finally:
        native.select_variant(before)
