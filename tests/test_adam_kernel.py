"""The fused Adam step against torch.optim.Adam/AdamW (foreach=False), element-wise, on every variant."""

import math

import pytest
import torch
from torch.testing import assert_close

from offload.machine import native
from offload.optim import AdamHyper, adam_step

# torch's CPU sqrt is not correctly rounded (ours is), so a denominator may differ by an ulp;
# that is the whole difference, and it stays at fp32 rounding over many steps.
RTOL, ATOL = 1e-6, 1e-6

HYPERS = {
    "adamw": AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    "adamw_gpt": AdamHyper(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    "adam_l2": AdamHyper(lr=1e-3, weight_decay=0.05, adamw_mode=False),
    "no_decay": AdamHyper(lr=1e-2),
    "tiny_lr": AdamHyper(lr=1e-9, weight_decay=0.01),
    "huge_lr": AdamHyper(lr=10.0, betas=(0.5, 0.9), eps=1e-6),
}


def torch_reference(p0: torch.Tensor, grads: list[torch.Tensor], hyper: AdamHyper, scale: float = 1.0):
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if hyper.adamw_mode else torch.optim.Adam
    opt = cls([ref], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, foreach=False)
    for g in grads:
        ref.grad = g.float() * scale
        opt.step()
    state = opt.state[ref]
    return ref.detach(), state["exp_avg"], state["exp_avg_sq"]


def manual_reference(p0, grads, hyper: AdamHyper):
    """Adam without bias correction (torch's optimizers have no switch for it), in torch ops."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    b1, b2 = hyper.betas
    for g in grads:
        g = g.float()
        if hyper.adamw_mode:
            p.mul_(1 - hyper.lr * hyper.weight_decay)
        else:
            g = g.add(p, alpha=hyper.weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m, v.sqrt().add_(hyper.eps), value=-hyper.lr)
    return p, m, v


def run_ours(p0, grads, hyper, steps_from=1, scale=1.0, threads=None, view_offset=0):
    n = p0.numel()
    backing = [torch.zeros(n + view_offset) for _ in range(3)]
    p, m, v = (b[view_offset:] for b in backing)
    p.copy_(p0)
    for i, g in enumerate(grads):
        adam_step(p, g, m, v, steps_from + i, hyper, grad_scale=scale, threads=threads)
    return p, m, v


def make(n, steps=50, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for _ in range(steps)]
    return p0, grads


@pytest.mark.parametrize("name", list(HYPERS))
@pytest.mark.parametrize("n", [1, 7, 1023, 2**20 + 3])
def test_matches_torch_over_50_steps(variant, name, n):
    steps = 50 if n < 2**20 else 20
    p0, grads = make(n, steps)
    ours = run_ours(p0, grads, HYPERS[name])
    # With lr 10 every step moves a param by ~10, so one-ulp denominators compound over 50 steps.
    rtol, atol = (RTOL * 10, ATOL * 20) if name == "huge_lr" else (RTOL, ATOL)
    for got, want, what in zip(ours, torch_reference(p0, grads, HYPERS[name]), ("param", "exp_avg", "exp_avg_sq")):
        assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_without_bias_correction(variant, adamw_mode):
    hyper = AdamHyper(lr=1e-3, weight_decay=0.02, adamw_mode=adamw_mode, bias_correction=False)
    p0, grads = make(4099)
    for got, want in zip(run_ours(p0, grads, hyper), manual_reference(p0, grads, hyper)):
        assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("offset", [1, 3, 5, 13])
def test_views_at_unaligned_offsets(variant, offset):
    p0, grads = make(10_007, steps=10)
    ours = run_ours(p0, grads, HYPERS["adamw"], view_offset=offset)
    assert ours[0].data_ptr() % 32 != 0
    for got, want in zip(ours, torch_reference(p0, grads, HYPERS["adamw"])):
        assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradients_are_converted_in_the_kernel(variant, dtype):
    p0, grads = make(70_001, steps=10, dtype=dtype)
    for got, want in zip(run_ours(p0, grads, HYPERS["adamw_gpt"]), torch_reference(p0, grads, HYPERS["adamw_gpt"])):
        assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_grad_scale_is_unscale_and_clip_in_one_factor(variant):
    p0, grads = make(5000, steps=10)
    scale = 1 / 1024 * 0.37
    scaled = [g * 1024 for g in grads]
    ours = run_ours(p0, scaled, HYPERS["adamw"], scale=scale)
    for got, want in zip(ours, torch_reference(p0, scaled, HYPERS["adamw"], scale=scale)):
        assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_identical_for_any_thread_count(variant):
    p0, grads = make(3 * 2**18 + 11, steps=3)
    results = [run_ours(p0, grads, HYPERS["adamw"], threads=t) for t in (1, 2, 7)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_identical_on_torchs_openmp_team_and_on_the_pool():
    """The main thread runs kernels on torch's OpenMP team (see native/pool.h); other threads, and the main thread
    with OFFLOAD_THREADS=pool, on offload's pool. Same split, same results."""
    import threading

    from offload.machine import native
    p0, grads = make(3 * 2**18 + 11, steps=3)
    assert native.threads_backend() == ("openmp" if native.openmp_runtime() else "pool")
    on_team = run_ours(p0, grads, HYPERS["adamw"], threads=7)  # more than torch's threads: the team may grow
    elsewhere: dict[str, object] = {}

    def other_thread() -> None:
        elsewhere["backend"] = native.threads_backend()
        elsewhere["result"] = run_ours(p0, grads, HYPERS["adamw"], threads=2)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert elsewhere["backend"] == "pool"
    try:
        assert native.use_threads("pool") == "pool"
        on_pool = run_ours(p0, grads, HYPERS["adamw"], threads=2)
    finally:
        native.use_threads("openmp")
    for a, b, c in zip(on_team, elsewhere["result"], on_pool):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(native.NativeError, match="openmp or pool"):
        native.use_threads("tbb")


def test_two_host_threads_kernels_run_side_by_side_with_the_results_of_running_alone():
    """A gradient's landing norm on one host thread no longer waits for a whole Adam call on another (the delayed
    update's): two pools run two calls at once ([Note: two pools] in native/pool.cpp), each split as before."""
    import threading

    n = 1 << 22
    p0, grads = make(n, steps=6)
    alone_adam = run_ours(p0, grads, HYPERS["adamw"], threads=2)
    alone_norm = native.grad_sq_norm(grads[0], threads=2)
    native.pool_jobs_at_once()  # from here on
    results: dict[str, object] = {"norms": []}
    adam_done = threading.Event()

    def adam_thread() -> None:
        try:
            results["adam"] = run_ours(p0, grads, HYPERS["adamw"], threads=2)
        finally:
            adam_done.set()

    def norm_thread() -> None:
        while not adam_done.is_set():
            results["norms"].append(native.grad_sq_norm(grads[0], threads=2))

    threads = [threading.Thread(target=adam_thread), threading.Thread(target=norm_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert native.pool_jobs_at_once() == 2  # one pool: 1, each call waiting for the other
    assert all(torch.equal(a, b) for a, b in zip(alone_adam, results["adam"]))
    assert results["norms"] and all(r == alone_norm for r in results["norms"])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100_003])
@pytest.mark.parametrize("offset", [0, 1])  # aligned: streamed; one element on: stored (see [Note: streaming stores])
def test_fused_16bit_copy_equals_to_dtype_exactly(variant, out_dtype, n, offset):
    p0, grads = make(n, steps=3)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n + 16, dtype=out_dtype)[offset:offset + n]
    for s, g in enumerate(grads, 1):
        adam_step(p, g, m, v, s, HYPERS["adamw"], out16=out)
        assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_copy_rounding_edge_cases(variant, out_dtype):
    """Ties, subnormals, overflow to inf, signed zeros: the copy of any fp32 value equals torch's."""
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e-8, 6e-8, 5.96e-8, 2.98e-8, 3e-45, 1e38,
                            -1e38, float("inf"), float("-inf"), 1.00390625, 1.01171875])
    values = torch.cat([bits.view(torch.float32), special])
    values = values[torch.isfinite(values) | torch.isinf(values)]  # NaN payloads may differ; checked below
    n = values.numel()
    # lr = 0 and zero grads: the step leaves params unchanged, so the copy is of `values` itself.
    p, m, v = values.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    adam_step(p, torch.zeros(n), m, v, 1, AdamHyper(lr=0.0), out16=out)
    assert torch.equal(p, values)
    assert torch.equal(out.view(torch.int16), values.to(out_dtype).view(torch.int16))
    nan = torch.full((33,), float("nan"))
    out = torch.empty(33, dtype=out_dtype)
    adam_step(nan.clone(), torch.zeros(33), torch.zeros(33), torch.zeros(33), 1, AdamHyper(lr=0.0), out16=out)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("n", [1, 17, 100_003])
@pytest.mark.parametrize("grad_dtype, out_dtype, hyper", [(torch.float32, None, "adamw"),
                                                          (torch.bfloat16, torch.bfloat16, "adam_l2"),
                                                          (torch.float16, torch.float16, "adamw_gpt")])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (3, 3, 3), (1, 2, 5)])
def test_a_step_written_elsewhere_is_the_step_in_place_bitwise_and_leaves_its_inputs(variant, n, grad_dtype,
                                                                                    out_dtype, hyper, offsets):
    """The speculative step's kernel: the same values as stepping in place, the old state untouched; its outputs
    aligned (streamed), misaligned alike (the first elements one by one, then streamed) or each its own way (not
    streamed): see [Note: streaming stores] in native/kernels.cpp."""
    p0, grads = make(n, steps=3, dtype=grad_dtype)
    inplace = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    src = [t.clone() for t in inplace]
    out_a = torch.empty(n, dtype=out_dtype) if out_dtype else None
    out_b = torch.empty(n, dtype=out_dtype) if out_dtype else None
    for step, g in enumerate(grads, 1):
        adam_step(*inplace[:1], g, *inplace[1:], step, HYPERS[hyper], grad_scale=0.5, out16=out_a, pre_scale=0.25)
        before = [t.clone() for t in src]
        dst = [torch.full((n + 8,), float("nan"))[o:o + n] for o in offsets]
        adam_step(src[0], g, src[1], src[2], step, HYPERS[hyper], grad_scale=0.5, out16=out_b, pre_scale=0.25,
                  into=(dst[0], dst[1], dst[2]))
        for old, now in zip(before, src):
            assert torch.equal(old, now)
        for a, b in zip(inplace, dst):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        if out_dtype:
            assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
        src = dst


def test_a_step_written_elsewhere_refuses_overlapping_or_partial_targets():
    n = 8
    p, g, m, v = torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    with pytest.raises(native.NativeError, match="exp_avg_out overlaps exp_avg"):
        adam_step(p, g, m, v, 1, AdamHyper(), into=(torch.zeros(n), m, v.clone()))
    backing = torch.zeros(2 * n)
    with pytest.raises(native.NativeError, match="param_out overlaps param"):
        adam_step(backing[:n], g, m, v, 1, AdamHyper(), into=(backing[n // 2:n // 2 + n], m.clone(), v.clone()))
    with pytest.raises(native.NativeError, match="exp_avg_sq_out has 9 elements but param has 8"):
        adam_step(p, g, m, v, 1, AdamHyper(), into=(p.clone(), m.clone(), torch.zeros(n + 1)))
    with pytest.raises(native.NativeError, match="param_out has dtype torch.bfloat16"):
        adam_step(p, g, m, v, 1, AdamHyper(), into=(p.to(torch.bfloat16), m.clone(), v.clone()))


BAD = [
    (lambda n: dict(master=torch.ones(n, n)[:, 0]), "param is not contiguous"),
    (lambda n: dict(master=torch.ones(n, dtype=torch.float64)), "param has dtype torch.float64"),
    (lambda n: dict(exp_avg=torch.ones(n, dtype=torch.float16)), "exp_avg has dtype torch.float16; Adam's moments"),
    (lambda n: dict(exp_avg=torch.ones(n, dtype=torch.bfloat16)), "exp_avg_sq has dtype torch.float32; the moments "
                                                                   "share one dtype"),
    (lambda n: dict(grad=torch.ones(n + 1)), "grad has 9 elements but param has 8"),
    (lambda n: dict(exp_avg_sq=torch.ones(n - 1)), "exp_avg_sq has 7 elements but param has 8"),
    (lambda n: dict(out16=torch.ones(n)), "out16 has dtype torch.float32"),
    (lambda n: dict(out16=torch.ones(n + 2, dtype=torch.bfloat16)), "out16 has 10 elements but param has 8"),
    (lambda n: dict(grad=torch.ones(n, dtype=torch.int64)), "grad has dtype torch.int64"),
    (lambda n: dict(grad=torch.ones(n, device="meta")), "grad is on meta"),
]


@pytest.mark.parametrize("override, message", BAD)
def test_bad_buffers_are_clear_errors(override, message):
    n = 8
    args = dict(master=torch.ones(n), grad=torch.ones(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                out16=None)
    args.update(override(n))
    with pytest.raises(native.NativeError, match=message):
        adam_step(args["master"], args["grad"], args["exp_avg"], args["exp_avg_sq"], 1, AdamHyper(),
                  out16=args["out16"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensor_is_a_clear_error():
    n = 8
    with pytest.raises(native.NativeError, match="is on cuda"):
        adam_step(torch.ones(n), torch.ones(n, device="cuda"), torch.zeros(n), torch.zeros(n), 1, AdamHyper())


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "invalid Adam lr"), (dict(eps=0.0), "invalid Adam eps"),
    (dict(betas=(1.0, 0.9)), r"invalid Adam betas\[0\]"), (dict(weight_decay=math.inf), "invalid Adam weight_decay"),
])
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamHyper(**kwargs)


def test_bad_step_number():
    with pytest.raises(ValueError, match="step must be a whole number >= 1"):
        adam_step(torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), 0, AdamHyper())
