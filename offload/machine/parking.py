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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    saved: torch.Tensor | None  # the bytes, in host memory; None where the contents are dead


class Parking:
    """Storages shrunk to nothing, each with its bytes in host memory until ``restore``."""

    def __init__(self) -> None:
        self._parked: list[_Parked] = []

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

    def restore(self, non_blocking: bool = False) -> None:
        """Grow every storage back and copy its bytes in; with ``non_blocking`` a GPU's copies stay queued on the
        current stream (whatever runs there next is ordered after them)."""
        for parked in self._parked:
            parked.storage.resize_(parked.nbytes)
            if parked.saved is not None:
                _bytes_of(parked.storage).copy_(parked.saved, non_blocking=non_blocking and parked.saved.is_pinned())
        self._parked.clear()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as one uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
