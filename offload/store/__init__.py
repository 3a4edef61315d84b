"""The tiered store's rooms: the swap directory, the optimizer state's sub-groups and the parameter swap."""

from offload.store.param_swap import ParamSwap, ParamSwapError
from offload.store.swapdir import Leftover, SwapDir, SwapDirError, find_leftovers

__all__ = ["Leftover", "ParamSwap", "ParamSwapError", "SwapDir", "SwapDirError", "find_leftovers"]
