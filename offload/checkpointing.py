"""Activation checkpointing: forward keeps only each checkpointed block's inputs; backward recomputes the block.

(Under DeepSpeed's public name ``deepspeed.checkpointing``. Training checkpoints, the files a run saves and
resumes from, are another matter: offload/files/training_checkpoint.py and offload/engine/checkpoint_io.py.)

``checkpoint(function, *args)`` has the call shape of ``deepspeed.checkpointing.checkpoint``
and of ``torch.utils.checkpoint.checkpoint``; ``wrap_blocks(model)`` (the config switch
``offload.checkpoint_blocks``) checkpoints every transformer block of a model. Where the
saved inputs live is the ActivationStore's business, set from the config's
``activation_checkpointing`` section by ``offload.initialize``:

- on the compute device (the default);
- ``cpu_checkpointing``: in host memory, copied out on a copy stream as forward goes on,
  from buffers that are reused step after step and taken from the engine's host budget
  (running out is an error naming the budget, never an OOM). In backward, the input of
  the block recomputed next is copied back while the current one recomputes, so the
  copy hides under compute;
- ``partition_activations`` with a model-parallel group of W > 1 ranks (``configure``,
  as DeepSpeed's ``mpu_``): each rank keeps 1/W of every saved input and they are
  all-gathered before the recompute. Data-parallel ranks hold different activations,
  so there is nothing to partition over without such a group (it is then a logged no-op).

[Note: recompute and ZeRO] The recompute runs inside backward: modules called through
``__call__`` gather their units as in forward; the checkpointed block's own unit was
gathered already by the pre-backward hook on the block's outputs. Random state (CPU and
CUDA) and autocast are those of the original forward, so dropout masks match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from offload.machine.accelerator import Accelerator, CopyStream, Event
from offload.observe.telemetry import Telemetry
from offload.store.budget import BudgetExceeded, TierBudget
from offload.store.tier import Tier
from offload.zero.collectives import Group, all_gather

logger = logging.getLogger("offload.checkpointing")

HOST_PART = "activation checkpoints"


class CheckpointingError(RuntimeError):
    """Activation checkpointing cannot do what was asked; the message says what would work."""


@dataclass(frozen=True)
class CheckpointSettings:
    """The config's activation_checkpointing section, as the store uses it."""

    cpu_checkpointing: bool = False
    partition_activations: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass
class Saved:
    """One saved input: on the device (``tensor``), in host memory (``host``), or this rank's partition of it."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    tensor: torch.Tensor | None = None  # held on the device
    host: torch.Tensor | None = None  # host copy (flat; a partition when partitioned)
    copied: Event | None = None  # the copy into ``host`` (or back onto the device) is done
    source: torch.Tensor | None = None  # the device tensor a copy out still reads
    partitioned: bool = False  # ``tensor``/``host`` hold this rank's 1/W of the flat, padded input
    fetched: torch.Tensor | None = None  # brought back ahead of its recompute (device, flat)
    nbytes: int = 0  # bytes this rank keeps for it (device or host)


@dataclass
class ActivationStore:
    """Where the checkpointed inputs of the running forward live, and the bytes per tier (now and peak)."""

    accel: Accelerator
    settings: CheckpointSettings = field(default_factory=CheckpointSettings)
    host_budget: TierBudget = field(default_factory=lambda: TierBudget(Tier.HOST, None))
    telemetry: Telemetry = field(default_factory=Telemetry)
    group: Group | None = None  # model-parallel group for partition_activations
    device_bytes: int = 0
    peak_device_bytes: int = 0
    host_bytes: int = 0
    peak_host_bytes: int = 0
    saves: int = 0
    prefetched: int = 0  # inputs copied back ahead of their recompute
    _free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = field(default_factory=dict)
    _live: list[Saved] = field(default_factory=list)  # in save (forward) order
    _copy: CopyStream | None = None
    _events: list[Event] = field(default_factory=list)  # released inputs' copy events, re-recorded by later ones
    _compute_done: Event | None = None  # where the copy stream waits for compute (re-recorded)

    @property
    def partitions(self) -> int:
        return self.group.world if self.settings.partition_activations and self.group is not None else 1

    # ----------------------------------------------------------------- forward

    def save(self, t: torch.Tensor) -> Saved:
        saved = Saved(t.shape, t.dtype, t.device, t.requires_grad)
        self.saves += 1
        data = t.detach()
        if self.partitions > 1:
            data = self._partition(data)
            saved.partitioned = True
        if self.settings.cpu_checkpointing:
            self._reap()  # at most one copy out in flight: the device keeps at most one input beyond the running one
            host = self._host_tensor(data.numel(), data.dtype)
            stream = self._stream()
            stream.wait_event(self._after_compute())
            src = data.reshape(-1)
            stream.run(lambda: host.copy_(src, non_blocking=True))
            saved.host, saved.copied, saved.source = host, stream.record(into=self._event()), src
            saved.nbytes = host.numel() * host.element_size()
            self._count_device(data.numel() * data.element_size())  # until the copy out is done
            self.host_bytes += saved.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            saved.tensor, saved.nbytes = data, data.numel() * data.element_size()
            self._count_device(saved.nbytes)
        self._live.append(saved)
        return saved

    def _partition(self, data: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        world = self.group.world
        flat = data.reshape(-1)
        size = -(-flat.numel() // world)
        part = torch.zeros(size, dtype=data.dtype, device=data.device)
        lo = min(self.group.rank * size, flat.numel())
        hi = min(lo + size, flat.numel())
        part[:hi - lo].copy_(flat[lo:hi])
        return part

    def _host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer from the free list, or a new one taken from the host budget."""
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        nbytes = numel * dtype.itemsize
        try:
            self.host_budget.take(nbytes, HOST_PART)
        except BudgetExceeded as e:
            raise CheckpointingError(
                f"cpu_checkpointing needs {nbytes:,} more bytes of host memory for a saved block input, over "
                f"offload.budgets.host ({self.host_budget.limit:,} bytes, {self.host_budget.used:,} in use): raise "
                "the budget by the saved inputs of one forward (offload estimate --checkpointing shows them), lower "
                "the micro-batch, or turn cpu_checkpointing off") from e
        return self.accel.host_buffer(numel, dtype)[0]

    def _after_compute(self) -> Event:
        """An event after the compute issued so far, for the copy stream to wait on (the store's, re-recorded:
        a stream's wait takes the record of the moment it is issued)."""
        self._compute_done = self.accel.compute_event(into=self._compute_done)
        return self._compute_done

    def _event(self) -> Event | None:
        """An event to re-record for a saved input's copies, from those released inputs gave back (None: the
        stream makes one; after the first forward there are enough)."""
        return self._events.pop() if self._events else None

    def _reap(self) -> None:
        """Order compute after the copies out still in flight and drop their device tensors (the memory goes back
        to the allocator, for compute that now runs after the copy). A copy issued a whole block's compute ago is
        normally done: the wait is the bound on how far copies may fall behind, and a stream wait on a GPU (the
        host never blocks: see [Note: sync ledger] in offload/observe/sync_ledger.py)."""
        for saved in self._live:
            if saved.source is not None and saved.copied is not None:
                self.accel.compute_wait(saved.copied)
                self._count_device(-saved.source.numel() * saved.source.element_size())
                saved.source = None

    def _stream(self) -> CopyStream:
        if self._copy is None:
            self._copy = self.accel.copy_stream("activations")
        return self._copy

    def _count_device(self, nbytes: int) -> None:
        """Only the training thread counts (saves, reaps, restores): the copy stream never touches the counters."""
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    # ----------------------------------------------------------------- backward

    def restore(self, saved: Saved) -> torch.Tensor:
        """The saved input on the device (a new tensor, detached); starts bringing back the one before it."""
        index = next((i for i in range(len(self._live) - 1, -1, -1) if self._live[i] is saved), None)
        if index is None:
            raise CheckpointingError("a checkpointed block's saved input is gone: backward ran twice through the "
                                     "same checkpoint (retain_graph is not supported with activation checkpointing)")
        self._reap()
        flat = self._fetch(saved)
        if index > 0:
            self._prefetch(self._live[index - 1])  # backward recomputes the blocks in reverse order
        if saved.partitioned:
            assert self.group is not None
            full = torch.empty(flat.numel() * self.group.world, dtype=saved.dtype, device=saved.device)
            all_gather(full, flat, self.group)
            flat = full[:saved.shape.numel()]
        out = flat.reshape(saved.shape).detach()
        self._release(index)
        return out.requires_grad_(saved.requires_grad)

    def _prefetch(self, saved: Saved) -> None:
        """Start copying a host-held input back ahead of its recompute."""
        if saved.host is not None and saved.fetched is None:
            self._bring_back(saved)
            self.prefetched += 1

    def _bring_back(self, saved: Saved) -> None:
        assert saved.host is not None
        stream = self._stream()
        device = torch.empty(saved.host.numel(), dtype=saved.dtype, device=saved.device)
        stream.wait_event(self._after_compute())  # the buffer may reuse memory compute just freed
        host = saved.host
        stream.run(lambda: device.copy_(host, non_blocking=True))
        saved.fetched, saved.copied = device, stream.record(into=saved.copied or self._event())
        self._count_device(device.numel() * device.element_size())

    def _fetch(self, saved: Saved) -> torch.Tensor:
        if saved.tensor is not None:
            return saved.tensor.reshape(-1)
        with self.telemetry.span("activation_wait"):
            if saved.fetched is None:
                self._bring_back(saved)  # on demand: nothing brought it back ahead
            assert saved.fetched is not None and saved.copied is not None
            self.accel.compute_wait(saved.copied)
        return saved.fetched

    def _release(self, index: int) -> None:
        saved = self._live.pop(index)
        if saved.tensor is not None:
            self._count_device(-saved.nbytes)
        if saved.fetched is not None:
            self._count_device(-saved.fetched.numel() * saved.fetched.element_size())
        if saved.source is not None:
            self._count_device(-saved.source.numel() * saved.source.element_size())
        if saved.host is not None:
            self.host_bytes -= saved.nbytes
            self._free.setdefault((saved.host.numel(), saved.host.dtype), []).append(saved.host)
        if saved.copied is not None:  # its copies are done and waited for: the next saved input re-records it
            self._events.append(saved.copied)
        saved.tensor = saved.host = saved.fetched = saved.source = saved.copied = None

    def discard(self) -> None:
        """Forget the inputs of a forward whose backward will not run (eval, a failed backward)."""
        if not self._live:
            return
        if self._copy is not None:
            self._copy.synchronize()
        while self._live:
            self._release(len(self._live) - 1)

    def close(self) -> None:
        self.discard()
        self._free.clear()


# --------------------------------------------------------------------------- the autograd function

_store: ActivationStore | None = None  # set by offload.initialize (configure), like DeepSpeed's module state
_mp_group: Group | None = None
_configured = False  # configure() was called (DeepSpeed's is_configured)
_overrides: dict[str, bool] = {}  # the settings configure()'s keywords set, over the config's section


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None, *,
              store: ActivationStore | None = None, group: Any = None) -> None:
    """Set what ``checkpoint`` uses: the engine's store, and (for partition_activations) the model-parallel group,
    as an ``mpu_`` with get_model_parallel_group/rank/world_size (Megatron's) or a torch ProcessGroup. DeepSpeed's
    keywords override the config's activation_checkpointing section (``deepspeed_config``: a config, its path or
    dict, whose section is read first); contiguous_checkpointing and num_checkpoints have no effect (offload keeps
    each saved input in a buffer of its own pool)."""
    global _store, _mp_group, _configured
    _configured = True
    if deepspeed_config is not None:
        from offload.config import Config
        section = Config.load(deepspeed_config).activation_checkpointing
        _overrides.update(cpu_checkpointing=section.cpu_checkpointing,
                          partition_activations=section.partition_activations,
                          synchronize_checkpoint_boundary=section.synchronize_checkpoint_boundary,
                          profile=section.profile)
    for key, value in (("partition_activations", partition_activations), ("cpu_checkpointing", checkpoint_in_cpu),
                       ("synchronize_checkpoint_boundary", synchronize), ("profile", profile)):
        if value is not None:
            _overrides[key] = bool(value)
    if store is not None:
        _store = store
    if mpu_ is not None or group is not None:
        import torch.distributed as dist
        pg = mpu_.get_model_parallel_group() if mpu_ is not None else group
        _mp_group = Group(dist.get_rank(pg), dist.get_world_size(pg), pg)
    if _store is not None and _mp_group is not None:
        _store.group = _mp_group
    if _store is not None and _overrides:
        _store.settings = dataclasses.replace(_store.settings, **_overrides)


def is_configured() -> bool:
    """Whether ``configure`` was called (an engine calls it at initialize), as DeepSpeed's."""
    return _configured


def current_store(device: torch.device) -> ActivationStore:
    global _store
    if _store is None or _store.accel.device != device:
        _store = ActivationStore(Accelerator(device), dataclasses.replace(CheckpointSettings(), **_overrides),
                                 group=_mp_group)
    return _store


def reset() -> None:
    """Forget the configured store, group and overrides (an engine closing)."""
    global _store, _mp_group, _configured
    _store, _mp_group, _configured = None, None, False
    _overrides.clear()


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], store: ActivationStore, preserve_rng: bool, *args: Any) -> Any:
        ctx.run, ctx.store = run, store
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.rng = _rng_state(args) if preserve_rng else None
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), store.accel.device)
        ctx.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        if store.settings.synchronize_checkpoint_boundary:
            store.accel.synchronize()
        with store.telemetry.span("checkpoint_forward"):
            ctx.saved = [store.save(a) for a in args if isinstance(a, torch.Tensor)]
            with torch.no_grad():
                out = run(*args)
        if not isinstance(out, (torch.Tensor, tuple)):
            store.discard()
            raise CheckpointingError(f"a checkpointed function must return a tensor or a tuple, got "
                                     f"{type(out).__name__}; return the tensors (e.g. output.to_tuple())")
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        store: ActivationStore = ctx.store
        if store.settings.synchronize_checkpoint_boundary:
            store.accel.synchronize()
        with store.telemetry.span("recompute"):
            tensors = iter([store.restore(s) for s in ctx.saved])
            args = [next(tensors) if is_tensor else const
                    for is_tensor, const in zip(ctx.layout, ctx.constants, strict=True)]
            device_type, autocast, dtype = ctx.autocast
            with contextlib.ExitStack() as stack:
                if ctx.rng is not None:
                    stack.enter_context(torch.random.fork_rng(devices=ctx.rng[2], device_type=ctx.rng[3]))
                    _set_rng_state(ctx.rng)
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=autocast))
                out = ctx.run(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        it = iter(inputs)
        return (None, None, None) + tuple(next(it).grad if t else None for t in ctx.layout)


def checkpoint(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, use_reentrant: Any = None,
               **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its intermediate activations: they are recomputed in backward.

    Tensors in ``args`` are saved (where the configured store says); ``kwargs`` are kept as they are (keep tensors
    that need a gradient in ``args``). Outside grad mode it just calls ``function``."""
    return _checkpoint(None, function, args, kwargs, preserve_rng_state)


def _checkpoint(store: ActivationStore | None, function: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], preserve_rng_state: bool = True) -> Any:
    if kwargs:
        tensors_needing_grad = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if tensors_needing_grad:
            raise CheckpointingError(f"keyword arguments {tensors_needing_grad} need gradients: pass them "
                                     "positionally so the checkpoint saves them and returns their gradients")
        function = functools.partial(function, **kwargs)
    if not torch.is_grad_enabled():
        return function(*args)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None:
        raise CheckpointingError("checkpoint needs at least one tensor argument (the block's input)")
    return _Checkpoint.apply(function, store or current_store(device), preserve_rng_state, *args)


def _rng_state(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None, list[int], str]:
    cuda = [a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
    devices = sorted({d for d in cuda if d is not None})
    state = torch.cuda.get_rng_state(devices[0]) if devices else None
    return torch.get_rng_state(), state, devices, "cuda"


def _set_rng_state(rng: tuple[torch.Tensor, torch.Tensor | None, list[int], str]) -> None:
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], rng[2][0])


# --------------------------------------------------------------------------- whole blocks


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: its ``_no_split_modules`` classes (Hugging Face), else the children of the
    longest ModuleList whose children share one class and hold parameters."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(c) for c in module}) == 1 \
                and any(True for _ in module.parameters()):
            best = list(module)
    return best


def wrap_blocks(model: nn.Module, store: ActivationStore | None = None) -> int:
    """Checkpoint every transformer block of ``model`` (its forward goes through ``checkpoint``, saving into
    ``store``: the engine's, so two engines in one process keep their own); returns how many."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise CheckpointingError(f"found no transformer blocks in {type(model).__name__} (no _no_split_modules and "
                                 "no ModuleList of same-class modules): call offload.checkpointing.checkpoint(block, "
                                 "x) in the model's forward instead")
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache would be appended to again by the recompute
        logger.info("activation checkpointing: set the model's config.use_cache to False")
    for block in blocks:
        if getattr(block, "_offload_checkpointed", False):
            continue
        block.forward = _checkpointed(block.forward, store)
        block._offload_checkpointed = True  # type: ignore[assignment]  # a flag, not a tensor or module
    return len(blocks)


def _checkpointed(forward: Callable[..., Any], store: ActivationStore | None) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _checkpoint(store, forward, args, kwargs)
    return run

