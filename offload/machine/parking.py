"""Device memory lent back for a while: storages copied out to host memory and shrunk to nothing, then grown and
filled again (what ``engine.offload_states`` / ``reload_states`` do, offload/engine/lending.py).

[Note: lending by storage] A tensor the engine keeps on the device is reached through many views: a unit's flat
buffer through its parameters, a sub-group's state slot through its master and moments. Moving each view would
make new tensors and leave the old ones pointing at freed memory. So what moves is the storage under them: its
bytes are copied to a host tensor, and the storage is resized to nothing (the memory goes back to the device's
allocator) while every view keeps its identity, shape and strides; on the way back the storage is grown to its
size again and the bytes copied in. This is how FSDP2 frees and refills its unsharded parameters. A storage whose
contents are dead between steps (a gradient accumulator the next backward overwrites, a staging ring) is shrunk
and grown without a copy. Storages are taken once each, however many views name them.

The kept bytes can go further, off host memory (``spill``: the engine's NVMe file), all or nothing: a failed
write leaves them in host memory; on the way back every byte is read before any storage grows, so a failed read
leaves the states where they were, to be reloaded again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    saved: torch.Tensor | None  # the bytes, in host memory; None where the contents are dead (or spilled)
    spilled: bool = False  # the bytes are in the spill, not in host memory


class Spill(Protocol):
    """Where kept bytes wait off host memory (offload/engine/lending.py's NVMe file)."""

    def write_all(self, copies: list[torch.Tensor]) -> None:
        """Every copy written (uint8 host tensors), or an error with nothing to rely on."""

    def read_all(self, into: list[torch.Tensor]) -> None:
        """Every copy read back into ``into`` (as many, the same sizes, in the same order)."""

    def release(self) -> None:
        """The copies are no longer needed."""


class Parking:
    """Storages shrunk to nothing, each with its bytes in host memory until ``restore``."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []
        self._spill: Spill | None = None

    @property
    def nbytes(self) -> int:
        """The device bytes given back."""
        return sum(p.nbytes for p in self._parked)

    def park(self, tensors: Iterable[tuple[torch.Tensor, bool]], pin: bool) -> int:
        """Shrink the storage under each tensor, keeping its bytes where the flag says the contents live (a
        storage named twice is kept if either says so); returns the bytes given back. Storages already empty or
        not resizable (host buffers a pool owns) are left as they are. Synchronous: a storage is freed only once
        its copy is complete."""
        chosen: dict[int, tuple[torch.UntypedStorage, bool]] = {}
        for tensor, keep in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or not storage.resizable():
                continue
            key = storage.data_ptr()
            chosen[key] = (storage, keep or chosen.get(key, (storage, False))[1])
        new = []
        for storage, keep in chosen.values():
            saved = None
            if keep:
                whole = _bytes_of(storage)
                saved = torch.empty(whole.numel(), dtype=torch.uint8,
                                    pin_memory=pin and whole.is_cuda and torch.cuda.is_available())
                saved.copy_(whole, non_blocking=saved.is_pinned())
            new.append(_Parked(storage, storage.nbytes(), saved))
        for device in {p.storage.device for p in new if p.saved is not None and p.storage.device.type == "cuda"}:
            torch.cuda.synchronize(device)  # every copy out done before its memory goes
        for parked in new:
            parked.storage.resize_(0)
        self._parked += new
        return sum(p.nbytes for p in new)

    @property
    def spilled(self) -> bool:
        """The kept bytes are in a spill, not in host memory."""
        return self._spill is not None

    def spill(self, spill: Spill) -> None:
        """Every kept copy written out through ``spill`` and its host memory let go; a failed write raises with
        the copies still here."""
        kept = [p for p in self._parked if p.saved is not None]
        spill.write_all([p.saved for p in kept if p.saved is not None])
        for parked in kept:
            parked.saved, parked.spilled = None, True
        self._spill = spill

    def restore(self, non_blocking: bool = False) -> None:
        """Grow every storage back and copy its bytes in; with ``non_blocking`` a GPU's copies stay queued on the
        current stream (whatever runs there next is ordered after them). Spilled bytes are all read first: a
        failed read raises with nothing changed."""
        if self._spill is not None:
            spilled = [p for p in self._parked if p.spilled]
            back = [torch.empty(p.nbytes, dtype=torch.uint8) for p in spilled]
            self._spill.read_all(back)
            for parked, copy in zip(spilled, back, strict=True):
                parked.saved, parked.spilled = copy, False
            self._spill.release()
            self._spill = None
        for parked in self._parked:
            parked.storage.resize_(parked.nbytes)
            if parked.saved is not None:
                _bytes_of(parked.storage).copy_(parked.saved, non_blocking=non_blocking and parked.saved.is_pinned())
        self._parked.clear()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as one uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
