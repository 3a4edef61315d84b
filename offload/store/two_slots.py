"""A swap file in which every item (an optimizer sub-group's state, a unit's parameter shard) has two slots.

[Note: two slots] An item is read from its current slot. A step writes the item's new
bytes to its other slot, and the item flips to that slot only once the write completed
(the stores flip a whole step's items together, after every write of the step): a
failure at any moment leaves the last completed values readable. Filling an item before
its first step, and replacing it on a checkpoint load, write its current slot in place.
Every transfer goes through a ChecksummedFile, so a slot damaged on disk is an error
when it is read, never wrong values.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from offload.aio.base import IOEngine, Request, RequestGroup
from offload.aio.checksum import ChecksummedFile
from offload.store.slots import layout
from offload.store.swapdir import SwapDir


class TwoSlotFile:
    """Owns one rank's two-slot swap file: its space (reserved up front in the swap directory) and its slots."""

    def __init__(self, engine: IOEngine, swap_dir: SwapDir, name: str, sizes: Sequence[tuple[Hashable, int]]) -> None:
        self.slots, self.nbytes = layout(sizes)
        self._file = ChecksummedFile(engine, swap_dir.reserve(name, self.nbytes))

    def read(self, key: Hashable, into: torch.Tensor) -> Request:
        """Read the item's last completed values (its current slot)."""
        s = self.slots[key]
        return self._file.read(into, s.current_offset, s.nbytes)

    def write_next(self, key: Hashable, source: torch.Tensor) -> RequestGroup:
        """Write the item's new values to its other slot; ``flip`` makes them current once this completed."""
        s = self.slots[key]
        return self._file.write(source, s.next_offset, s.nbytes)

    def write_current(self, key: Hashable, source: torch.Tensor) -> RequestGroup:
        """Replace the item's values in place (filling it at start-up, a checkpoint load)."""
        s = self.slots[key]
        return self._file.write(source, s.current_offset, s.nbytes)

    def flip(self, key: Hashable) -> None:
        self.slots[key].flip()

    def close(self) -> None:
        self._file.close()
