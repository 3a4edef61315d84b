"""Building a model too large for memory: construct on the meta device, materialise unit by unit into shards.

``with offload.zero.Init(): model = MyModel(...)`` builds the model with every large
tensor created on the meta device (no memory), through a TorchFunctionMode rather
than by patching torch's constructors. Small tensors (below ``min_meta_numel``
elements: LayerNorm weights, biases, rotary frequency buffers) are created for real,
so buffers computed in ``__init__`` keep their values.

``offload.initialize`` then materialises one unit at a time: its meta parameters get
host memory, the modules that own them are initialised with their own initialiser,
the values are copied into the unit's shard and the full copy is dropped, so building
needs memory for about one unit beyond the shards themselves.

The initialiser of a module is, in order of preference: the model's
``init_module(name, module)`` (offload's built-in GPT), the model's
``_init_weights(module)`` (Hugging Face models), the module's ``reset_parameters()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offload.zero.plan import ParamSlot, UnitPlan

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.empty_strided,
              torch.normal}


class Init(TorchFunctionMode):
    """Tensors of at least ``min_meta_numel`` elements created inside go to the meta device.

    DeepSpeed's arguments are taken as its scripts pass them. ``enabled=False`` builds for real. Where the
    partitions live (``remote_device``, ``pin_memory``), their dtype (``dtype``) and the config
    (``config_dict_or_path``, ``config``) are the config's that ``initialize`` reads, which shards the model: here
    they change nothing, as nothing is partitioned until then. ``module`` (a model built already) is sharded by
    ``initialize`` as it is."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, *, min_meta_numel: int = 4096,
                 **deepspeed_only: Any) -> None:
        super().__init__()
        self.min_meta_numel = min_meta_numel if enabled else math.inf

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and _numel(func, args, kwargs) >= self.min_meta_numel:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _numel(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if len(args) > 1 and func in (torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn) and all(
            isinstance(a, int) for a in args):
        return math.prod(args)  # torch.empty(3, 4)
    size = kwargs.get("size", args[0] if args else ())
    if func is torch.full and "size" not in kwargs:
        size = args[0] if args else ()
    if func is torch.normal:
        size = kwargs.get("size", args[2] if len(args) > 2 else ())
    if isinstance(size, int):
        return size
    try:
        return math.prod(int(s) for s in size)
    except TypeError:
        return 0


def materialize_unit(model: nn.Module, plan: UnitPlan) -> None:
    """Give the unit's meta parameters host memory and initialise the modules that own them."""
    meta = give_memory(plan)
    if not meta:
        return
    modules = dict(model.named_modules(remove_duplicate=False))
    owners: dict[str, nn.Module] = {}
    for s in meta:
        owner_name = s.name.rpartition(".")[0]
        owners.setdefault(owner_name, modules[owner_name])
    mine = {id(s.param) for s in meta}
    for name, module in owners.items():
        # A parameter of this module that belongs to another unit (a tied weight, already sharded) must not be
        # touched by the initialiser: it gets a scratch stand-in while the module initialises.
        foreign = {k: p for k, p in module._parameters.items() if p is not None and id(p) not in mine}
        for k, p in foreign.items():
            module._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        try:
            _initialise(model, name, module)
        finally:
            module._parameters.update(foreign)


def give_memory(plan: UnitPlan) -> list[ParamSlot]:
    """Give the unit's meta parameters (uninitialised) host memory; returns their slots. Pretrained weights fill
    them from a checkpoint instead of an initialiser (offload/files/pretrained.py)."""
    meta = [s for s in plan.slots if s.param.is_meta]
    for s in meta:
        # A meta tensor's data cannot be replaced by a CPU one in place; swapping keeps the Parameter
        # object (which optimizer groups and tied modules refer to) and gives it real storage.
        real = nn.Parameter(torch.empty(s.shape, dtype=s.param.dtype, device="cpu"), s.param.requires_grad)
        torch.utils.swap_tensors(s.param, real)
    return meta


def _initialise(model: nn.Module, name: str, module: nn.Module) -> None:
    with torch.no_grad():
        # Methods nn.Module does not declare (its __getattr__ is typed Tensor | Module): looked up by name.
        if hasattr(model, "init_module"):
            getattr(model, "init_module")(name, module)
        elif hasattr(model, "_init_weights"):
            getattr(model, "_init_weights")(module)
        elif hasattr(module, "reset_parameters"):
            getattr(module, "reset_parameters")()
        else:
            raise ValueError(f"module {name!r} ({type(module).__name__}) was built under offload.zero.Init but has "
                             "no reset_parameters(); give the model an init_module(name, module) method that "
                             "initialises it")
