"""A ZeRO-3 parameter's ``ds_tensor``: DeepSpeed's name for this rank's partition of it, which users' scripts and
libraries read (to count what a rank holds, or to look at its values).

[Note: the partition as a view] offload shards a unit's flat buffer, not each parameter, so a parameter's part on
this rank is the piece of the rank's unit shard that falls inside it: possibly empty, and at W ranks the pieces add
up to the whole parameter. That shard lives on the device, in host memory or on NVMe, and the optimizer rewrites it
each step. ``ds_tensor`` is a read-only tensor of the piece's shape and dtype whose every use reads the shard where it
lives at that moment, so it is never stale and holds no memory of its own. Each use works on a copy of the piece
(from NVMe, the copy the read makes): what an op returns, a view or ``.data`` included, never aliases the shard,
which the optimizer owns, and an op that would write into ``ds_tensor`` itself is refused by name; one that only
reads it (``buf.copy_(p.ds_tensor)``) runs. DeepSpeed's own partition is padded per parameter: its ``numel()`` is
numel / W rounded up, here the elements the rank actually holds.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map

from offload.store.param_store import ParamStore


class PartitionView(torch.Tensor):
    """This rank's ``numel`` elements of unit ``index``'s shard from ``start``: see [Note: the partition as a view]."""

    _store: weakref.ReferenceType[ParamStore]
    _index: int
    _start: int
    ds_numel: int

    @staticmethod
    def __new__(cls, store: ParamStore, index: int, start: int, numel: int, device: torch.device) -> PartitionView:
        view = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=store.dtype, device=device)
        view._store = weakref.ref(store)  # the parameter keeps no engine alive
        view._index, view._start = index, start
        view.ds_numel = numel  # DeepSpeed's ds_tensor carries its own element count too
        return view

    def read(self) -> torch.Tensor:
        """The piece's values now, in memory of their own (never an alias of the shard)."""
        store = self._store()
        if store is None or store.closed:
            raise RuntimeError("ds_tensor belongs to an engine that has been closed: its partition is gone")
        return store.read(self._index)[self._start:self._start + self.numel()].clone()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's stub: untyped
        return f"ds_tensor({self.read()!r})"

    def tolist(self) -> Any:  # torch refuses these for a subclass: answered from the values
        return self.read().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.read().numpy(force=force)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.read()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub leaves out func, which every subclass takes
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _writes_a_view(func, args, kwargs):
            raise RuntimeError(f"ds_tensor is this rank's partition, read where the parameter store keeps it; "
                               f"{func} would write into it, and the optimizer owns those values: change a "
                               "parameter under deepspeed.zero.GatheredParameters(..., modifier_rank=...) instead")
        return func(*tree_map(_read, args), **tree_map(_read, kwargs))


def _writes_a_view(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` writes into an argument that is a ``PartitionView`` (its schema marks that argument written;
    an op that only reads one, ``buf.copy_(p.ds_tensor)``, does not)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if any(isinstance(v, PartitionView) for v in (value if isinstance(value, (list, tuple)) else (value,))):
            return True
    return False


def _read(x: Any) -> Any:
    return x.read() if isinstance(x, PartitionView) else x
