"""The tiered store's rooms; so far the NVMe tier's swap directory."""

from offload.store.swapdir import Leftover, SwapDir, SwapDirError, find_leftovers

__all__ = ["Leftover", "SwapDir", "SwapDirError", "find_leftovers"]
