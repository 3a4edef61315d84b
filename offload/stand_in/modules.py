"""What each ``deepspeed`` module is, under the switch: offload's DeepSpeed surface (docs/deepspeed-api.md), module by
module as transformers, accelerate and TRL import it. A module is built when first imported; a name it lacks raises
an AttributeError that says offload stands in for DeepSpeed, and a ``deepspeed`` module not in this table fails its
import by name (offload/stand_in/__init__.py)."""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed whose surface offload answers (docs/deepspeed-api.md)


def _map_nested(item: Any, pick: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """``fn`` on each item ``pick`` takes inside nested lists, tuples and dicts; the containers rebuilt as they were."""
    if pick(item):
        return fn(item)
    if isinstance(item, (list, tuple)):
        return type(item)(_map_nested(v, pick, fn) for v in item)
    if isinstance(item, dict):
        return {k: _map_nested(v, pick, fn) for k, v in item.items()}
    return item


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool]) -> Any:
    """DeepSpeed's runtime.utils helper: the tensors in nested lists, tuples and dicts that ``criterion_func`` picks,
    moved to ``device``."""
    return _map_nested(item, criterion_func, lambda t: t.to(device))


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """DeepSpeed's checkpoint.utils helper: every tensor in nested containers cloned (detached) to ``device``, so a
    saved view does not drag its whole storage into the file."""
    return _map_nested(item, torch.is_tensor, lambda t: t.detach().clone().to(device))


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` as DeepSpeed 0.19.8 runs it: the default group started first where none runs (a
    group of one without a launcher), since the Trainer and accelerate, seeing DeepSpeed, gather across it; then
    offload's ``initialize``."""
    from offload.comm import init_distributed
    from offload.engine import initialize as engine_initialize
    init_distributed(dist_init_required=kwargs.get("dist_init_required"))
    return engine_initialize(*args, **kwargs)


def _public(module_name: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in names if n not in skip}


def _top() -> dict[str, Any]:
    names = _public("offload", skip=("comm", "ops", "utils", "zero", "__version__"))  # those: this table's modules
    return {**names, "__version__": DEEPSPEED_VERSION, "initialize": initialize}


def _utils() -> dict[str, Any]:
    return {**_public("offload.utils", skip=("zero_to_fp32",)), "logger": logging.getLogger("offload")}


def _lr_schedules() -> dict[str, Any]:
    from offload.optim.lr_schedules import LR_SCHEDULES
    return {**LR_SCHEDULES, "VALID_LR_SCHEDULES": list(LR_SCHEDULES)}


class _Accelerator:
    """DeepSpeed's ``get_accelerator()``, for the few questions transformers asks it: the device's name."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: int | str | None = None) -> str:
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(torch.cuda.current_device() if self._name == "cuda" else None)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return True


_ACCELERATOR = _Accelerator()


def get_accelerator() -> _Accelerator:
    return _ACCELERATOR


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., Any]:
    """DeepSpeed's hook for recasting tensor constructors under ``zero.Init``; offload's Init builds on the meta
    device and never calls it, so transformers may swap it (``prevent_arange_dtype_change``) to no effect."""
    return fn


def _init() -> type:
    from offload.comm import init_distributed
    from offload.zero import Init

    class ZeroInit(Init):
        """``deepspeed.zero.Init`` as DeepSpeed 0.19.8 runs it: the default group started first where none runs (a
        group of one without a launcher), since transformers' ``from_pretrained`` under ZeRO-3 asks the group's
        rank; then offload's ``zero.Init``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init_distributed()
            super().__init__(*args, **kwargs)

    ZeroInit.__module__, ZeroInit.__qualname__ = "deepspeed.zero", "Init"
    return ZeroInit


def _zero() -> dict[str, Any]:
    return {**_public("offload.zero"), "Init": _init()}


def _partition_parameters() -> dict[str, Any]:
    from offload.zero import GatheredParameters, register_external_parameter
    from offload.zero.unit import ZeroParamStatus
    return {"ZeroParamStatus": ZeroParamStatus, "GatheredParameters": GatheredParameters, "Init": _init(),
            "register_external_parameter": register_external_parameter, "get_accelerator": get_accelerator,
            "zero_wrapper_for_fp_tensor_constructor": zero_wrapper_for_fp_tensor_constructor,
            "_orig_torch_arange": torch.arange}


def _engine() -> dict[str, Any]:
    from offload.engine import Engine
    return {"DeepSpeedEngine": Engine}


def _none() -> dict[str, Any]:  # a package whose names are its modules
    return {}


MODULES: dict[str, Callable[[], dict[str, Any]]] = {
    "deepspeed": _top,
    "deepspeed.comm": lambda: _public("offload.comm"),
    "deepspeed.zero": _zero,
    "deepspeed.ops": _none,
    "deepspeed.ops.adam": lambda: _public("offload.ops.adam"),
    "deepspeed.ops.lion": lambda: _public("offload.ops.lion"),
    "deepspeed.ops.adagrad": lambda: _public("offload.ops.adagrad"),
    "deepspeed.utils": _utils,
    "deepspeed.utils.zero_to_fp32": lambda: _public("offload.utils.zero_to_fp32"),
    "deepspeed.checkpointing": lambda: _public("offload.checkpointing"),
    "deepspeed.runtime": _none,
    "deepspeed.runtime.engine": _engine,
    "deepspeed.runtime.lr_schedules": _lr_schedules,
    "deepspeed.runtime.utils": lambda: {"move_to_device": move_to_device},
    "deepspeed.runtime.zero": lambda: {k: v for k, v in _partition_parameters().items() if k != "ZeroParamStatus"},
    "deepspeed.runtime.zero.partition_parameters": _partition_parameters,
    "deepspeed.runtime.zero.offload_config": lambda: _public("offload.runtime.zero.offload_config"),
    "deepspeed.checkpoint": _none,
    "deepspeed.checkpoint.utils": lambda: {"clone_tensors_for_torch_save": clone_tensors_for_torch_save},
    "deepspeed.accelerator": lambda: {"get_accelerator": get_accelerator},
    "deepspeed.launcher": _none,
    "deepspeed.launcher.runner": lambda: {"DEEPSPEED_ENVIRONMENT_NAME": ".deepspeed_env"},
}


def fill(module: types.ModuleType) -> None:
    """The module's names from the table; its submodules reached as attributes, as ``import deepspeed`` then
    ``deepspeed.zero.Init`` does."""
    name = module.__name__
    module.__dict__.update(MODULES[name]())
    module.__dict__.update(__offload__=True, __path__=[])

    def __getattr__(attr: str) -> Any:
        child = f"{name}.{attr}"
        if child in MODULES:
            return importlib.import_module(child)
        raise AttributeError(f"{name}.{attr} is DeepSpeed's and offload does not answer it: offload stands in for "
                             "DeepSpeed in this process (offload.as_deepspeed); docs/deepspeed-api.md lists what "
                             "it answers")

    module.__dict__["__getattr__"] = __getattr__
