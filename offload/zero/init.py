"""Building a model too large for memory: construct on the meta device, materialise unit by unit into shards.

``with offload.zero.Init(): model = MyModel(...)`` builds the model with every large
tensor created on the meta device (no memory), through a TorchFunctionMode rather
than by patching torch's constructors. Small tensors (below ``min_meta_numel``
elements: LayerNorm weights, biases, rotary frequency buffers) are created for real,
so buffers computed in ``__init__`` keep their values.

``offload.initialize`` then materialises one unit at a time: its meta parameters get
host memory and the values plain construction would have given them, replayed from what
the mode recorded (see [Note: replaying construction] in recipe.py); the values are copied
into the unit's shard and the full copy is dropped, so building needs memory for about one
unit beyond the shards themselves.

A parameter whose record cannot be replayed is initialised by its module's initialiser,
in order of preference: the model's ``init_module(name, module)`` (offload's built-in
GPT), the model's ``_init_weights(module)`` (Hugging Face models), the module's
``reset_parameters()``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten, tree_map

from offload.zero.plan import ParamSlot, UnitPlan
from offload.zero.recipe import HOST, Recipe, Recorder, generator_device, replay, take_recipe, written_after

logger = logging.getLogger(__name__)

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.empty_strided,
              torch.normal}
# what torch.device("cuda") as a context gives a device to: drawing on the GPU, the block does too
_CONSTRUCTORS = frozenset(_device_constructors())


class Init(TorchFunctionMode):
    """Tensors of at least ``min_meta_numel`` elements created inside go to the meta device.

    DeepSpeed's arguments are taken as its scripts pass them. ``enabled=False`` builds for real. Where the
    partitions live (``remote_device``, ``pin_memory``), their dtype (``dtype``) and the config
    (``config_dict_or_path``, ``config``) are the config's that ``initialize`` reads, which shards the model: here
    they change nothing, as nothing is partitioned until then. ``module`` (a model built already) is sharded by
    ``initialize`` as it is. ``draw_device``: whose generator the weights are drawn from, and where (see [Note:
    drawing on the device] in recipe.py): None, this process's GPU where there is one (as DeepSpeed's), else the
    host; "cpu" keeps the host's, the values of plain construction on the CPU."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, *, min_meta_numel: int = 4096,
                 draw_device: str | torch.device | None = None, **deepspeed_only: Any) -> None:
        super().__init__()
        self.min_meta_numel = min_meta_numel if enabled else math.inf
        self.device = drawing_device(draw_device) if enabled else torch.device("cpu")
        self.on_gpu = self.device.type == "cuda"
        self.recorder = Recorder(self.device)
        self.scratch = _Scratch(self.device)

    def __exit__(self, *exc: Any) -> None:
        self.recorder.close()
        self.scratch.close()
        super().__exit__(*exc)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        rec = self.recorder
        if func in _FACTORIES and kwargs.get("device") is None and _numel(func, args, kwargs) >= self.min_meta_numel:
            out = func(*args, **{**kwargs, "device": "meta"})
            gen = kwargs.get("generator")
            # torch.device("cuda") gives a device to its constructors only: torch.normal(mean, std, size) is
            # drawn on the host there, from the host's generator, and so it is here
            where = (generator_device(gen) if isinstance(gen, torch.Generator)
                     else self.device if func in _CONSTRUCTORS else HOST)
            call = rec.call(func, args, {**kwargs, "device": where, "dtype": out.dtype}, device=where)
            if call.rng is not None:  # the generator moves as in plain construction
                self.scratch.made(func, out, args, kwargs, where)
            rec.made(out, call, args, kwargs)
            return out
        if (self.on_gpu and func in _CONSTRUCTORS and kwargs.get("device") is None
                and torch.get_default_device().type == "cpu"):  # made for real where construction draws
            return func(*args, **{**kwargs, "device": self.device})  # as torch.device("cuda") would, over device=None
        metas = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and rec.shares(a)]
        if not metas:
            return func(*args, **kwargs)
        if func == _IS_META:
            self._skipped_init(args[0])
            return func(*args, **kwargs)
        versions = [t._version for t in metas]
        call = rec.call(func, args, kwargs)
        out = func(*args, **kwargs)
        written = [t for t, v in zip(metas, versions, strict=True) if t._version != v]
        for t in written:
            rec.wrote(t, call, args, kwargs)
        if call.rng is not None:
            self.scratch.run(func, args, kwargs)
        if not written and isinstance(out, torch.Tensor) and out.is_meta:
            base = rec.ref(args[0]) if args and isinstance(args[0], torch.Tensor) else None
            if rec.shares(out):
                if base is not None:
                    rec.view(out, base, func, args, kwargs)
            else:
                rec.made(out, call, args, kwargs)
        return out

    def _skipped_init(self, tensor: torch.Tensor) -> None:
        """Some of torch.nn.init (``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``) is no torch function
        and returns at once for a meta tensor, after asking ``is_meta``: the function asking, found on the stack,
        is recorded as a write with the arguments it was given, and run on scratch memory."""
        frame: FrameType | None = sys._getframe(1)
        for _ in range(4):  # the asking function is the first frame above this one, past torch's own plumbing
            if frame is None or frame.f_globals.get("__name__") == "torch.nn.init":
                break
            frame = frame.f_back
        if frame is None or frame.f_globals.get("__name__") != "torch.nn.init":
            return
        func = getattr(torch.nn.init, frame.f_code.co_name, None)
        if func is None or frame.f_locals.get("tensor") is not tensor:
            return
        names = inspect.signature(func).parameters
        kwargs = {name: frame.f_locals[name] for name in names if name != "tensor" and name in frame.f_locals}
        call = self.recorder.call(func, (tensor,), kwargs)
        self.recorder.wrote(tensor, call, (tensor,), kwargs)
        self.scratch.run(func, (tensor,), kwargs)


def drawing_device(asked: str | torch.device | None) -> torch.device:
    """Where construction draws (see [Note: drawing on the device] in recipe.py): ``asked``, else this process's GPU
    (LOCAL_RANK's, as initialize picks it) where there is one, else the host; a GPU with its index."""
    if asked is None:
        index = int(os.environ.get("LOCAL_RANK", -1))
        if not torch.cuda.is_available():
            asked = "cpu"
        else:
            asked = f"cuda:{index if 0 <= index < torch.cuda.device_count() else torch.cuda.current_device()}"
    device = torch.device(asked)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"draw_device {asked!r}: construction draws on the host (\"cpu\") or a GPU (\"cuda\")")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"draw_device {asked!r}: this machine has no usable GPU; leave it None or \"cpu\"")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device


class _Scratch:
    """One buffer on the drawing device (and one on a script's own generator's device, where it passes one), grown
    to the largest drawing call's tensors and freed when the mode ends: the generator moves as in plain construction
    without a tensor's worth of memory left behind per call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def run(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            device: torch.device | None = None) -> None:
        """``func`` on scratch memory in place of its meta tensors, on ``device`` (None: the drawing device; a
        generator passed says its own)."""
        metas = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.is_meta]
        sizes = [-(-a.numel() * a.element_size() // 64) * 64 for a in metas]
        gen = kwargs.get("generator")
        device = generator_device(gen) if isinstance(gen, torch.Generator) else device or self.device
        buffer = self.buffers.pop(device, None)
        if buffer is None or sum(sizes) > buffer.numel():
            buffer = None  # freed before the larger one is taken
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self.buffers[device] = buffer
        carved, at = {}, 0
        for a, n in zip(metas, sizes, strict=True):
            carved[id(a)] = buffer[at:at + a.numel() * a.element_size()].view(a.dtype).view(a.shape)
            at += n

        def scratch(a: Any) -> Any:
            return carved[id(a)] if isinstance(a, torch.Tensor) and a.is_meta else a
        func(*tree_map(scratch, args), **tree_map(scratch, kwargs))

    def made(self, func: Callable[..., Any], out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any],
             device: torch.device) -> None:
        """A drawing factory (``torch.randn(n, m)``), into scratch memory on ``device`` shaped as its meta ``out``."""
        rest = {k: v for k, v in kwargs.items() if k not in ("device", "dtype", "layout", "requires_grad",
                                                             "pin_memory")}
        self.run(lambda into: func(*args, **rest, out=into), (out,), {}, device)

    def close(self) -> None:
        on_gpu = any(d.type == "cuda" for d in self.buffers)
        self.buffers.clear()
        if on_gpu:  # back to the device: initialize measures what is free without the allocator's cache
            torch.cuda.empty_cache()


_IS_META = torch.Tensor.is_meta.__get__  # type: ignore[attr-defined]


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
    """Give the unit's meta parameters memory and the values plain construction would have given them (see [Note:
    replaying construction]); those without a recipe to replay, or whose replay fails, their module's initialiser."""
    meta = [s for s in plan.slots if s.param.is_meta]
    rest: list[ParamSlot] = []
    for s in meta:
        recipe = _recipe(s.param, f"parameter {s.name!r}")
        if recipe is not None and recipe.broken is None:
            try:
                _swap_in(s.param, replay(recipe))
                continue
            except (RuntimeError, TypeError, ValueError) as e:  # a call that cannot run again as recorded
                recipe.broken = f"replaying it failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        rest.append(s)
        _say_not_replayed(s.name, f"its recipe cannot be replayed: {recipe.broken}" if recipe is not None
                          else "it was put on the meta device outside offload.zero.Init's recording")
    if not rest:
        return
    give_memory(plan)
    modules = dict(model.named_modules(remove_duplicate=False))
    owners: dict[str, nn.Module] = {}
    for s in rest:
        owner_name = s.name.rpartition(".")[0]
        owners.setdefault(owner_name, modules[owner_name])
    mine = {id(s.param) for s in rest}
    for name, module in owners.items():
        # A parameter of this module that belongs to another unit (a tied weight, already sharded) or that was
        # replayed must not be touched by the initialiser: it gets a scratch stand-in while the module initialises.
        foreign = {k: p for k, p in module._parameters.items() if p is not None and id(p) not in mine}
        for k, p in foreign.items():
            module._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        try:
            _initialise(model, name, module)
        finally:
            module._parameters.update(foreign)


def materialize_param(param: torch.Tensor, name: str = "a parameter") -> None:
    """Give one meta parameter built under ``zero.Init`` its plain-construction values now (before ``initialize``:
    ``GatheredParameters`` writing into it, as DeepSpeed allows); ``initialize`` then takes it as it is."""
    recipe = _recipe(param, name)
    if recipe is None or recipe.broken is not None:
        why = "it was put there outside offload.zero.Init" if recipe is None else recipe.broken
        raise ValueError(f"{name} is on the meta device and its values cannot be made here ({why}), so a write "
                         "into it would be lost; write it after initialize, inside GatheredParameters")
    _swap_in(param, replay(recipe))


def _recipe(param: torch.Tensor, name: str) -> Recipe | None:
    """The meta parameter's recipe, taken; a write that reached it after the block (and did nothing) refused."""
    recipe = take_recipe(param)
    if recipe is not None and written_after(param, recipe):
        raise ValueError(f"{name} was written after the `with offload.zero.Init():` block that built it ended; it "
                         "was still on the meta device, so the write did nothing. Write it inside the block, or "
                         "after initialize inside `with offload.zero.GatheredParameters(params, modifier_rank=0):`")
    return recipe


_said: set[str] = set()


def _say_not_replayed(name: str, why: str) -> None:
    if "any" not in _said:
        _said.add("any")
        logger.warning("parameter %r is initialised by its module's initialiser, so its initial values differ from "
                       "a plain construction's with the same seed (%s); said once", name, why)


def _swap_in(param: torch.Tensor, values: torch.Tensor) -> None:
    # A meta tensor's data cannot be replaced by a CPU one in place; swapping keeps the Parameter
    # object (which optimizer groups and tied modules refer to) and gives it real storage. swap_tensors swaps the
    # objects' attributes too: what a caller set on the parameter (transformers marks a loaded one
    # _is_hf_initialized before gathering it, so that its initialiser skips it) goes back onto it.
    fresh = nn.Parameter(values.to(param.dtype), param.requires_grad)
    torch.utils.swap_tensors(param, fresh)
    param.__dict__.update(fresh.__dict__)


def give_memory(plan: UnitPlan) -> list[ParamSlot]:
    """Give the unit's meta parameters (uninitialised) host memory; returns their slots. Pretrained weights fill
    them from a checkpoint instead of an initialiser (offload/files/pretrained.py)."""
    meta = [s for s in plan.slots if s.param.is_meta]
    for s in meta:
        take_recipe(s.param)  # not replayed: what is written into it comes from elsewhere
        _swap_in(s.param, torch.empty(s.shape, dtype=s.param.dtype, device="cpu"))
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
