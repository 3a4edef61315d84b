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

An update with fewer buffers than Adam's two moments holds only those (``StateFormat.held``): Lion its momentum
(exp_avg), Adagrad its sum of squares (exp_avg_sq, DeepSpeed's name for it), SGD with momentum its buffer, a torch
optimizer with none no moment at all; an fp32 Lion or Adagrad then holds 8 bytes an element, not 12. A buffer not
held is an empty view in each slot.

This room owns those facts (bytes, dtypes, the split of a float32 into its halves); the store sizes its
buffers by them and the optimizer hands the kernel the buffers they describe.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from offload.config import ConfigError

MOMENTS = ("exp_avg", "exp_avg_sq")  # the slot's moment buffers, in their order (Adam's first and second)


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
    # A 16+16 master whose high halves are the parameter store's own host shards (see [Note: the weights are the
    # high half] in offload/store/optimizer_state.py): the slot holds the low half and the moments only. The same
    # format (equal, the same bytes in a checkpoint), held in fewer bytes.
    high_elsewhere: bool = field(default=False, compare=False)
    held: tuple[str, ...] = MOMENTS  # the moment buffers the update keeps (see the module's docstring)

    def __post_init__(self) -> None:
        if self.moments not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the moments are float32 or bfloat16, got {self.moments}")
        if self.held != tuple(m for m in MOMENTS if m in self.held):
            raise ValueError(f"held names the moments {MOMENTS} in their order, got {self.held}")
        if self.high_elsewhere and self.master is not Master.SPLIT:
            raise ValueError(f"only a 16+16 master keeps its high half elsewhere, not {self.master.value}")

    def high_in_params(self) -> StateFormat:
        """This 16+16 format with its high halves held by the parameter store."""
        return replace(self, high_elsewhere=True)

    def high_in_state(self) -> StateFormat:
        """This format with every part held in the state's own memory (a lent high half taken back)."""
        return replace(self, high_elsewhere=False)

    def holding(self, held: tuple[str, ...]) -> StateFormat:
        """This format keeping only the moment buffers ``held`` (an update's own, offload/optim/hyper.py)."""
        return replace(self, held=held)

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the master's buffer (16+16: of its high half)."""
        return torch.float32 if self.master is Master.FP32 else torch.bfloat16

    @property
    def master_bytes(self) -> int:
        """Bytes an element of master the optimizer state holds (16+16: both halves, or the low one alone)."""
        return 2 if self.master in (Master.BF16, Master.BF16_STOCHASTIC) or self.high_elsewhere else 4

    @property
    def stepped_bytes(self) -> int:
        """Bytes of state an element the step reads and writes: a lent high half is the weights, stepped all the
        same (the pricing then counts the weights' write as well, 2 bytes over the kernel's 20 for 16+16)."""
        return self.bytes_per_element + (2 if self.high_elsewhere else 0)

    @property
    def moment_bytes(self) -> int:
        return self.moments.itemsize

    @property
    def bytes_per_element(self) -> int:
        """Master and the moments held."""
        return self.master_bytes + len(self.held) * self.moment_bytes

    @classmethod
    def named(cls, master: str, moments: str) -> StateFormat:
        """The format offload.optimizer_state's values name (master fp32|16+16|bf16|bf16-stochastic, moments
        fp32|bf16)."""
        return cls(Master(master), torch.bfloat16 if moments == "bf16" else torch.float32)

    def names(self) -> tuple[str, str]:
        """(master, moments) as offload.optimizer_state names them."""
        return self.master.value, "bf16" if self.moments == torch.bfloat16 else "fp32"

    @property
    def kinds(self) -> tuple[torch.dtype, ...]:
        """The dtype of each buffer a slot holds, in its order: master (16+16: its high half, then its low half),
        then the moments held (exp_avg, exp_avg_sq)."""
        moments = (self.moments,) * len(self.held)
        if self.master is Master.SPLIT:
            high = () if self.high_elsewhere else (torch.bfloat16,)
            return (*high, torch.int16, *moments)
        return (self.master_dtype, *moments)

    def slot_bytes(self, numel: int) -> int:
        """Bytes of one slot of ``numel`` elements: each kind after the last, starting where its element size
        divides the offset (all-fp32: the [3, numel] layout, no gaps)."""
        at = 0
        for dtype in self.kinds:
            at = _aligned(at, dtype.itemsize) + numel * dtype.itemsize
        return at

    def slot(self, memory: torch.Tensor, numel: int) -> StateSlot:
        """One slot's buffers as views of ``memory`` (bytes, at least ``slot_bytes``, 4-byte aligned)."""
        raw = memory.view(torch.uint8) if memory.dtype != torch.uint8 else memory
        views, at = [], 0
        for dtype in self.kinds:
            at = _aligned(at, dtype.itemsize)
            views.append(raw[at:at + numel * dtype.itemsize].view(dtype))
            at += numel * dtype.itemsize
        masters = 1 + (self.master is Master.SPLIT) - self.high_elsewhere
        held = iter(views[masters:])
        exp_avg, exp_avg_sq = (next(held) if m in self.held else raw[:0].view(self.moments) for m in MOMENTS)
        if self.high_elsewhere:  # the master's high halves are lent per unit (SubGroup.views)
            return StateSlot(raw[:0].view(torch.bfloat16), exp_avg, exp_avg_sq, views[0])
        if self.master is Master.SPLIT:
            return StateSlot(views[0], exp_avg, exp_avg_sq, views[1])
        return StateSlot(views[0], exp_avg, exp_avg_sq)

    def empty_slot(self, numel: int, device: torch.device | str) -> StateSlot:
        """A zeroed slot of its own on ``device``."""
        return self.slot(torch.zeros(self.slot_bytes(numel), dtype=torch.uint8, device=device), numel)

    def weights_of(self, master: torch.Tensor) -> torch.Tensor:
        """The 16-bit weights a float32 ``master`` gives in this format: a 16+16 master's high half (ties away from
        zero), else the master itself (the copy into the weights rounds it to nearest even)."""
        return split_master(master.float())[0] if self.master is Master.SPLIT else master

    def meta(self) -> dict[str, Any]:
        """How a checkpoint says this state is held (``held`` only where the update keeps fewer moments than Adam's
        two); ``from_meta`` reads it back."""
        held = {} if self.held == MOMENTS else {"held": list(self.held)}
        return {"master": self.master.value, "moments": str(self.moments).removeprefix("torch.")} | held

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> StateFormat:
        """The format a checkpoint's ``state_format`` names (``meta``'s inverse)."""
        return cls(Master(meta["master"]), getattr(torch, meta["moments"]), held=tuple(meta.get("held", MOMENTS)))

    def describe(self) -> str:
        master, moments = self.names()
        kept = (f"moments {moments}" if self.held == MOMENTS else f"{self.held[0]} {moments}" if self.held
                else "no moments")
        return f"master {master}, {kept} ({self.bytes_per_element} bytes an element)"


@dataclass(frozen=True, slots=True)
class StateSlot:
    """One slot of optimizer state over some elements: the master (16+16: its high half, ``master_lo`` its low
    half), exp_avg and exp_avg_sq, each a view of the slot's memory. Unpacks and indexes as (master, exp_avg,
    exp_avg_sq)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master_lo: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.master, self.exp_avg, self.exp_avg_sq))

    def __getitem__(self, kind: int) -> torch.Tensor:
        return (self.master, self.exp_avg, self.exp_avg_sq)[kind]

    def narrow(self, start: int, length: int) -> StateSlot:
        lo = self.master_lo
        return StateSlot(self.master[start:start + length], self.exp_avg[start:start + length],
                         self.exp_avg_sq[start:start + length], None if lo is None else lo[start:start + length])

    def start(self) -> torch.Tensor:
        """The buffer at the start of the slot's memory (a lent high half's empty view is none: its low half)."""
        return min((b for b in self.buffers() if b.numel()), key=torch.Tensor.data_ptr)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, the low half too."""
        return [self.master, self.exp_avg, self.exp_avg_sq] + ([self.master_lo] if self.master_lo is not None else [])

    def copy_(self, other: StateSlot, non_blocking: bool = False) -> None:
        """Every buffer from ``other`` (the same format); ``non_blocking`` as torch's, for a copy stream's copy
        between pinned host memory and the device."""
        for mine, theirs in zip(self.buffers(), other.buffers(), strict=True):
            mine.copy_(theirs, non_blocking=non_blocking)

    def zero_(self) -> None:
        for t in self.buffers():
            t.zero_()

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) as a checkpoint holds them: each as held, but a 16+16 master as the float32
        its halves are, bit for bit (the same bytes, and what every reader of a checkpoint takes)."""
        master = join_master(self.master, self.master_lo) if self.master_lo is not None else self.master
        return master, self.exp_avg, self.exp_avg_sq

    def master_fp32(self) -> torch.Tensor:
        """The master as float32 (a copy): the 16+16 one joined, a bf16 one widened."""
        if self.master_lo is not None:
            return join_master(self.master, self.master_lo)
        return self.master.float() if self.master.dtype != torch.float32 else self.master.clone()

    def set_master(self, values: torch.Tensor, stochastic_seed: int | None = None) -> None:
        """The master from ``values``, held as this slot holds it (16+16: split; bf16: to nearest, or with
        ``stochastic_seed`` stochastically from that stream)."""
        if self.master_lo is not None:
            hi, lo = split_master(values.float())
            self.master.copy_(hi)
            self.master_lo.copy_(lo)
        elif stochastic_seed is not None and self.master.dtype == torch.bfloat16:
            stochastic_round_(self.master, values, stochastic_seed)
        else:
            self.master.copy_(values)


def _aligned(at: int, size: int) -> int:
    return (at + size - 1) // size * size


FP32 = StateFormat()

def mix_seed(*parts: int) -> int:
    """A 32-bit seed from several integers (a rank's stream, a step, a unit): the stochastic rounding's streams."""
    x = 0x243F6A88
    for part in parts:
        x = (x ^ (part & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF
        x ^= x >> 15
        x ^= (part >> 32) & 0xFFFFFFFF
    return x


def stochastic_round_(out: torch.Tensor, values: torch.Tensor, seed: int) -> None:
    """``values`` (float32) into the bfloat16 ``out`` rounded stochastically, in torch's ops (on any device): what
    the native kernel does for a bf16 master, with random bits of torch's generator (another stream than the
    kernel's: a unit stepped on a GPU rounds alike in distribution, not bit for bit)."""
    gen = torch.Generator(device=values.device).manual_seed(seed)
    noise = torch.randint(0, 1 << 16, values.shape, generator=gen, device=values.device, dtype=torch.int32)
    bits = (values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + noise
    high = ((bits >> 16) & 0xFFFF).to(torch.int32)
    high = torch.where(values.isnan(), torch.full_like(high, 0x7FC0), high)
    out.copy_(torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16).view(torch.bfloat16))


def from_config(config: Any) -> StateFormat:
    """The run's format: offload.optimizer_state, or DeepSpeed's bf16 keys (the same formats by their names)."""
    ours, bf16 = config.offload.optimizer_state, config.bf16
    master = ours.master
    if bf16.bf16_master_weights_and_grads:
        if master == Master.BF16_STOCHASTIC.value:
            raise ConfigError("bf16.bf16_master_weights_and_grads",
                              "DeepSpeed's bf16 master rounds to nearest, and offload.optimizer_state.master asks "
                              "for bf16-stochastic: keep one of them (the stochastic one keeps small updates)")
        master = Master.BF16.value
    fmt = StateFormat.named(master, "bf16" if bf16.bf16_optimizer_states else ours.moments)
    if fmt.master is not Master.FP32 and config.bf16.enabled is not True:
        key = ("bf16.bf16_master_weights_and_grads" if bf16.bf16_master_weights_and_grads
               else "offload.optimizer_state.master")
        raise ConfigError(key, f"a 16-bit master ({master}) trains bf16 weights: set bf16.enabled true, or keep "
                               "the master in fp32 (moments in bf16 need no bf16 compute)")
    return fmt


# The formats by the names the config, the benchmark and the docs give them.
FORMATS = {
    "fp32": FP32,
    "bf16 moments": StateFormat(Master.FP32, torch.bfloat16),
    "16+16 master": StateFormat(Master.SPLIT, torch.bfloat16),
    "bf16 master stochastic": StateFormat(Master.BF16_STOCHASTIC, torch.bfloat16),
    "bf16 master nearest": StateFormat(Master.BF16, torch.bfloat16),
}


# Elements a split or a join converts at once: its int64 temporaries (about 50 bytes an element) stay near 200 MB
# however large the tensor (an 8B model's embedding, 525M elements, would take 26 GB of them in one go).
CHUNK = 1 << 22


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 master as its 16+16 halves: (high, bfloat16, rounded to nearest with ties away from zero; low,
    int16, the float's own low 16 bits), as the kernel stores them; a NaN becomes the quiet NaN with a zero low."""
    if master.dtype != torch.float32:
        raise ValueError(f"the master to split is float32, got {master.dtype}")
    flat = master.contiguous().view(-1)
    hi = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device)
    lo = torch.empty(flat.shape, dtype=torch.int16, device=flat.device)
    for at in range(0, flat.numel(), CHUNK):
        part = flat[at:at + CHUNK]
        bits = part.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        nan = part.isnan()
        hi[at:at + CHUNK] = _as16(torch.where(nan, 0x7FC0, ((bits + 0x8000) >> 16) & 0xFFFF)).view(torch.bfloat16)
        lo[at:at + CHUNK] = _as16(torch.where(nan, 0, bits & 0xFFFF))
    return hi.view(master.shape), lo.view(master.shape)


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 master a 16+16 pair holds: high << 16 plus the low half sign-extended, bit for bit."""
    if hi.dtype.itemsize != 2 or lo.dtype.itemsize != 2:
        raise ValueError(f"the halves are 16-bit, got {hi.dtype} and {lo.dtype}")
    high_flat, low_flat = hi.contiguous().view(-1).view(torch.int16), lo.contiguous().view(-1).view(torch.int16)
    out = torch.empty(high_flat.shape, dtype=torch.float32, device=hi.device)
    for at in range(0, high_flat.numel(), CHUNK):
        high = high_flat[at:at + CHUNK].to(torch.int64) & 0xFFFF
        low = low_flat[at:at + CHUNK].to(torch.int64)  # sign-extended
        out[at:at + CHUNK] = _as32(((high << 16) + low) & 0xFFFFFFFF).view(torch.float32)
    return out.view(hi.shape)


def _as16(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^16) as the int16 with those bits."""
    return torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16)


def _as32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 with those bits."""
    return torch.where(values >= 0x80000000, values - 0x100000000, values).to(torch.int32)
