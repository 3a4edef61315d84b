"""Where each item of a two-slot swap file sits ([Note: two slots] in offload/store/two_slots.py): its two slots'
offsets and the file's size, from the items' sizes alone. A leaf, so the start-up plan sizes the files without
importing the file."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from offload.machine.buffers import round_up


@dataclass
class Slots:
    """One item's two places in the file (byte offsets), and which holds its last completed values."""

    nbytes: int  # on the wire: rounded up to the block
    offsets: tuple[int, int]
    current: int = 0

    @property
    def current_offset(self) -> int:
        return self.offsets[self.current]

    @property
    def next_offset(self) -> int:
        return self.offsets[1 - self.current]

    def flip(self) -> None:
        self.current = 1 - self.current


def layout(sizes: Sequence[tuple[Hashable, int]]) -> tuple[dict[Hashable, Slots], int]:
    """Each item's two slots (``sizes``: key and bytes, in file order) and the file's size."""
    slots, offset = {}, 0
    for key, nbytes in sizes:
        n = round_up(nbytes)
        slots[key] = Slots(n, (offset, offset + n))
        offset += 2 * n
    return slots, offset
