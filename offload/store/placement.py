"""Where one rank's state goes, decided before anything is allocated: one pure function.

``plan`` takes what is placed (``Shards``: the units' shard sizes, which of them train, the
compute dtype's size), the config, and three policies that travel whole: what the ZeRO stage
makes of the shards (``StageLayout``), what the machine offers (``MachineOffer``) and what the
step's schedule asks (``StepAsks``); it returns a ``Placement``: each parameter shard's home, the optimizer's
sub-groups with their tiers, the bytes reserved up front on the host and on NVMe, by
part, and what stays on the device between uses with the room left there for gathered
units. Every budget check of start-up is made here, in the order start-up meets them,
as a ConfigError naming the budget (``Placement.problems``; ``check`` raises the first).
The stores then allocate what the plan says and take from the budgets as they go, so
going over a budget while training is a bug in this plan. ``offload estimate`` calls the
same function, so an estimate is the engine's own plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from offload.config import AUTO, ConfigError
from offload.machine.buffers import round_up
from offload.store.budget import TierBudget
from offload.store.param_homes import HOST_PARAMS, WRITE_BUFFERS, param_buffer_bytes, place_params, plan_homes
from offload.store.slots import layout
from offload.store.state_format import MOMENTS, Master, StateFormat, from_config
from offload.store.step_cost import Rates, StepPrediction, Traffic, best, predict
from offload.store.sub_groups import (
    RING_SLOTS,
    SPECULATIVE_SLOT,
    STREAMED_COPIES,
    STREAMED_HANDED,
    STREAMED_SLOTS,
    SubGroup,
    nvme_buffers,
    place_sub_groups,
    plan_sub_groups,
    sub_group_elements,
)
from offload.store.tier import Tier

HELD_GRADS = "gradients held until the step"  # see host_parts


def host_parts(sizes: list[tuple[int, int]], no_copy: set[int], item: int, *, landing: bool = True,
               accumulators: bool = True, held: bool = False,
               on_device: frozenset[int] | set[int] = frozenset()) -> dict[str, int]:
    """Host bytes an offloaded optimizer reserves besides its state, by part: fp32 gradient accumulators (with
    ``accumulators``: a step of one micro-batch reads gradients where they land instead, see [Note: gradients
    read where they land] in offload/optim/landing.py; none for the units accumulated ``on_device``),
    compute-dtype copies of the new shards (not for ``no_copy``: shards homed on NVMe, or read in place), with
    ``landing`` one landing buffer per shard for its gradient (see [Note: gradients land] there): compute dtype,
    or fp32 for a unit whose accumulated sum comes over once (see [Note: gradients accumulated on the device]
    there), and with ``held`` the gradients a CPU device reads where they land: the reduced shards themselves,
    in the compute dtype, kept until the step."""
    parts = {"gradient accumulators": 4 * sum(n for i, n in sizes if i not in on_device) if accumulators else 0,
             "parameter copies": item * sum(n for i, n in sizes if i not in no_copy)}
    if landing:
        parts["gradient landing"] = sum((4 if i in on_device else item) * n for i, n in sizes)
    if held:
        parts[HELD_GRADS] = item * sum(n for i, n in sizes if i not in on_device)
    return {what: n for what, n in parts.items() if n}


class Speculation(Enum):
    """Which sub-groups the speculative step is asked to run on, before any budget is looked at (the step's
    schedule asks: offload/engine/step_schedule.py)."""

    NONE = "none"
    NVME = "nvme"  # the NVMe ones, whose swap files have a second slot
    ALL = "all"  # the host's too, with a second slot of their state where the host budget holds it


@dataclass(frozen=True)
class Shards:
    """What is placed: one rank's units."""

    sizes: list[tuple[int, int]]  # (unit, shard elements), in unit order
    trained: set[int] | frozenset[int]  # the units the optimizer steps
    item: int  # bytes an element of the compute dtype
    held: tuple[str, ...] = MOMENTS  # the moment buffers the optimizer keeps of each (offload/optim/hyper.py)

    def state_format(self, config: Any) -> StateFormat:
        """How their state is held: the config's format, with the moments the update keeps."""
        return from_config(config).holding(self.held)

    @property
    def trained_sizes(self) -> list[tuple[int, int]]:
        return [(i, n) for i, n in self.sizes if i in self.trained]


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """What the ZeRO stage makes of the shards."""

    parts: int = 1  # each unit is split in this many (the ranks it is sharded over)
    resident_params: bool = False  # every unit stays whole on the device (stages 0-2)
    whole_grads: int = 0  # elements of gradient kept whole in ``.grad`` until the last micro-batch (stages 0-1)


@dataclass(frozen=True, kw_only=True)
class MachineOffer:
    """What the machine offers the plan."""

    # The compute device has memory of its own (a GPU); a CPU device reads host memory in place, so gradients need
    # no landing buffers and device-homed shards no host copies (see [Note: host memory is the device's] in
    # offload/store/param_store.py).
    discrete: bool = True
    # Bytes free on the device at start, which bound the gradient accumulators kept there when no device budget is
    # set (None: no bound).
    device_free: int | None = None
    # The device bytes the first step's refit leaves offload beside the activations (offload/engine/refit.py),
    # which auto fills as it fills a device budget: the split the refit ends with, as ``offload estimate``
    # predicts it.
    refit_room: int | None = None
    # What auto chooses its split by (see [Note: auto by rates]; None: state first, as much as the room holds).
    rates: Rates | None = None


@dataclass(frozen=True, kw_only=True)
class StepAsks:
    """What the step's schedule asks of the plan before any budget is looked at (offload/engine/step_schedule.py)."""

    speculation: Speculation = Speculation.NONE  # which sub-groups the step speculates on
    delayed: bool = False  # the delayed update stages each new shard in a host buffer of its own
    not_streamed: str = ""  # why the update cannot run in the streamed lane (empty: it can)


@dataclass
class Placement:
    homes: dict[int, Tier]  # every unit's compute-dtype shard
    nvme_params: list[tuple[int, int]]  # (unit, shard elements) homed on NVMe, in unit order
    groups: list[SubGroup]  # the optimizer's sub-groups of the trained shards, each with its tier
    placed: bool  # the sub-groups got their tiers (a host budget too small for them leaves them unplaced)
    step_buffers: dict[str, int] = field(default_factory=dict)  # host_parts: what an offloaded optimizer takes
    host: dict[str, int] = field(default_factory=dict)  # bytes reserved up front, by part
    nvme: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)  # bytes kept on the device between uses, by part
    gather_room: int | None = None  # elements the device budget leaves for gathered units (None: no budget)
    device_accumulated: frozenset[int] = frozenset()  # units whose fp32 gradient accumulator is on the device
    state_on_device: frozenset[int] = frozenset()  # offloaded optimizer, units whose state stays on the device
    # offloaded to the host, units whose state the device steps, streamed over the bus (``_plan_streamed``)
    streamed: frozenset[int] = frozenset()
    # Units compute reads where their shard lives, never gathered: one rank's device homes on a GPU ([Note: reading
    # the home] in offload/store/param_store.py). They need no gather room.
    aliased: frozenset[int] = frozenset()
    # The delayed update's units whose new shard waits in a staging buffer: compute reads (or gathers from) the
    # step's target. A device home's separate host copy is written in place; only its copy back waits.
    staged: frozenset[int] = frozenset()
    # One micro-batch a step, the state offloaded to the host or NVMe: the optimizer reads each gradient where it
    # lands and makes no fp32 accumulators (offload/optim/landing.py: [Note: gradients read where they land]). The
    # plan owns this fact: the budget counts accumulators exactly when it is false (and, on a CPU device, the
    # gradients held until the step when it is true).
    grads_read_where_they_land: bool = False
    # One 16-bit micro-batch a step: a unit stepped on the device keeps its one gradient as it was reduced until the
    # step, instead of an fp32 accumulator (offload/optim/sharded.py: [Note: a device gradient kept as it landed]).
    device_grads_kept: bool = False
    state_fits_device: bool = False  # the whole optimizer state would fit in the device's room
    speculative: bool = False  # the step speculates (host sub-groups with a second slot, NVMe ones, or both)
    speculative_why: str = ""  # why not, when it was asked for
    problems: list[ConfigError] = field(default_factory=list)  # in the order start-up meets them

    def gathered(self, shard_sizes: list[tuple[int, int]]) -> list[int]:
        """Shard elements of the units that are gathered around their use (all but ``aliased``)."""
        return [n for i, n in shard_sizes if i not in self.aliased]

    def check(self) -> None:
        """Raise the first budget the plan does not fit (what initialize refuses)."""
        if self.problems:
            raise self.problems[0]


def plan(shards: Shards, config: Any, stage: StageLayout = StageLayout(), machine: MachineOffer = MachineOffer(),
         step: StepAsks = StepAsks()) -> Placement:
    """The placement of one rank's ``shards`` under ``config``, as the stage lays them out, the machine offers and
    the step asks. Raises only for a setting that no budget could fix (offload_param.buffer_size below a shard)."""
    shard_sizes, trained, item = shards.sizes, shards.trained, shards.item
    discrete = machine.discrete
    zero = config.zero_optimization
    one_micro_batch = (config.gradient_accumulation_steps or 1) == 1  # a step's gradients are each unit's only ones
    host_limit, nvme_limit = config.offload.budgets.host, config.offload.budgets.nvme
    param, opt = zero.offload_param, zero.offload_optimizer
    nvme_params = place_params(shard_sizes, param) if param.device == "nvme" else []
    off_device = Tier.HOST if param.device != "none" else Tier.DEVICE
    homes = {i: off_device for i, _ in shard_sizes} | {i: Tier.NVME for i, _ in nvme_params}
    trained_sizes = shards.trained_sizes
    fmt = shards.state_format(config)
    out = Placement(homes, nvme_params, plan_sub_groups(trained_sizes, sub_group_elements(zero), fmt=fmt), False)
    out.device_grads_kept = one_micro_batch and item == 2
    alias = stage.parts == 1 and discrete and not stage.resident_params
    if alias:
        out.aliased = frozenset(i for i, h in homes.items() if h is Tier.DEVICE)
    _plan_device_resident(out, shards, config, stage)
    if opt.device != "none" and trained_sizes:
        _plan_state_on_device(out, shards, config, stage, machine, step)
        if alias:  # the units homed on the device beside offloaded parameters are read there too
            out.aliased = frozenset(i for i, h in homes.items() if h is Tier.DEVICE)
    if trained_sizes:  # with the state kept on the device, a share to stream is refused by name
        _plan_streamed(out, shards, config, discrete, step.not_streamed)
    nvme_params = out.nvme_params
    offloaded_sizes = [(i, n) for i, n in trained_sizes if i not in out.state_on_device and i not in out.streamed]
    # Several micro-batches a step on a GPU, gradients reduced once a step (stage 3): an offloaded optimizer's
    # accumulators go on the device as far as its room allows (see [Note: gradients accumulated on the device]).
    sums_on_device = (opt.device != "none" and discrete and not one_micro_batch and not stage.whole_grads
                      and config.offload.accumulate_on_device)
    if sums_on_device and offloaded_sizes:
        _plan_device_accumulators(out, shards, offloaded_sizes, config, stage, machine.device_free)

    if nvme_params:
        nvme_homes, file_bytes = plan_homes(nvme_params, item)
        buffers = param_buffer_bytes([n for _, n in nvme_params], item, param.buffer_count)
        if nvme_limit is not None and file_bytes > nvme_limit:
            out.problems.append(ConfigError(
                "offload.budgets.nvme", f"{nvme_limit:,} bytes cannot hold the parameter shards on NVMe: "
                f"{file_bytes:,} bytes (two slots per unit) beside 0 already planned; raise the budget, keep more "
                "parameters on the host (offload_param.max_in_cpu), or use more ranks"))
        if host_limit is not None and buffers > host_limit:
            largest = max(h.nbytes for h in nvme_homes.values())
            out.problems.append(ConfigError(
                "offload.budgets.host", f"{host_limit:,} bytes cannot hold the {param.buffer_count} + "
                f"{WRITE_BUFFERS} parameter NVMe buffers of {largest:,} bytes (one unit's shard) beside 0 already "
                "planned; raise the budget, lower offload_param.buffer_count or offload.unit_bytes"))
        out.nvme["parameter shards (two slots per unit)"] = file_bytes
        out.host["parameter NVMe buffers"] = buffers

    if opt.device != "none" and offloaded_sizes:
        # Read in place, a device home's host copy is the device shard, unless NVMe state keeps copies apart.
        in_place = set() if discrete or opt.device == "nvme" else {i for i, h in homes.items() if h is Tier.DEVICE}
        # One micro-batch a step: the gradient is read where it lands, whether the state is stepped from host
        # memory or from NVMe (the landing keeps it until the step commits, so a pass that fails and steps again
        # still finds it), and no fp32 accumulator is made.
        out.grads_read_where_they_land = one_micro_batch
        step_buffers = out.step_buffers = host_parts(offloaded_sizes, {i for i, _ in nvme_params} | in_place, item,
                                                     landing=discrete,
                                                     accumulators=not out.grads_read_where_they_land,
                                                     held=not discrete and out.grads_read_where_they_land,
                                                     on_device=out.device_accumulated)
        if step.delayed:
            out.staged = frozenset(i for i, _ in offloaded_sizes if not (discrete and homes[i] is Tier.DEVICE))
            if out.staged:
                step_buffers["delayed update copies"] = item * sum(n for i, n in offloaded_sizes if i in out.staged)
        if host_limit is not None and sum(step_buffers.values()) > host_limit:
            out.problems.append(ConfigError(
                "offload.budgets.host", f"{host_limit:,} bytes cannot hold this rank's gradient accumulators and "
                f"parameter copies ({', '.join(f'{k} {v:,}' for k, v in step_buffers.items())}), before any "
                "optimizer state; raise the budget or use more ranks"))
        out.host.update(step_buffers)
    if opt.device == "nvme" and out.streamed:
        # a device home's new weights from NVMe state streamed leave through a host copy, as the host lane's do
        # ([Note: NVMe state streamed] in offload/optim/streamed_step.py; host-tier sub-groups' go straight down)
        copies = item * sum(n for i, n in trained_sizes if i in out.streamed and homes[i] is Tier.DEVICE)
        if copies:
            out.step_buffers[STREAMED_COPIES] = out.host[STREAMED_COPIES] = copies

    _lend_highs(out, config, step)
    budget = TierBudget(Tier.HOST, host_limit, used=sum(out.host.values()))
    try:
        place_sub_groups(out.groups, opt.device, budget, opt.buffer_count, spare=step.speculation is Speculation.ALL)
        out.placed = True
        if opt.device == "nvme" and STREAMED_HANDED in out.device:  # host-tier sub-groups alone: as counted
            _hand_over_host_tier_only(out, shards)
    except ConfigError as e:
        out.problems.append(e)
    if out.placed:
        _plan_optimizer_state(out, nvme_limit, opt.buffer_count)
    _plan_host_params(out, shards, trained - out.state_on_device - out.streamed if opt.device != "none" else set(),
                      host_limit)
    if step.speculation is not Speculation.NONE and out.placed:  # last: it is the one part that may be left out
        _plan_speculative_slot(out, host_limit, spare=step.speculation is Speculation.ALL)
    _check_device(out, shards, config, stage)
    return out


def _lend_highs(out: Placement, config: Any, step: StepAsks) -> None:
    """Host sub-groups of a 16+16 master whose high halves are the weights (see [Note: the weights are the high
    half] in offload/store/optimizer_state.py): the state offloaded to the host, where no step writes a second
    place first (the speculative slot, the delayed update), each unit's weights homed off NVMe. A refit (auto)
    takes the high halves back into the state it moves to the device."""
    opt = config.zero_optimization.offload_optimizer
    if (opt.device != "cpu" or step.delayed or step.speculation is Speculation.ALL
            or not out.groups or out.groups[0].fmt.master is not Master.SPLIT):
        return
    for g in out.groups:
        if (g.tier is not Tier.DEVICE and not g.streamed
                and all(out.homes[m.unit] is not Tier.NVME for m in g.members)):
            g.fmt = g.fmt.high_in_params()


def _plan_optimizer_state(out: Placement, nvme_limit: int | None, buffer_count: int) -> None:
    on_host = [g for g in out.groups if g.tier is Tier.HOST]
    on_nvme = [g for g in out.groups if g.tier is Tier.NVME]
    if on_host:
        out.host["optimizer state"] = sum(g.nbytes for g in on_host)
    if on_nvme:
        file_bytes = layout([(g.index, g.nbytes) for g in on_nvme])[1]
        used = sum(out.nvme.values())
        if nvme_limit is not None and used + file_bytes > nvme_limit:
            out.problems.append(ConfigError(
                "offload.budgets.nvme", f"{nvme_limit:,} bytes cannot hold the optimizer state on NVMe: "
                f"{file_bytes:,} bytes ({sum(g.numel for g in on_nvme):,} elements x "
                f"{on_nvme[0].fmt.bytes_per_element} bytes, two slots each so a "
                "failed step never loses the last one); raise the budget, give the host a larger budget "
                "(offload.budgets.host), or use more ranks"))
        count, size = nvme_buffers(on_nvme, buffer_count)
        out.nvme["optimizer state (two slots per sub-group)"] = file_bytes
        out.host["optimizer NVMe buffers"] = count * size


def _plan_speculative_slot(out: Placement, host_limit: int | None, spare: bool) -> None:
    """The speculative step's second slot of every host sub-group, if the host budget holds it beside the rest
    (else the step says why it does not speculate); NVMe sub-groups have theirs in the swap file."""
    on_host = [g for g in out.groups if g.tier is Tier.HOST and not g.streamed] if spare else []
    need, used = sum(g.nbytes for g in on_host), sum(out.host.values())
    if not any(g.tier is Tier.NVME for g in out.groups) and not on_host:
        out.speculative_why = "no optimizer state is offloaded" if spare else "no optimizer state is on NVMe"
    elif host_limit is not None and used + need > host_limit:
        out.speculative_why = (f"offload.budgets.host ({host_limit:,} bytes) cannot hold its second slot of the "
                               f"optimizer state ({need:,} bytes beside {used:,} planned); raise it to speculate")
    else:  # NVMe sub-groups use their swap file's second slot
        if need:
            out.host[SPECULATIVE_SLOT] = need
        out.speculative = True


def _plan_host_params(out: Placement, shards: Shards, stepped_on_host: set[int] | frozenset[int],
                      host_limit: int | None) -> None:
    """Host-homed shards the optimizer does not step there (frozen units; every unit when the optimizer stays on
    the device): the parameter store holds them in host buffers of its own."""
    shard_sizes, item = shards.sizes, shards.item
    own = sum(round_up(n * item) for i, n in shard_sizes
              if out.homes[i] is Tier.HOST and i not in stepped_on_host)
    if not own:
        return
    used = sum(out.host.values())
    if host_limit is not None and used + own > host_limit:
        out.problems.append(ConfigError(
            "offload.budgets.host", f"{host_limit:,} bytes cannot hold the parameter shards kept on the host that "
            f"the optimizer does not step there ({own:,} bytes) beside {used:,} already planned; raise the budget, "
            "or use more ranks"))
    out.host[HOST_PARAMS] = own


def _plan_device_resident(out: Placement, shards: Shards, config: Any, stage: StageLayout) -> None:
    """What stays on the device between uses, gradient accumulators of an offloaded optimizer aside."""
    shard_sizes, trained_sizes, item = shards.sizes, shards.trained_sizes, shards.item
    parts, resident_params, whole_grads = stage.parts, stage.resident_params, stage.whole_grads
    offloaded = config.zero_optimization.offload_optimizer.device != "none"
    if resident_params:
        out.device["parameters"] = item * parts * sum(n for _, n in shard_sizes)
    else:
        out.device["shards"] = item * sum(n for i, n in shard_sizes if out.homes[i] is Tier.DEVICE)
    if whole_grads:
        out.device["gradients (whole, in .grad)"] = item * whole_grads
    if not offloaded and trained_sizes:
        out.device["optimizer state"] = sum(g.nbytes for g in out.groups)
        part, per_element = device_grads(out.device_grads_kept, item)
        out.device[part] = per_element * sum(n for _, n in trained_sizes)


def _device_room(out: Placement, shards: Shards, config: Any, stage: StageLayout, device_free: int | None,
                 refit_room: int | None = None) -> int | None:
    """Bytes the device can give to optimizer state and gradient accumulators: the device budget (or the room a
    refit leaves, ``refit_room``) less what is planned there and the gathers (twice the largest unit and a
    prefetch bucket), or without a budget half of what was free at start less those (the rest is the
    activations'); None: nothing bounds it (a CPU device without a budget)."""
    budget = config.offload.budgets.device if refit_room is None else refit_room
    if budget is None and device_free is None:
        return None
    taken = sum(out.device.values()) + gather_bytes(out, shards, config, stage)
    if budget is not None:
        return budget - taken
    assert device_free is not None  # neither bounding it returned None above
    return (device_free - taken) // 2


def gather_bytes(out: Placement, shards: Shards, config: Any, stage: StageLayout) -> int:
    """Device room the gathers may take at once: two units besides a prefetch bucket (a tied embedding stays
    through backward), over the units that are gathered at all (not ``out.aliased``)."""
    gathered, parts, item = out.gathered(shards.sizes), stage.parts, shards.item
    if not gathered:
        return 0
    bucket = min(int(config.zero_optimization.stage3_prefetch_bucket_size), parts * sum(gathered))
    return (2 * max(gathered) * parts + bucket) * item


KEPT_GRADS = "gradients (16-bit, kept from backward to the step)"


def device_grads(kept: bool, item: int) -> tuple[str, int]:
    """The device part that holds the gradients of the units stepped there, and its bytes an element: an fp32
    accumulator, or the one 16-bit gradient of a step kept as it landed (``Placement.device_grads_kept``)."""
    return (KEPT_GRADS, item) if kept else ("gradient accumulators", 4)


def _plan_state_on_device(out: Placement, shards: Shards, config: Any, stage: StageLayout,
                          machine: MachineOffer, step: StepAsks) -> None:
    """A partial optimizer offload (offload_optimizer.ratio below 1, or auto): the optimizer state of the first
    units, the ones the next forward needs first, stays on the device with an fp32 gradient accumulator each, and
    is stepped there. ratio r keeps the units nearest (1 - r) of the elements; auto, within the device's room
    (none where nothing bounds it: a CPU device's memory is the host's), as many as make the fastest step at
    ``rates`` with the state offloaded to the host (see [Note: auto by rates]), or without them (or with the state
    on NVMe) as many as the room holds. Beside offloaded parameters
    the kept units' shards are homed on the device too (see [Note: a split beside offloaded parameters]).
    offload.stream_state auto streams the next units' state by the same rates (see [Note: three lanes by rates])."""
    zero = config.zero_optimization
    shard_sizes, trained_sizes, item, rates = shards.sizes, shards.trained_sizes, shards.item, machine.rates
    ratio, params_offloaded = zero.offload_optimizer.ratio, zero.offload_param.device != "none"
    room = _device_room(out, shards, config, stage, machine.device_free, machine.refit_room)
    # state (a sub-group each at worst), the gradient (an fp32 accumulator, or the 16-bit one kept) and, beside
    # offloaded parameters, the shard itself
    part, grad_bytes = device_grads(out.device_grads_kept, item)
    fmt = shards.state_format(config)
    cost = [(i, n, round_up(fmt.slot_bytes(n)) + grad_bytes * n + (item * n if params_offloaded else 0))
            for i, n in trained_sizes]
    out.state_fits_device = room is not None and sum(c for *_, c in cost) <= room
    priced = (room is not None and rates is not None and rates.prices_a_split
              and zero.offload_optimizer.device == "cpu")
    lanes = Lanes(cost, shards, room or 0, rates or Rates(), config,
                  priced and streams_by_rates(config, machine, step), grad_bytes)
    chosen: list[tuple[int, int]] = []
    spare, streamed = 0, 0
    if ratio is AUTO:
        if room is None:
            return  # a CPU device without a budget gains nothing
        # On NVMe the disk's rate is not measured at start-up: state first there (offload/engine/rates.py).
        if priced:
            k, streamed = lanes.fastest(range(len(cost) + 1))
        else:  # state first: as many units as the room holds
            k, used = 0, 0
            while k < len(cost) and used + cost[k][2] <= room:
                used += cost[k][2]
                k += 1
        chosen = [(i, n) for i, n, _ in cost[:k]]
        spare = room - sum(c for *_, c in cost[:k]) - lanes.streamed_bytes(k, streamed)
    else:
        chosen = nearest_prefix(trained_sizes, 1 - ratio) if ratio < 1 else []
        if lanes.stream:
            streamed = lanes.fastest([len(chosen)], home_spare=False)[1]
    if chosen:
        out.state_on_device = frozenset(i for i, _ in chosen)
        out.groups = plan_sub_groups(trained_sizes, sub_group_elements(zero), out.state_on_device,
                                     shards.state_format(config))
        out.device["optimizer state"] = sum(g.nbytes for g in out.groups if g.tier is Tier.DEVICE)
        out.device[part] = grad_bytes * sum(n for _, n in chosen)
    if params_offloaded:
        _home_on_device(out, shard_sizes, item, out.state_on_device, spare)
    if streamed:
        _stream(out, shards, config, [(i, n) for i, n, _ in cost[len(chosen):len(chosen) + streamed]])


def nearest_prefix(sizes: list[tuple[int, int]], share: float) -> list[tuple[int, int]]:
    """The first (unit, elements) of ``sizes`` whose elements come nearest ``share`` of all of them (the units the
    next forward needs first): offload_optimizer.ratio's device share, offload.stream_state's streamed one."""
    target, total, chosen = share * sum(n for _, n in sizes), 0, []
    for i, n in sizes:
        if total + n / 2 > target:
            break
        chosen.append((i, n))
        total += n
    return chosen


def _plan_streamed(out: Placement, shards: Shards, config: Any, discrete: bool, not_streamed: str) -> None:
    """offload.stream_state s: of the units whose optimizer state is offloaded (to the host, or to NVMe through the
    host: [Note: NVMe state streamed] in offload/optim/streamed_step.py), the first ones (the next forward's first)
    nearest s of their elements are stepped on the device, their state streamed over the bus each step (see
    [Note: the streamed lane] in offload/optim/streamed_step.py): their gradients stay on the device
    as a device-stepped unit's do, and a ring of ``RING_SLOTS`` of the largest such sub-group's state takes device
    memory.
    On a CPU device, whose memory is the host's, there is no bus to stream over: nothing is streamed; nor where the
    update cannot run in the lane (``not_streamed`` says why)."""
    share = config.offload.stream_state
    if share is AUTO or not share:
        return  # auto: chosen with the device's state by rates (``_plan_state_on_device``)
    if not_streamed:
        out.problems.append(ConfigError("offload.stream_state", f"{not_streamed}, so no state is streamed: set it "
                                                                "to 0 or auto"))
        return
    if not discrete:
        return
    zero = config.zero_optimization
    if zero.offload_optimizer.device == "none":
        out.problems.append(ConfigError(
            "offload.stream_state", "streams optimizer state homed on the host or NVMe; offload_optimizer.device "
            "'none' keeps it all on the device already: set offload_optimizer.device to cpu or nvme, or "
            "offload.stream_state to 0"))
        return
    chosen = nearest_prefix([(i, n) for i, n in shards.trained_sizes if i not in out.state_on_device], share)
    if chosen:
        _stream(out, shards, config, chosen)


def _stream(out: Placement, shards: Shards, config: Any, chosen: list[tuple[int, int]]) -> None:
    """The ``chosen`` units' state streamed: their own sub-groups, their gradients and the ring on the device
    (``RING_SLOTS`` of the largest one's state: offload/optim/streamed_step.py), and the new weights of those
    homed off the device, handed to their next gather (the whole step's at once, at most: [Note: the hand-off] in
    offload/store/param_store.py)."""
    zero = config.zero_optimization
    out.streamed = frozenset(i for i, _ in chosen)
    out.groups = plan_sub_groups(shards.trained_sizes, sub_group_elements(zero), out.state_on_device,
                                 shards.state_format(config), streamed=out.streamed)
    part, grad_bytes = device_grads(out.device_grads_kept, shards.item)
    out.device[part] = out.device.get(part, 0) + grad_bytes * sum(n for _, n in chosen)
    out.device[STREAMED_SLOTS] = RING_SLOTS * max(g.nbytes for g in out.groups if g.streamed)
    handed = shards.item * sum(n for i, n in chosen if out.homes[i] is not Tier.DEVICE)  # less NVMe's: below
    if handed:
        out.device[STREAMED_HANDED] = handed


def _hand_over_host_tier_only(out: Placement, shards: Shards) -> None:
    """Once the sub-groups are placed: the streamed ones placed on NVMe hand no weights to the next gather (theirs
    are written on the host by the step's pass, as the host lane's are), so the device keeps no bytes for them."""
    through_host = _streamed_nvme(out)
    handed = shards.item * sum(n for i, n in shards.sizes
                               if i in out.streamed and out.homes[i] is not Tier.DEVICE and i not in through_host)
    if handed:
        out.device[STREAMED_HANDED] = handed
    else:
        out.device.pop(STREAMED_HANDED)


def _streamed_nvme(out: Placement) -> frozenset[int]:
    """The streamed units whose state is homed on NVMe (stepped in the step's NVMe pass, through the host: see
    [Note: NVMe state streamed] in offload/optim/streamed_step.py)."""
    return frozenset(m.unit for g in out.groups if g.streamed and g.tier is Tier.NVME for m in g.members)


def streams_by_rates(config: Any, machine: MachineOffer, step: StepAsks) -> bool:
    """Whether offload.stream_state auto may stream state (its share then chosen by rates): a device with memory of
    its own (a CPU device's is the host's: nothing to stream), the state offloaded to the host (NVMe state is not
    streamed yet), no delayed update (whose Adam runs on the host alone), an update the lane can run."""
    return (config.offload.stream_state is AUTO and machine.discrete and not step.delayed and not step.not_streamed
            and config.zero_optimization.offload_optimizer.device == "cpu")


STREAM_CHOICES = 48  # shares of the streamable units weighed, at most (every count where there are fewer units)


class Lanes:
    """[Note: auto by rates] With the host's Adam rate and the bus's known, auto keeps on the device the state of
    the first k units (``cost``: (unit, elements, device bytes) in the order of need) for the k whose step is
    fastest at ``rates`` (offload/store/step_cost.py: the longest lane, then the sum), each k's leftover room homing
    shards as [Note: a split beside offloaded parameters] says, rather than as many as fit. Moving state shortens
    the host's Adam and lengthens the GPU's lane by the device Adam; the room it takes cannot keep parameters from
    crossing the bus. So once the host's share of Adam fits under the GPU's compute (unknown at start-up: taken
    as none) or under the parameters' crossing, more state buys nothing, and the room is better spent homing
    shards. The state-first choice is one of the candidates: by these rates it is never faster by more than the
    tie (1%) the sum decides within.

    [Note: three lanes by rates] With offload.stream_state auto the same prices choose a third share: after the k
    units kept on the device, the next j have their state streamed (homed on the host, stepped on the device: see
    [Note: the streamed lane] in offload/optim/streamed_step.py). Streaming j units costs the device their
    gradients and the ring their state passes through (not their state), takes their Adam off the host's lane and
    puts it on the GPU's, sends their state up and down the bus (and, for a host home, their new weights down),
    and keeps their gradients off the bus down. Every (k, j) the room holds is weighed (j on a grid of
    ``STREAM_CHOICES`` where there are more units): the host's Adam and the bus then meet near where the longer of
    them is shortest. A fixed offload_optimizer.ratio fixes k (and homes no shard beyond its units), and auto weighs
    j alone."""

    def __init__(self, cost: list[tuple[int, int, int]], shards: Shards, room: int, rates: Rates, config: Any,
                 stream: bool, grad_bytes: int) -> None:
        """``stream``: whether j may be above 0; ``grad_bytes``: a device gradient's bytes an element."""
        self.cost, self.shards, self.room, self.rates, self.config = cost, shards, room, rates, config
        self.stream, self.grad_bytes = stream, grad_bytes
        self.params_offloaded = config.zero_optimization.offload_param.device != "none"

    def streamed_bytes(self, k: int, j: int) -> int:
        """Device bytes of streaming the j units after the first k: their gradients, the ring (``RING_SLOTS`` of
        the largest one's state: a streamed unit is a sub-group alone) and, beside offloaded parameters, their new
        weights handed to the next gather (as if none of their shards were homed on the device)."""
        units = [n for _, n, _ in self.cost[k:k + j]]
        if not units:
            return 0
        slot = round_up(self.shards.state_format(self.config).slot_bytes(max(units)))
        handed = self.shards.item * sum(units) if self.params_offloaded else 0
        return self.grad_bytes * sum(units) + RING_SLOTS * slot + handed

    def fastest(self, ks: Sequence[int], home_spare: bool = True) -> tuple[int, int]:
        """The (k, j) of the fastest step, k one of ``ks`` (ascending); ``home_spare``: each candidate's leftover
        room homes the next shards (auto), else only the k units' shards are homed on the device."""
        candidates: list[tuple[StepPrediction, tuple[int, int]]] = []
        for k in ks:
            used = sum(c for *_, c in self.cost[:k])
            if used > self.room and candidates:
                break
            for j in self._stream_counts(k):
                extra = self.streamed_bytes(k, j)
                if j and used + extra > self.room:
                    break
                spare = self.room - used - extra if home_spare else 0
                candidates.append((self._predict(k, j, spare), (k, j)))
        return best(candidates)

    def _stream_counts(self, k: int) -> list[int]:
        rest = len(self.cost) - k if self.stream else 0
        if rest <= STREAM_CHOICES:
            return list(range(rest + 1))
        return sorted({round(x * rest / STREAM_CHOICES) for x in range(STREAM_CHOICES + 1)})

    def _predict(self, k: int, j: int, spare: int) -> StepPrediction:
        sizes, item = self.shards.sizes, self.shards.item
        stepped_there = frozenset(i for i, _, _ in self.cost[:k])
        streamed = frozenset(i for i, _, _ in self.cost[k:k + j])
        on_host = {i: n for i, n, _ in self.cost[k + j:]}
        homed = (homed_on_device(sizes, item, stepped_there, spare) if self.params_offloaded
                 else {i for i, _ in sizes})
        stepped = {Tier.DEVICE: sum(n for _, n, _ in self.cost[:k]), Tier.HOST: sum(on_host.values())}
        return predict(_traffic(sizes, stepped, set(on_host), homed, item, self.config, streamed,
                                self.shards.state_format(self.config)), self.rates)


def homed_on_device(shard_sizes: list[tuple[int, int]], item: int, stepped_there: frozenset[int],
                    spare: int) -> set[int]:
    """The units homed on the device beside offloaded parameters: those stepped there, then the next ones in the
    forward's order whose shards ``spare`` bytes hold (see [Note: a split beside offloaded parameters])."""
    moved = set(stepped_there)
    for i, n in shard_sizes:  # the order of need: the next forward's first units first
        if i in moved:
            continue
        if item * n > spare:
            break
        moved.add(i)
        spare -= item * n
    return moved


def _home_on_device(out: Placement, shard_sizes: list[tuple[int, int]], item: int, stepped_there: frozenset[int],
                    spare: int) -> None:
    """[Note: a split beside offloaded parameters] A unit whose optimizer state stays on the device is stepped
    there, and the device step writes the new shard into a device home: so beside offloaded parameters (host or
    NVMe) those units' shards are homed on the device too. With ``spare`` bytes of the device's room left after
    them (auto), the next units in the forward's order are homed there as well, as far as it goes, frozen ones
    included (a LoRA base): their state, if any, stays on the host, whose step writes a host copy that is copied
    back, once a step, instead of a gather bringing the shard over in forward and again in backward. The rest keep
    the home offload_param gives them. A unit homed on the device is never brought over from the host again; with
    one rank on a GPU it is read where it lives, never gathered (``aliased``, set by ``plan``), as every unit is
    with offload_param none."""
    moved = homed_on_device(shard_sizes, item, stepped_there, spare)
    if not moved:
        return
    out.homes.update(dict.fromkeys(moved, Tier.DEVICE))
    out.nvme_params = [(i, n) for i, n in out.nvme_params if i not in moved]
    out.device["shards"] = out.device.get("shards", 0) + item * sum(n for i, n in shard_sizes if i in moved)


def _plan_device_accumulators(out: Placement, shards: Shards, trained_sizes: list[tuple[int, int]], config: Any,
                              stage: StageLayout, device_free: int | None) -> None:
    """With gradient accumulation, an offloaded optimizer's fp32 accumulators (``trained_sizes``: the units whose
    state is offloaded) go on the device, in unit order, as far as its room allows (``_device_room``). The other
    units accumulate on the host (see [Note: gradients accumulated on the device] in offload/optim/landing.py)."""
    room = _device_room(out, shards, config, stage, device_free)
    chosen: set[int] = set()
    used = 0
    for i, n in trained_sizes:
        if room is not None and used + 4 * n > room:
            break
        chosen.add(i)
        used += 4 * n
    out.device_accumulated = frozenset(chosen)
    if used:
        out.device["gradient accumulators"] = out.device.get("gradient accumulators", 0) + used


def _check_device(out: Placement, shards: Shards, config: Any, stage: StageLayout) -> None:
    """The device budget against what stays there, and its room for gathers."""
    shard_sizes, item, parts = shards.sizes, shards.item, stage.parts
    offloaded = config.zero_optimization.offload_optimizer.device != "none"
    budget = config.offload.budgets.device
    if budget is None:
        return
    resident = sum(out.device.values())
    optimizer = "" if offloaded else " and the optimizer state"
    if stage.resident_params:
        if resident > budget:
            out.problems.append(ConfigError(
                "offload.budgets.device", f"{budget:,} bytes cannot hold this rank's resident state ({resident:,} "
                f"bytes: every parameter{optimizer}, which ZeRO stage {config.zero_optimization.stage} keeps on "
                "the device); raise it, offload the optimizer (stages 1-2), or use stage 3, which partitions the "
                "parameters"))
        return
    largest = max(out.gathered(shard_sizes), default=0) * parts * item
    if resident > budget or budget - resident < largest:
        if out.state_on_device:
            optimizer = " and the optimizer state offload_optimizer.ratio keeps there"
        fix = ("raise offload_optimizer.ratio (or set it to auto, which fills the budget)" if out.state_on_device
               else "offload the optimizer (offload_optimizer.device: cpu)" if not offloaded else "")
        out.problems.append(ConfigError(
            "offload.budgets.device", f"{budget:,} bytes cannot hold this rank's resident state ({resident:,} bytes: "
            f"shards{optimizer})" + (f" plus the largest unit gathered ({largest:,} bytes)" if largest else "")
            + f"; raise it to at least {resident + largest:,}, {fix + ', ' if fix else ''}use more ranks, or lower "
            "offload.unit_bytes"))
        return
    out.gather_room = (budget - resident) // item


def traffic(out: Placement, shard_sizes: list[tuple[int, int]], item: int, config: Any) -> Traffic:
    """What a step of this plan moves (offload/store/step_cost.py prices it)."""
    stepped: dict[Tier, int] = {}
    for g in out.groups:
        if not g.streamed:  # homed on the host, stepped on the device: priced as such
            stepped[g.tier] = stepped.get(g.tier, 0) + g.numel
    off_device = {m.unit for g in out.groups if g.tier is not Tier.DEVICE and not g.streamed for m in g.members}
    homed = {i for i, _ in shard_sizes if out.homes[i] is Tier.DEVICE}
    fmt = out.groups[0].fmt if out.groups else from_config(config)  # stepped_bytes: the same, a high half lent
    return _traffic(shard_sizes, stepped, off_device, homed, item, config, out.streamed, fmt, _streamed_nvme(out))


def _traffic(shard_sizes: list[tuple[int, int]], stepped: dict[Tier, int], stepped_off: set[int], homed: set[int],
             item: int, config: Any, streamed: frozenset[int], fmt: StateFormat,
             streamed_nvme: frozenset[int] = frozenset()) -> Traffic:
    """A step's traffic, by the one rule a plan and auto's candidates both follow: the elements ``stepped`` on each
    tier; each shard not ``homed`` on the device gathered up; each device home stepped off it (``stepped_off``)
    copied up once; with ``config``'s micro-batches a step, each gathering and sending gradients down (or,
    accumulated on the device, sent once: offload.accumulate_on_device); the ``streamed`` units' state up and down,
    and their new weights down where their shards are not ``homed`` on the device, unless their state is on NVMe
    (``streamed_nvme``: read from and written to the disk by the step's pass, the weights written on the host);
    the state as ``fmt`` holds it."""
    return Traffic(stepped, gathered_up=sum(n for i, n in shard_sizes if i not in homed),
                   copied_up=sum(n for i, n in shard_sizes if i in stepped_off and i in homed), item=item,
                   micro_batches=int(config.gradient_accumulation_steps or 1),
                   grads_accumulated_on_device=bool(config.offload.accumulate_on_device),
                   state_bytes=fmt.stepped_bytes,
                   streamed=sum(n for i, n in shard_sizes if i in streamed),
                   streamed_down=sum(n for i, n in shard_sizes
                                     if i in streamed and i not in homed and i not in streamed_nvme),
                   streamed_nvme=sum(n for i, n in shard_sizes if i in streamed_nvme))


def describe_split(out: Placement, shard_sizes: list[tuple[int, int]]) -> str:
    """One line of where a rank's elements live: parameter shards and optimizer state by tier, and what stays on
    the device (what initialize logs, and ``offload estimate`` prints at length)."""
    def by_tier(pairs: list[tuple[Tier, int]]) -> str:
        counts: dict[Tier, int] = {}
        for tier, n in pairs:
            counts[tier] = counts.get(tier, 0) + n
        return ", ".join(f"{tier.value} {n:,}" for tier, n in counts.items() if n)
    params = by_tier([(out.homes[i], n) for i, n in shard_sizes])
    state = by_tier([(g.tier, g.numel) for g in out.groups])
    return (f"parameter elements: {params}; optimizer state elements: {state}; kept on the device "
            f"{sum(out.device.values()) / 2**30:.2f} GiB")

