"""Weight files written as a stream: the header first, from the layout alone, then each tensor as it arrives.

A whole model's state dict never has to exist in memory to be saved: whoever gathers it
unit by unit writes each tensor and drops it. Two formats, the two that
``from_pretrained`` and ``torch.load`` read:

- safetensors: an 8-byte header length, the JSON header (every tensor's dtype, shape and
  byte range, known from the layout), then the bytes in that order.
- torch.save's zip: ``data.pkl`` pickles the state dict with each tensor's storage as a
  persistent reference (``("storage", <type>, key, "cpu", numel)``, as torch.save writes
  it), then one ``data/<key>`` record per storage, written through torch's own zip writer.

Both write to ``<name>.tmp`` and rename it into place on ``close()``; a writer that fails or
is abandoned removes its temporary file, so the target holds a complete file or its old one.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import os
import pickle
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsIndex, TypeVar

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its key, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_S = TypeVar("_S", bound="_Stream")


class _Stream:
    """The order check, the temporary file and the final rename, shared by both formats."""

    def __init__(self, path: str | os.PathLike[str], specs: list[TensorSpec]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.specs = specs
        self._next = 0
        keys = [s.key for s in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{self.path}: a key appears twice in the layout")

    def _expect(self, key: str, tensor: torch.Tensor) -> TensorSpec:
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: {key!r} is beyond the layout's {len(self.specs)} tensors")
        spec = self.specs[self._next]
        if (key, tensor.dtype, tuple(tensor.shape)) != (spec.key, spec.dtype, spec.shape):
            raise ValueError(f"{self.path}: expected {spec.key!r} {spec.dtype} {list(spec.shape)} next, got {key!r} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        self._next += 1
        return spec

    def _check_complete(self) -> None:
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: closed after {self._next} of {len(self.specs)} tensors; "
                             f"{self.specs[self._next].key!r} was never written")

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> None:  # pragma: no cover - each format defines it
        raise NotImplementedError


def _raw(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().cpu().contiguous()
    # numpy's stubs give ndarray __buffer__ only from Python 3.12 (the checked version is 3.10)
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- safetensors

_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def safetensors_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding ``specs`` in order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for spec in specs:
        if spec.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{spec.key}: safetensors has no dtype for {spec.dtype}")
        header[spec.key] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference writer does it
    return struct.pack("<Q", len(text)) + text


class SafetensorsStream(_Stream):
    """``with SafetensorsStream(path, specs) as f: f.write(key, tensor)`` for every spec, in order."""

    def __init__(self, path: str | os.PathLike[str], specs: list[TensorSpec],
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(path, specs)
        self._f = open(self.tmp, "wb")
        self._f.write(safetensors_header(specs, metadata))

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self._expect(key, tensor)
        self._f.write(_raw(tensor))

    def close(self) -> None:
        self._check_complete()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        super().abort()


# --------------------------------------------------------------------------- torch.save's format


class _Storage:
    """Stands in the pickle for a storage whose bytes are written afterwards (``data/<key>``)."""

    def __init__(self, key: str, spec: TensorSpec) -> None:
        self.key, self.spec = key, spec


class _Tensor:
    """Pickles as torch.save pickles a contiguous CPU tensor that owns its whole storage."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, tuple[Any, ...]]:
        shape = self.storage.spec.shape
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, shape, stride, False, collections.OrderedDict())


@functools.lru_cache(maxsize=None)
def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class torch.save names for ``dtype`` (torch.BFloat16Storage, ...)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated, but it is what the format names
        return getattr(torch, torch.TypedStorage(0, dtype=dtype)._pickle_storage_type())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return "storage", _storage_type(obj.spec.dtype), obj.key, "cpu", math.prod(obj.spec.shape)
        return None


class TorchStream(_Stream):
    """A file ``torch.load`` reads as an ordered state dict, written tensor by tensor in ``specs``' order; the
    dict's own order is ``key_order`` (a state_dict's), when given."""

    def __init__(self, path: str | os.PathLike[str], specs: list[TensorSpec],
                 key_order: list[str] | None = None) -> None:
        super().__init__(path, specs)
        storages = {s.key: _Storage(str(i), s) for i, s in enumerate(specs)}
        if key_order is not None and sorted(key_order) != sorted(storages):
            raise ValueError(f"{self.path}: key_order names other keys than the layout")
        state = collections.OrderedDict((key, _Tensor(storages[key])) for key in key_order or storages)
        data = io.BytesIO()
        _Pickler(data, protocol=2).dump(state)
        self._zip: torch._C.PyTorchFileWriter | None = torch._C.PyTorchFileWriter(str(self.tmp))  # None: aborted
        for name, value in (("data.pkl", data.getvalue()), (".format_version", b"1"),
                            ("byteorder", sys.byteorder.encode())):
            self._zip.write_record(name, value, len(value))

    def write(self, key: str, tensor: torch.Tensor) -> None:
        spec = self._expect(key, tensor)
        t = tensor.detach().cpu().contiguous()
        assert self._zip is not None, f"{self.path}: written after abort"
        self._zip.write_record(f"data/{self._next - 1}", t.data_ptr(), spec.nbytes)  # from t's memory, no copy

    def close(self) -> None:
        self._check_complete()
        assert self._zip is not None, f"{self.path}: closed after abort"
        self._zip.write_end_of_file()
        del self._zip
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._zip = None
        super().abort()


def stream_for(path: str | os.PathLike[str], specs: list[TensorSpec], metadata: dict[str, str] | None = None,
               key_order: list[str] | None = None) -> SafetensorsStream | TorchStream:
    """safetensors for a ``.safetensors`` name (its readers sort the keys), torch.save's format for any other."""
    if str(path).endswith(".safetensors"):
        return SafetensorsStream(path, specs, metadata)
    return TorchStream(path, specs, key_order)
