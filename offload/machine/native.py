"""The native CPU kernels: which instruction-set variant runs, and typed entry points.

The extension is compiled by the package build (native/, CMakeLists.txt) once per
instruction set; the best variant this CPU runs is chosen on first use.
``OFFLOAD_ISA=portable|avx2|avx512|avx512bf16`` forces one (tests use it to cover each).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # torch's __all__ leaves it out

from offload.machine import cpus

try:
    from offload import _native  # type: ignore[attr-defined]  # the compiled extension (native/): no stubs
except ImportError as e:  # a source checkout imported without its build
    raise ImportError("offload's native extension (offload._native) is not built: install the package with "
                      "`pip install -e .` (or `./dev.sh test`), which compiles native/ with the C++ compiler; "
                      f"the import said: {e}") from e

ISA_ENV = "OFFLOAD_ISA"
THREADS_ENV = "OFFLOAD_THREADS"  # openmp (default where torch's runtime is found) or pool
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NativeError(ValueError):
    """A bad argument to a native kernel, or a kernel variant this machine cannot run."""


def compiled_variants() -> list[str]:
    """Kernel variants in this build, best last."""
    return list(_native.compiled_variants())


def supported_variants() -> list[str]:
    """Compiled variants whose instructions this CPU can execute, best last."""
    return list(_native.supported_variants())


def active_variant() -> str:
    return _native.active_variant()


def select_variant(name: str) -> None:
    """Run every kernel with variant ``name`` from now on (for tests and benchmarks)."""
    try:
        _native.select_variant(name)
    except ValueError as e:
        raise NativeError(str(e)) from None


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in (torch.bfloat16, torch.float16):
        raise NativeError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
    return "bfloat16" if dtype == torch.bfloat16 else "float16"


def to16(x: torch.Tensor, dtype: torch.dtype, *, instruction: bool = False) -> torch.Tensor:
    """The 16-bit values (as int16 bits) the active variant's kernels store for float32 ``x``, or, with
    ``instruction``, what the bare conversion instruction it leans on gives before its fix-ups."""
    x = _check_buffer(x, "x", (torch.float32,))
    out = torch.empty(x.shape, dtype=torch.int16)
    try:
        _native.to16(_dl(x), _dl(out), _dtype_name(dtype), instruction)
    except ValueError as e:
        raise NativeError(str(e)) from None
    return out


def instruction_name(dtype: torch.dtype) -> str | None:
    """The conversion instruction the active variant leans on for ``dtype`` (its scalar model's name), or None."""
    name = _native.instruction_name(_dtype_name(dtype))
    return None if name is None else str(name)


def model16(x: torch.Tensor, rule: str) -> torch.Tensor:
    """A scalar model's 16-bit values (as int16 bits) for float32 ``x``: the portable rounding to ``bfloat16`` or
    ``float16``, an instruction's own rules, or the instruction with the fix-ups the variants apply (``+fix``)."""
    x = _check_buffer(x, "x", (torch.float32,))
    out = torch.empty(x.shape, dtype=torch.int16)
    try:
        _native.model16(_dl(x), _dl(out), rule)
    except ValueError as e:
        raise NativeError(str(e)) from None
    return out


def default_threads() -> int:
    """Physical cores this process may use: the kernels are memory-bound, and hyper-threads add no bandwidth (see
    [Note: CPUs a process may use] in offload/machine/cpus.py)."""
    return cpus.default_threads()


class SqNorm(NamedTuple):
    sum_sq: float
    nonfinite: int

    @property
    def norm(self) -> float:
        return self.sum_sq ** 0.5


def _dl(t: torch.Tensor | None) -> object:
    """A checked buffer as the DLPack capsule the extension reads: torch's ``Tensor.__dlpack__``, which the binding
    would call otherwise, costs about 3 us of Python a tensor, more than a small shard's whole kernel."""
    return None if t is None else to_dlpack(t)


def _check_buffer(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...] | None = KERNEL_DTYPES) -> torch.Tensor:
    """A dense CPU tensor of one of ``dtypes`` (any dtype when None), detached for DLPack."""
    if not isinstance(t, torch.Tensor):
        raise NativeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise NativeError(f"{name} is on {t.device}; the CPU kernels read host memory, so copy it with .cpu() first")
    if dtypes is not None and t.dtype not in dtypes:
        raise NativeError(f"{name} has dtype {t.dtype}; the kernels take float32, bfloat16 or float16")
    if not t.is_contiguous():
        raise NativeError(f"{name} is not contiguous; pass .contiguous() (or a flat buffer)")
    return t.detach()


def grad_sq_norm(grad: torch.Tensor, threads: int | None = None, scale: float = 1.0) -> SqNorm:
    """Squared L2 norm (accumulated in float64) and the count of NaN/Inf elements, in one read; each element is
    multiplied by ``scale`` in float32 first, so a landed gradient's norm is bitwise its accumulation's."""
    grad = _check_buffer(grad, "grad")
    if grad.numel() == 0:
        return SqNorm(0.0, 0)
    n_threads = default_threads() if threads is None else int(threads)
    if n_threads < 1:
        raise NativeError(f"threads must be >= 1, got {threads}")
    sum_sq, nonfinite = _native.sq_norm(_dl(grad), n_threads, float(scale))
    return SqNorm(sum_sq, nonfinite)


MASTER_DTYPES = (torch.float32, torch.bfloat16)  # a master weight: float32, or bfloat16 (alone, or 16+16's high half)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _matched(checked: dict[str, torch.Tensor], n: int, threads: int | None) -> int:
    """The threads a pass runs on, once every buffer it was given holds ``n`` elements (``param``'s)."""
    for name, t in checked.items():
        if t.numel() != n:
            raise NativeError(f"{name} has {t.numel()} elements but param has {n}; the buffers must match")
    n_threads = default_threads() if threads is None else int(threads)
    if n_threads < 1:
        raise NativeError(f"threads must be >= 1, got {threads}")
    return n_threads


class Stochastic(NamedTuple):
    """A bfloat16 master rounded stochastically: the stream's seed, and the stream index of the buffer's first
    element (see [Note: state formats] in native/kernels.cpp)."""

    seed: int
    index0: int = 0


def adam_kernel(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                out16: torch.Tensor | None, *, grad_scale: float, decay: float, l2: float, one_minus_beta1: float,
                beta2: float, one_minus_beta2: float, bc2_sqrt: float, eps: float, step_size: float,
                threads: int | None = None, pre_scale: float = 1.0,
                into: tuple[torch.Tensor, ...] | None = None, param_lo: torch.Tensor | None = None,
                stochastic: Stochastic | None = None) -> None:
    """The fused Adam pass with its scalars precomputed (offload.optim.adam_step computes them); ``into``: where
    the new (param, exp_avg, exp_avg_sq[, param_lo]) go, leaving the inputs as they were (None: in place).

    The state's format follows its buffers (see [Note: state formats] in native/kernels.cpp): ``param`` float32, or
    bfloat16 (with ``param_lo``, the low halves of a 16+16 master; without, a bfloat16 master rounded to nearest
    even, or ``stochastic``ally); the moments both float32 or both bfloat16."""
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out16 is not None:
        tensors["out16"] = out16
    state = ("param", "exp_avg", "exp_avg_sq") + (("param_lo",) if param_lo is not None else ())
    if param_lo is not None:
        tensors["param_lo"] = param_lo
    if into is not None:
        if len(into) != len(state):
            raise NativeError(f"into holds {len(into)} buffers; a step written elsewhere gives one for each of "
                              f"{', '.join(state)}")
        tensors.update({f"{name}_out": t for name, t in zip(state, into, strict=True)})
    checked = {name: _check_buffer(t, name, None if name.startswith("param_lo") else KERNEL_DTYPES)
               for name, t in tensors.items()}
    if into is not None:
        for name in state:
            if _overlaps(checked[name], checked[f"{name}_out"]):
                raise NativeError(f"{name}_out overlaps {name}: a step written elsewhere needs its own buffers")
    master, moments = checked["param"].dtype, checked["exp_avg"].dtype
    if master not in MASTER_DTYPES:
        raise NativeError(f"param has dtype {master}; a master weight is float32 or bfloat16")
    if moments not in MOMENT_DTYPES:
        raise NativeError(f"exp_avg has dtype {moments}; Adam's moments are float32 or bfloat16")
    for name in state[1:] + tuple(f"{n}_out" for n in state if into is not None):
        got = checked[name].dtype
        if name.startswith("param_lo"):
            if got.itemsize != 2:
                raise NativeError(f"{name} has dtype {got}; the low halves of a 16+16 master are 16-bit")
        elif "exp_avg" in name and got != moments:
            raise NativeError(f"{name} has dtype {got}; the moments share one dtype ({moments})")
        elif "exp_avg" not in name and got != master:
            raise NativeError(f"{name} has dtype {got}; the new master is held as the old ({master})")
    if master == torch.float32 and (param_lo is not None or stochastic is not None):
        raise NativeError("param_lo and stochastic rounding go with a bfloat16 master, and param is float32")
    if param_lo is not None and stochastic is not None:
        raise NativeError("a 16+16 master (param_lo) is exact: it takes no stochastic rounding")
    if out16 is not None and checked["out16"].dtype == torch.float32:
        raise NativeError("out16 has dtype torch.float32; the copy is bfloat16 or float16")
    if out16 is not None and master != torch.float32 and checked["out16"].dtype != torch.bfloat16:
        raise NativeError(f"out16 has dtype {checked['out16'].dtype}; a bfloat16 master's copy is bfloat16 (its bits)")
    n_threads = _matched(checked, param.numel(), threads)
    seed, index0 = (int(stochastic.seed) & 0xFFFFFFFF, int(stochastic.index0)) if stochastic is not None else (0, 0)
    _native.adam(_dl(checked["param"]), _dl(checked["grad"]), _dl(checked["exp_avg"]), _dl(checked["exp_avg_sq"]),
                 _dl(checked.get("out16")), _dl(checked.get("param_out")), _dl(checked.get("exp_avg_out")),
                 _dl(checked.get("exp_avg_sq_out")), pre_scale,
                 grad_scale, decay, l2, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size, n_threads,
                 _dl(checked.get("param_lo")), _dl(checked.get("param_lo_out")), stochastic is not None, seed, index0,
                 -1 if _prefetch is None else _prefetch)


LION, ADAGRAD = 0, 1  # the one-state rules (OneStateRule in native/kernels.h)


def one_state_kernel(param: torch.Tensor, grad: torch.Tensor, state: torch.Tensor, out16: torch.Tensor | None, *,
                     rule: int, grad_scale: float = 1.0, decay: float = 1.0, l2: float = 0.0, lr: float,
                     beta1: float = 0.0, beta2: float = 0.0, eps: float = 0.0, threads: int | None = None,
                     param_lo: torch.Tensor | None = None, stochastic: Stochastic | None = None) -> None:
    """One Lion (``rule`` LION) or Adagrad (ADAGRAD) step in place over a master and its one state buffer (see
    [Note: one state] in native/kernels.cpp); scalars arrive as the caller computed them in double, each rounded to
    float32 once. The master is held as ``adam_kernel``'s (float32, 16+16 with ``param_lo``, bfloat16 to nearest or
    ``stochastic``ally), the state float32 or bfloat16."""
    tensors = {"param": param, "grad": grad, "state": state} | ({"out16": out16} if out16 is not None else {})
    if param_lo is not None:
        tensors["param_lo"] = param_lo
    checked = {name: _check_buffer(t, name, None if name == "param_lo" else KERNEL_DTYPES)
               for name, t in tensors.items()}
    master = checked["param"].dtype
    if master not in MASTER_DTYPES:
        raise NativeError(f"param has dtype {master}; a master weight is float32 or bfloat16")
    if checked["state"].dtype not in MOMENT_DTYPES:
        raise NativeError(f"state has dtype {checked['state'].dtype}; Lion's and Adagrad's state is float32 or "
                          "bfloat16")
    if param_lo is not None and checked["param_lo"].dtype.itemsize != 2:
        raise NativeError(f"param_lo has dtype {checked['param_lo'].dtype}; the low halves of a 16+16 master are "
                          "16-bit")
    if master == torch.float32 and (param_lo is not None or stochastic is not None):
        raise NativeError("param_lo and stochastic rounding go with a bfloat16 master, and param is float32")
    if param_lo is not None and stochastic is not None:
        raise NativeError("a 16+16 master (param_lo) is exact: it takes no stochastic rounding")
    if out16 is not None and checked["out16"].dtype == torch.float32:
        raise NativeError("out16 has dtype torch.float32; the copy is bfloat16 or float16")
    if out16 is not None and master != torch.float32 and checked["out16"].dtype != torch.bfloat16:
        raise NativeError(f"out16 has dtype {checked['out16'].dtype}; a bfloat16 master's copy is bfloat16 (its bits)")
    n_threads = _matched(checked, param.numel(), threads)
    seed, index0 = (int(stochastic.seed) & 0xFFFFFFFF, int(stochastic.index0)) if stochastic is not None else (0, 0)
    _native.one_state(_dl(checked["param"]), _dl(checked["grad"]), _dl(checked["state"]), _dl(checked.get("out16")),
                      rule, grad_scale, decay, l2, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, n_threads,
                      _dl(checked.get("param_lo")), stochastic is not None, seed, index0)


_prefetch: int | None = None  # elements ahead the Adam pass prefetches (None: the variant's build default)


def set_prefetch(ahead: int | None) -> None:
    """How far ahead (elements; 0: not at all; None: the kernel variant's default) every Adam pass of this process
    prefetches its read streams: a hint that changes no value, chosen per CPU by offload/machine/prefetch.py."""
    global _prefetch
    if ahead is not None and (not isinstance(ahead, int) or ahead < 0):
        raise NativeError(f"prefetch is a count of elements ahead, 0 or more (or None), not {ahead!r}")
    _prefetch = ahead


def prefetch_ahead() -> int | None:
    return _prefetch


@contextlib.contextmanager
def prefetching(ahead: int | None) -> Iterator[None]:
    """The Adam pass prefetches ``ahead`` (as ``set_prefetch``) inside, as it did before after: one contender of
    a measurement that compares them."""
    before = _prefetch
    set_prefetch(ahead)
    try:
        yield
    finally:
        set_prefetch(before)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dense buffers share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def axpy_(a: torch.Tensor, b: torch.Tensor, s: float, threads: int | None = None) -> torch.Tensor:
    """a += s * b in place (float32): the read-2-write-1 pattern whose speed bounds an in-place update."""
    a_, b_ = _check_buffer(a, "a"), _check_buffer(b, "b")
    if a_.dtype != torch.float32 or b_.dtype != torch.float32:
        raise NativeError("axpy_ takes float32 tensors")
    if a_.numel() != b_.numel():
        raise NativeError(f"a has {a_.numel()} elements but b has {b_.numel()}")
    _native.accumulate(_dl(a_), _dl(b_), float(s), False, default_threads() if threads is None else int(threads))
    return a


def accumulate_(acc: torch.Tensor, grad: torch.Tensor, scale: float, overwrite: bool,
                threads: int | None = None) -> torch.Tensor:
    """acc = scale * grad (``overwrite``) or acc += scale * grad, in place: a float32 accumulator and a gradient
    in float32, bfloat16 or float16 (converted in the kernel). On offload's threads, never torch's: see
    add_into in offload/optim/shard_state.py."""
    acc_, grad_ = _check_buffer(acc, "acc"), _check_buffer(grad, "grad")
    if acc_.dtype != torch.float32:
        raise NativeError(f"acc must be float32, got {acc_.dtype}")
    if acc_.numel() != grad_.numel():
        raise NativeError(f"acc has {acc_.numel()} elements but grad has {grad_.numel()}")
    _native.accumulate(_dl(acc_), _dl(grad_), float(scale), bool(overwrite),
                       default_threads() if threads is None else int(threads))
    return acc


def touch3_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, threads: int | None = None) -> None:
    """p += g, m += g, v += g in one pass: an Adam step's memory traffic with none of its arithmetic."""
    bufs = {name: _check_buffer(t, name) for name, t in (("p", p), ("m", m), ("v", v), ("g", g))}
    if any(t.dtype != torch.float32 or t.numel() != p.numel() for t in bufs.values()):
        raise NativeError("touch3_ takes four float32 tensors of one length")
    _native.touch3(_dl(bufs["p"]), _dl(bufs["m"]), _dl(bufs["v"]), _dl(bufs["g"]),
                   default_threads() if threads is None else int(threads))


def crc32c_blocks(data: torch.Tensor, block: int, threads: int | None = None) -> np.ndarray:
    """CRC-32C of each ``block``-byte piece of a dense CPU buffer (the last may be shorter), as uint32."""
    data = _check_buffer(data, "data", dtypes=None)
    if block <= 0:
        raise NativeError(f"block must be positive, got {block}")
    nbytes = data.numel() * data.element_size()
    out = np.zeros(max(1, -(-nbytes // block)), dtype=np.uint32)
    if nbytes:
        _native.crc32c_blocks(_dl(data.view(torch.uint8) if data.dtype != torch.uint8 else data), block, out,
                              default_threads() if threads is None else int(threads))
    return out[: -(-nbytes // block)]


def openmp_runtime() -> str | None:
    """The OpenMP runtime torch loaded into this process (libgomp or libiomp5), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp5")))
    in_torch = [p for p in found if os.sep + "torch" + os.sep in p]
    chosen = in_torch or found
    return chosen[0] if chosen else None


def use_threads(backend: str) -> str:
    """Where multi-threaded kernels called from this thread run: "openmp" (torch's own team, see [Note: torch's
    OpenMP team] in native/pool.h) or "pool" (offload's); returns what is in use (openmp falls back to pool when
    no runtime is found)."""
    if backend not in ("openmp", "pool"):
        raise NativeError(f"threads backend must be openmp or pool, got {backend!r}")
    path = openmp_runtime() if backend == "openmp" else None
    _native.use_openmp(path or "")
    return threads_backend()


def threads_backend() -> str:
    return _native.threads_backend()


def pool_jobs_at_once() -> int:
    """The most kernel calls offload's pools ran at once since the last call (two host threads' calls run side
    by side: see [Note: two pools] in native/pool.cpp)."""
    return int(_native.pool_jobs_at_once())


def _apply_env() -> None:
    forced = os.environ.get(ISA_ENV, "").strip()
    if forced:
        try:
            select_variant(forced)
        except NativeError as e:
            raise NativeError(f"{ISA_ENV}={forced}: {e}") from None
    use_threads(os.environ.get(THREADS_ENV, "").strip() or "openmp")


_apply_env()
