"""The conversion instructions the kernel variants lean on, modelled in scalar code ([Note: instruction rules] in
native/scalar.h): each model with its fix-up is the portable rounding on every CPU, so a machine that cannot run a
variant still checks what that variant must store; each instruction is its model, and each variant's stores are the
portable rounding, on the CPUs that run them."""

import pytest
import torch

from offload.machine import native

# Every high half, each with the low halves that decide a rounding (bf16 drops 16 bits, a normal float16 13, a
# subnormal float16 more: those sit in the high half, which is enumerated), and a few random ones.
DECIDING_LOWS = [0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xefff,
                 0xf000, 0xffff]


def sample() -> torch.Tensor:
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    gen = torch.Generator().manual_seed(7)
    lows = torch.cat([torch.tensor(DECIDING_LOWS), torch.randint(0, 1 << 16, (12,), generator=gen)])
    bits = (high[:, None] | lows[None, :]).flatten()
    return bits.to(torch.int32).view(torch.float32)  # two's-complement wrap keeps the bits


X = sample()
BITS = X.view(torch.int32)
EXPONENT = (BITS >> 23) & 0xFF
NAN = X.isnan()


def u16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32) & 0xFFFF


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (u16(got) != u16(want)).nonzero().flatten()
    if bad.numel() == 0:
        return ""
    i = int(bad[0])
    return (f"{bad.numel()} of {got.numel()} differ; first x bits {int(BITS[i]) & 0xFFFFFFFF:#010x}: "
            f"{int(u16(got)[i]):#06x}, want {int(u16(want)[i]):#06x}")


# --------------------------------------------------------------------------- the models, on every CPU

@pytest.mark.parametrize("rule,portable", [("vcvtneps2bf16", "bfloat16"), ("vcvtps2ph", "float16")])
def test_each_instruction_with_its_fix_up_is_the_portable_rounding(rule, portable):
    assert first_difference(native.model16(X, rule + "+fix"), native.model16(X, portable)) == ""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_portable_rounding_is_torchs_with_one_quiet_nan(dtype):
    """torch's own scalar conversion (round to nearest even); every NaN the quiet one, bf16's unsigned (0x7fc0) and
    float16's with its sign (0x7e00), as c10's scalar conversions give them."""
    ours = u16(native.model16(X, "bfloat16" if dtype == torch.bfloat16 else "float16"))
    torchs = u16(X[~NAN].to(dtype).view(torch.int16))
    assert torch.equal(ours[~NAN], torchs)
    if dtype == torch.bfloat16:
        assert (ours[NAN] == 0x7FC0).all()
    else:
        assert torch.equal(ours[NAN], 0x7E00 | ((BITS[NAN] >> 16) & 0x8000))


def test_the_vcvtneps2bf16_model_keeps_intels_rules():
    """Intel's pseudocode for VCVTNEPS2BF16: a zero or subnormal input is a signed zero, a NaN keeps its sign and
    payload with the quiet bit set, Inf stays Inf, the rest round to nearest even (overflowing to Inf)."""
    got = u16(native.model16(X, "vcvtneps2bf16"))
    sign = (BITS >> 16) & 0x8000
    tiny = EXPONENT == 0
    assert torch.equal(got[tiny], sign[tiny])
    assert torch.equal(got[NAN], ((BITS[NAN] >> 16) & 0xFFFF) | 0x40)
    normal = ~tiny & ~NAN
    assert torch.equal(got[normal], u16(X[normal].to(torch.bfloat16).view(torch.int16)))
    assert int(u16(native.model16(torch.tensor([3.4028235e38]), "vcvtneps2bf16"))[0]) == 0x7F80
    # where the instruction and the portable rounding differ: subnormals and NaNs, nowhere else
    differs = u16(native.model16(X, "vcvtneps2bf16")) != u16(native.model16(X, "bfloat16"))
    assert differs.any() and not (differs & ~(tiny | NAN)).any()


def test_the_vcvtps2ph_model_keeps_the_ieee_rules():
    """F16C's VCVTPS2PH (round to nearest) and AArch64's FCVTN: IEEE rounding, subnormal results kept, a NaN
    quieted with its sign and the top ten bits of its payload."""
    got = u16(native.model16(X, "vcvtps2ph"))
    torchs = u16(X[~NAN].to(torch.float16).view(torch.int16))
    assert torch.equal(got[~NAN], torchs)
    payload = (BITS[NAN] >> 13) & 0x3FF
    assert torch.equal(got[NAN], ((BITS[NAN] >> 16) & 0x8000) | 0x7E00 | payload)
    assert int(u16(native.model16(torch.tensor([6e-8]), "vcvtps2ph"))[0]) == 0x0001  # the smallest subnormal


def test_a_model_that_does_not_exist_is_named():
    with pytest.raises(native.NativeError, match="no scalar model 'vcvt'; models: bfloat16"):
        native.model16(X[:4], "vcvt")


# --------------------------------------------------------------------------- the hardware, where it runs

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_variant_stores_the_portable_rounding(variant, dtype):
    """Every 16-bit store a variant's kernels make (fix-ups included, the vector body and the scalar tail)."""
    portable = native.model16(X, "bfloat16" if dtype == torch.bfloat16 else "float16")
    for n in (X.numel(), X.numel() - 5):  # a tail the vector width does not divide
        assert first_difference(native.to16(X[:n].contiguous(), dtype), portable[:n]) == "", (variant, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_instruction_a_variant_leans_on_is_its_model(variant, dtype):
    name = native.instruction_name(dtype)
    if name is None:
        with pytest.raises(native.NativeError, match=f"kernel variant '{variant}' stores .* through no conversion"):
            native.to16(X[:8], dtype, instruction=True)
        return
    assert first_difference(native.to16(X, dtype, instruction=True), native.model16(X, name)) == "", (variant, name)


def test_the_variants_instructions_are_the_ones_the_rules_name():
    """Which variant leans on which instruction: a variant that starts to use another must come with its model."""
    expected = {"portable": (None, None), "avx2": (None, "vcvtps2ph"), "avx512": (None, "vcvtps2ph"),
                "avx512bf16": ("vcvtneps2bf16", "vcvtps2ph"), "neon": (None, "vcvtps2ph")}
    before = native.active_variant()
    try:
        for name in native.supported_variants():
            native.select_variant(name)
            assert (native.instruction_name(torch.bfloat16), native.instruction_name(torch.float16)) == \
                expected[name], name
    finally:
        native.select_variant(before)
