"""How a tensor built on the meta device under ``offload.zero.Init`` would have been filled: recorded, replayed.

[Note: replaying construction] A plain ``Model()`` draws every initial weight from the
global generator as its modules are built (``reset_parameters``, then a Hugging Face
``post_init``). Under ``zero.Init`` the large tensors are meta, so those draws would never
happen: initialising each unit later would give other values than a plain construction
with the same seed (DeepSpeed's ``zero.Init`` gives the same ones), and every later draw
(dropout, a shuffle) would move too. So, while the mode is on, each large tensor gets a
``Recipe``: the call that made it and every call that wrote into it (through a view, or
``.data``, or a ``torch.nn.init`` function), each with the generator's state just before.
A call that draws from the generator also runs on a scratch tensor of the same size, so the
generator moves exactly as in plain construction (memory for one tensor at a time).

[Note: drawing on the device] On a GPU the mode draws there, as DeepSpeed's ``zero.Init``
does: every tensor the block creates without a device (the large ones' scratch draws, the
small ones for real) is made on the GPU, and each drawing call records the CUDA generator's
state, so a replay on the GPU equals plain construction under ``torch.device("cuda")``, bit
for bit, and costs the GPU's microseconds where the host's generator draws one value at a
time (about 4 minutes before the first step of an 8B Llama on a 2-core host). The host draw
(``zero.Init(draw_device="cpu")``, and any machine without a GPU) equals plain construction
on the CPU, and leaves every call but the large factories as it was; the recorder's ``device``
names the generator. A draw from a script's own generator on the other device cannot be
replayed beside them: that tensor is made by its module's initialiser, said once.
``materialize`` replays a parameter's recipe into real memory, unit by unit, with those
states: the values equal plain construction's bit for bit. A recipe that cannot be replayed
(a write from a tensor it does not know, a view it cannot repeat) says so; the caller then
falls back to the module's initialiser and warns. A write after the ``with`` block reaches a
meta tensor and does nothing: the parameter's version counter shows it, and ``materialize``
refuses rather than lose it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

_DRAWING_METHODS = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
                    "cauchy_", "randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial",
                    "randn_like", "rand_like", "randint_like", "dropout", "poisson"}


HOST = torch.device("cpu")


def draws(func: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    """Whether the call may take numbers from a generator (then it runs on a scratch tensor too)."""
    if kwargs.get("generator") is not None:
        return True
    if getattr(func, "__module__", "") == "torch.nn.init":
        return True
    return getattr(func, "__name__", "") in _DRAWING_METHODS


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class Ref:
    """A recorded tensor inside a call's arguments: its recipe and the views from it to the tensor passed."""
    recipe: Recipe
    views: tuple[Call, ...] = ()


@dataclass
class Call:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: torch.Tensor | None = None  # the default generator's state on ``device`` before the call (a drawing call)
    generator: torch.Tensor | None = None  # the state of the generator passed as ``generator=``
    device: torch.device = HOST  # whose default generator ``rng`` is; ``generator``'s device too
    host_rng: torch.Tensor | None = None  # drawing on a GPU: the host generator's state too (a call may draw there)


@dataclass
class Recipe:
    """One storage's history: ``made`` (a factory, its ``device`` the recorder's; or a call on other recipes) and the
    in-place ``writes`` that followed, each a call whose ``Ref`` to this recipe carries the views written through."""
    made: Call
    shape: torch.Size
    writes: list[Call] = field(default_factory=list)
    broken: str | None = None  # why it cannot be replayed
    version: int = -1  # the tensor's version counter when the mode ended (a later write changes it)


class Recorder:
    """What ``zero.Init``'s mode sees of the large tensors it put on the meta device (see [Note: replaying
    construction])."""

    def __init__(self, device: torch.device = HOST) -> None:
        self.device = device  # whose generator construction draws from (see [Note: drawing on the device])
        self.roots: dict[int, tuple[Recipe, torch.Tensor]] = {}  # by storage
        self.views: dict[int, tuple[torch.Tensor, Ref]] = {}  # by id of a view or alias (kept alive meanwhile)

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             device: torch.device | None = None) -> Call:
        """The call as it can be replayed: recorded tensors as ``Ref``s, the generators' states if it draws (on
        ``device``: a factory's, None the recorder's; a generator passed says its own)."""
        gen = kwargs.get("generator")
        device = generator_device(gen) if isinstance(gen, torch.Generator) else device or self.device
        drawing = draws(func, kwargs)
        rng = rng_state(device) if drawing else None  # with ``generator=`` too: it runs on scratch
        return Call(func, self._refs(args), self._refs({k: v for k, v in kwargs.items() if k != "generator"}), rng,
                    gen.get_state() if isinstance(gen, torch.Generator) else None, device,
                    torch.get_rng_state() if drawing and device.type != "cpu" else None)

    def made(self, out: torch.Tensor, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``out``, a new meta tensor, came from ``call``."""
        recipe = Recipe(call, out.shape, broken=self._unknown(args, kwargs) or self._elsewhere(call))
        self.roots[storage_key(out)] = (recipe, out)
        _REGISTRY[storage_key(out)] = (recipe, out)

    def ref(self, t: torch.Tensor) -> Ref | None:
        if id(t) in self.views and self.views[id(t)][0] is t:
            return self.views[id(t)][1]
        root = self.roots.get(storage_key(t)) if t.is_meta else None
        if root is None:
            return None
        return Ref(root[0]) if _whole(t, root[1]) else None

    def shares(self, t: torch.Tensor) -> bool:
        return t.is_meta and storage_key(t) in self.roots

    def view(self, out: torch.Tensor, of: Ref, func: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        """``out`` shares the storage of ``of``'s tensor (``args[0]``): a view, or ``.data``."""
        step = () if func == DATA_GET else (Call(func, self._refs(args[1:]), self._refs(kwargs)),)
        self.views[id(out)] = (out, Ref(of.recipe, of.views + step))

    def wrote(self, target: torch.Tensor, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ref = self.ref(target)
        if ref is None:
            entry = self.roots.get(storage_key(target))
            if entry is not None and entry[0].broken is None:
                entry[0].broken = f"{_name(call.func)} wrote through a view the recording could not repeat"
            return
        ref.recipe.writes.append(call)
        why = self._unknown(args, kwargs)
        if why and ref.recipe.broken is None:
            ref.recipe.broken = f"{_name(call.func)} read {why}"
        if ref.recipe.broken is None:
            ref.recipe.broken = self._elsewhere(call)

    def _elsewhere(self, call: Call) -> str | None:
        """A draw from a script's own generator on another device than the one construction draws on: its replay
        would draw one tensor there and the rest here, so the module's initialiser makes it instead (said)."""
        if call.generator is None or call.device == self.device:
            return None
        return (f"{_name(call.func)} drew from a generator on {call.device} while zero.Init draws on {self.device} "
                f"(zero.Init(draw_device=\"{call.device.type}\") draws there)")

    def close(self) -> None:
        for recipe, t in self.roots.values():
            recipe.version = t._version
        self.views.clear()

    def _refs(self, tree: Any) -> Any:
        return tree_map(lambda a: (self.ref(a) or a) if isinstance(a, torch.Tensor) and a.is_meta else a, tree)

    def _unknown(self, args: Any, kwargs: Any) -> str | None:
        """A meta tensor among the arguments the recorder knows nothing of (its values cannot be made)."""
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor) and a.is_meta and self.ref(a) is None:
                return f"a meta tensor of shape {tuple(a.shape)} that the recording cannot make"
        return None


def generator_device(gen: torch.Generator) -> torch.device:
    """The device a generator draws on, with its index: ``torch.Generator(device="cuda")`` says only "cuda", and
    draws on the GPU current when it was made, as construction's do (compared with the recorder's ``cuda:N``)."""
    device = gen.device
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _whole(t: torch.Tensor, base: torch.Tensor) -> bool:
    """``t`` is all of ``base``'s storage as ``base`` lays it out (not a view of a part)."""
    return (t.shape, t.stride(), t.storage_offset()) == (base.shape, base.stride(), base.storage_offset())


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", repr(func))


DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]

# Storage of a recorded meta tensor -> its recipe and the tensor, kept (meta: no memory) until a unit's build
# takes it, so that no other meta storage can reuse the key meanwhile.
_REGISTRY: dict[int, tuple[Recipe, torch.Tensor]] = {}


def take_recipe(param: torch.Tensor) -> Recipe | None:
    """The recipe of a meta parameter built under ``zero.Init``, taken from the registry (None: not one, or a
    part of one)."""
    entry = _REGISTRY.get(storage_key(param)) if param.is_meta else None
    if entry is None or not _whole(param, entry[1]):
        return None
    del _REGISTRY[storage_key(param)]
    return entry[0]


def written_after(param: torch.Tensor, recipe: Recipe) -> bool:
    """An in-place write reached the meta parameter after the mode ended (it changed nothing)."""
    return recipe.version >= 0 and param._version != recipe.version


def replay(recipe: Recipe) -> torch.Tensor:
    """The recipe's tensor, real, where construction drew it (the host, or the GPU: see [Note: drawing on the
    device]): each drawing call under the generator state it saw."""
    if recipe.broken is not None:
        raise ValueError(recipe.broken)
    with torch.no_grad():
        return _make(recipe, {})


# [Note: an overwritten draw is not replayed] A weight is often drawn twice in construction: nn.Linear's own
# kaiming_uniform_ (or an embedding's normal_), then the model's normal_ over it (a Hugging Face post_init,
# offload's GPT). The host's generator draws one value at a time, and drawing was most of a replay. A write that
# sets every element of the whole tensor without reading any (these functions, on the recipe's tensor itself, no
# view, no other argument from it) hides every write before it, and each drawing call carries the generator
# state it saw: replay starts at the last such write, and the values are the same, bit for bit. On a one-layer
# slice of the Llama-3-8B shape (1.27B parameters, 2-core Xeon) `initialize` took 22.6-24.2 s against 25.8-33.1 s
# (three interleaved pairs). The construction still draws them all on scratch memory, so the generator moves as
# in plain construction.
_OVERWRITING_INIT = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                               "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_"})
# torch.nn.init's, and the wrappers Hugging Face puts in their place while a model is built (they skip a tensor
# marked as initialised; a replay's tensor is fresh, so there they always write)
_INIT_MODULES = frozenset({"torch.nn.init", "transformers.initialization"})
_OVERWRITING_METHODS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_})


def live_writes(recipe: Recipe) -> list[Call]:
    """The writes a replay runs: from the last one that overwrites the whole tensor unread (see [Note: an
    overwritten draw is not replayed])."""
    for i in range(len(recipe.writes) - 1, 0, -1):
        if _overwrites(recipe.writes[i], recipe):
            return recipe.writes[i:]
    return recipe.writes


def _overwrites(call: Call, recipe: Recipe) -> bool:
    if call.func not in _OVERWRITING_METHODS and not (getattr(call.func, "__module__", None) in _INIT_MODULES
                                                       and getattr(call.func, "__name__", None) in _OVERWRITING_INIT):
        return False
    # a Tensor method has its tensor first; torch.nn.init's functions reach a mode by keyword (tensor=...)
    if call.args:
        target, rest = call.args[0], (call.args[1:], call.kwargs)
    else:
        kwargs = dict(call.kwargs)
        target, rest = kwargs.pop("tensor", None), ((), kwargs)
    if not (isinstance(target, Ref) and target.recipe is recipe and not target.views):
        return False
    return not any(isinstance(a, Ref) and a.recipe is recipe for a in tree_flatten(rest)[0])


def _make(recipe: Recipe, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    if id(recipe) not in memo:
        memo[id(recipe)] = _run(recipe.made, memo, None)
        for call in live_writes(recipe):
            _run(call, memo, recipe)
    return memo[id(recipe)]


def _value(ref: Ref, memo: dict[int, torch.Tensor], writing: Recipe | None) -> torch.Tensor:
    t = memo[id(ref.recipe)] if ref.recipe is writing else _make(ref.recipe, memo)
    for step in ref.views:
        t = _run(Call(step.func, (t, *step.args), step.kwargs), memo, writing)
    return t


def _run(call: Call, memo: dict[int, torch.Tensor], writing: Recipe | None) -> Any:
    def resolve(a: Any) -> Any:
        return _value(a, memo, writing) if isinstance(a, Ref) else a

    args = tree_map(resolve, call.args, is_leaf=lambda a: isinstance(a, Ref))
    kwargs = tree_map(resolve, call.kwargs, is_leaf=lambda a: isinstance(a, Ref))
    if call.generator is not None:
        kwargs["generator"] = torch.Generator(device=call.device).set_state(call.generator)
    if call.rng is None:
        return call.func(*args, **kwargs)
    if call.device.type == "cuda":
        with torch.random.fork_rng(devices=[call.device.index], device_type="cuda"):
            torch.cuda.set_rng_state(call.rng, call.device)
            if call.host_rng is not None:
                torch.set_rng_state(call.host_rng)
            return call.func(*args, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(call.rng)
        return call.func(*args, **kwargs)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of ``device``'s default generator (the host's, or a GPU's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
