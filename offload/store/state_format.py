"""How the optimizer state is held: the master weights and the two moments, each in how many bytes.

The default is PyTorch's: a float32 master and float32 moments, 12 bytes an element, every step
the same values as torch's AdamW. The others hold fewer bytes with the arithmetic still float32
(see [Note: state formats] in native/kernels.cpp for what each stores and how it rounds):

| format | master | moments | state bytes | exact master |
|---|---|---|---|---|
| fp32 | float32 | float32 | 12 | yes |
| bf16 moments | float32 | bfloat16 | 8 | yes |
| 16+16 master, bf16 moments | high half (the weights) + low half | bfloat16 | 6 + the weights' 2 | yes |
| bf16 master, stochastic | bfloat16 | bfloat16 | 6 | in expectation |
| bf16 master (DeepSpeed's) | bfloat16, nearest | bfloat16 | 6 | no: small updates stall |

This room owns those facts (bytes, dtypes, the split of a float32 into its halves); the store sizes its
buffers by them and the optimizer hands the kernel the buffers they describe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Master(enum.Enum):
    FP32 = "fp32"
    SPLIT = "16+16"  # the float32 master as two 16-bit halves, the high one the bf16 weights
    BF16 = "bf16"  # rounded to nearest even (DeepSpeed's bf16_master_weights_and_grads)
    BF16_STOCHASTIC = "bf16-stochastic"


@dataclass(frozen=True, slots=True)
class StateFormat:
    """The master's format and the moments' dtype."""

    master: Master = Master.FP32
    moments: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.moments not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the moments are float32 or bfloat16, got {self.moments}")

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the master's buffer (16+16: of its high half)."""
        return torch.float32 if self.master is Master.FP32 else torch.bfloat16

    @property
    def master_bytes(self) -> int:
        """Bytes an element of master the optimizer state holds (16+16: both halves)."""
        return 2 if self.master in (Master.BF16, Master.BF16_STOCHASTIC) else 4

    @property
    def moment_bytes(self) -> int:
        return self.moments.itemsize

    @property
    def bytes_per_element(self) -> int:
        """Master and both moments."""
        return self.master_bytes + 2 * self.moment_bytes

    @property
    def exact_master(self) -> bool:
        """The master steps as float32 does, bit for bit."""
        return self.master in (Master.FP32, Master.SPLIT)

    @property
    def is_default(self) -> bool:
        return self.master is Master.FP32 and self.moments == torch.float32

    def describe(self) -> str:
        moments = "fp32" if self.moments == torch.float32 else "bf16"
        return f"master {self.master.value}, moments {moments} ({self.bytes_per_element} bytes an element)"


FP32 = StateFormat()

# The formats by the names the config, the benchmark and the docs give them.
FORMATS = {
    "fp32": FP32,
    "bf16 moments": StateFormat(Master.FP32, torch.bfloat16),
    "16+16 master": StateFormat(Master.SPLIT, torch.bfloat16),
    "bf16 master stochastic": StateFormat(Master.BF16_STOCHASTIC, torch.bfloat16),
    "bf16 master nearest": StateFormat(Master.BF16, torch.bfloat16),
}


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 master as its 16+16 halves: (high, bfloat16, rounded to nearest with ties away from zero; low,
    int16, the float's own low 16 bits), as the kernel stores them; a NaN becomes the quiet NaN with a zero low."""
    if master.dtype != torch.float32:
        raise ValueError(f"the master to split is float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits + 0x8000) >> 16) & 0xFFFF
    lo = bits & 0xFFFF
    nan = master.isnan()
    hi = torch.where(nan, torch.full_like(hi, 0x7FC0), hi)
    lo = torch.where(nan, torch.zeros_like(lo), lo)
    return _as16(hi).view(torch.bfloat16), _as16(lo)


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 master a 16+16 pair holds: high << 16 plus the low half sign-extended, bit for bit."""
    if hi.dtype.itemsize != 2 or lo.dtype.itemsize != 2:
        raise ValueError(f"the halves are 16-bit, got {hi.dtype} and {lo.dtype}")
    high = hi.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = lo.contiguous().view(torch.int16).to(torch.int64)  # sign-extended
    bits = ((high << 16) + low) & 0xFFFFFFFF
    return _as32(bits).view(torch.float32)


def _as16(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^16) as the int16 with those bits."""
    return torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16)


def _as32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 with those bits."""
    return torch.where(values >= 0x80000000, values - 0x100000000, values).to(torch.int32)
