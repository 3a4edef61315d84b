"""The squared-norm kernel against a float64 PyTorch reference, on every variant this CPU runs."""

import math

import pytest
import torch

from offload.machine import native


def reference(x: torch.Tensor) -> tuple[float, int]:
    x64 = x.double()
    return float((x64 * x64).sum()), int((~torch.isfinite(x)).sum())


SIZES = [0, 1, 7, 15, 16, 17, 33, 1000, 65536 + 3, 1 << 20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_matches_float64_reference(variant, dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    got = native.grad_sq_norm(x, threads=2)
    want, bad = reference(x)
    assert got.nonfinite == bad == 0
    assert got.sum_sq == pytest.approx(want, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_thread_count_does_not_change_the_result_beyond_rounding(variant, threads):
    x = torch.randn(3 * (1 << 18) + 5)
    want, _ = reference(x)
    assert native.grad_sq_norm(x, threads=threads).sum_sq == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_counts_every_nan_and_inf(variant, dtype):
    x = torch.randn(100_003).to(dtype)
    idx = torch.tensor([0, 5, 16, 31, 4097, 100_002])
    x[idx[:3]] = float("nan")
    x[idx[3:5]] = float("inf")
    x[idx[5]] = float("-inf")
    got = native.grad_sq_norm(x, threads=2)
    assert got.nonfinite == 6
    assert math.isnan(got.sum_sq)


def test_float16_subnormals_and_extremes_are_exact(variant):
    # Every finite fp16 value, including subnormals and ±65504.
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16)
    finite = x[torch.isfinite(x)]
    want, _ = reference(finite)
    got = native.grad_sq_norm(finite.contiguous())
    assert got.nonfinite == 0
    assert got.sum_sq == pytest.approx(want, rel=1e-13)
    assert native.grad_sq_norm(x.contiguous()).nonfinite == int((~torch.isfinite(x)).sum()) == 2 * 1024 - 2 + 2


def test_large_fp32_values_do_not_overflow_the_accumulator(variant):
    x = torch.full((1000,), 1e30)
    assert native.grad_sq_norm(x).sum_sq == pytest.approx(1e63, rel=1e-6)
    assert native.grad_sq_norm(x).nonfinite == 0


def test_reads_a_view_of_a_larger_buffer_at_an_offset(variant):
    flat = torch.randn(10_000)
    view = flat[3:9_003]  # unaligned start, contiguous
    want, _ = reference(view)
    assert native.grad_sq_norm(view).sum_sq == pytest.approx(want, rel=1e-12)


def test_multidimensional_contiguous_tensor(variant):
    x = torch.randn(64, 33)
    want, _ = reference(x)
    assert native.grad_sq_norm(x).sum_sq == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("bad, message", [
    (torch.ones(4, 4).t(), "not contiguous"),
    (torch.ones(4, dtype=torch.float64), "dtype torch.float64"),
    (torch.ones(4, dtype=torch.int32), "dtype torch.int32"),
    ([1.0, 2.0], "must be a torch.Tensor"),
])
def test_bad_buffers_are_clear_errors(bad, message):
    with pytest.raises(native.NativeError, match=message):
        native.grad_sq_norm(bad)


def test_bad_thread_count():
    with pytest.raises(native.NativeError, match="threads must be >= 1"):
        native.grad_sq_norm(torch.ones(4), threads=0)


def test_native_layer_rejects_what_the_wrapper_would(variant):
    """The binding checks too, so a caller that skips the wrapper cannot make it read memory wrongly."""
    import offload._native as _native
    with pytest.raises(ValueError, match="contiguous"):
        _native.sq_norm(torch.ones(8, 8).t(), 1)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        _native.sq_norm(torch.ones(8, dtype=torch.float64), 1)


def test_grad_requiring_tensor_is_read_without_copy():
    p = torch.nn.Parameter(torch.ones(10))
    assert native.grad_sq_norm(p).sum_sq == 10.0


def test_bandwidth_probes_compute_what_they_say(variant):
    a, b = torch.randn(100_003), torch.randn(100_003)
    want = a + 0.25 * b
    native.axpy_(a, b, 0.25, threads=2)
    assert_close_exact = torch.testing.assert_close
    assert_close_exact(a, want, rtol=1e-6, atol=1e-6)
    p, m, v, g = (torch.randn(70_001) for _ in range(4))
    expect = [t + g for t in (p, m, v)]
    native.touch3_(p, m, v, g, threads=2)
    for got, want in zip((p, m, v), expect):
        assert torch.equal(got, want)
    with pytest.raises(native.NativeError, match="one length"):
        native.touch3_(p, m, v, torch.randn(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accumulate_adds_or_overwrites_any_gradient_dtype(variant, dtype):
    acc, grad = torch.randn(100_003), torch.randn(100_003).to(dtype)
    want = acc + 0.25 * grad.float()
    native.accumulate_(acc, grad, 0.25, overwrite=False, threads=2)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)
    native.accumulate_(acc, grad, 0.5, overwrite=True, threads=3)
    assert torch.equal(acc, grad.float() * 0.5)  # one rounding, as torch's copy_ then mul_
    with pytest.raises(native.NativeError, match="acc must be float32"):
        native.accumulate_(acc.bfloat16(), grad, 1.0, overwrite=True)
    with pytest.raises(native.NativeError, match="elements"):
        native.accumulate_(acc[:5], grad, 1.0, overwrite=True)
