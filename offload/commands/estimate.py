"""`offload estimate`: the bytes each tier of a rank will hold under a config, and the largest model each offload
choice can train on this machine.

The figures come from the engine's own plan: the model is built on the meta device (no
memory) and cut into units by ``plan_units``, and the host and NVMe tiers are the
placement the engine's start-up makes (offload/store/placement.py: parameter homes by
max_in_cpu, sub-groups within the host budget, host reservations, swap and staging
buffers), so ``engine.memory_summary()`` after ``initialize`` matches them part for part
(tested). Unlike DeepSpeed's estimator it counts the pinned pools, swap buffers and
staging buffers. Activations are counted when the model's shape is known (``--model``);
the CUDA context and allocator slack are not; the device tier's gathered units are an
upper bound from the prefetch and live limits.

"The largest model each choice trains here" solves bytes(N) = fixed + per_param x N
per tier (two plans of synthetic models give both terms) against what the machine has:
GPU memory (torch), available RAM (psutil) and free disk under nvme_path. On a machine
without a GPU the "device" is host memory, so both tiers share the RAM.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from offload.config import Config, ConfigError
from offload.config.fields import resolved
from offload.engine.refit import refits, room_beside
from offload.engine.step_schedule import wanted
from offload.machine.cpus import host_threads
from offload.models.catalog import MODELS, ModelError, build_model
from offload.optim.hyper import held_moments
from offload.store.param_homes import describe_placement
from offload.store.placement import KEPT_GRADS, MachineOffer, Shards, Speculation, StageLayout, StepAsks, plan, traffic
from offload.store.step_cost import STATE_BYTES, Rates, StepPrediction, adam_bytes, adam_ms, predict
from offload.store.sub_groups import SubGroup, sub_group_elements, unpipelined_note
from offload.store.tier import Tier
from offload.zero.stage import Stage

TIERS = tuple(t.value for t in Tier)  # the report's tiers by name, in the order printed: device, host, nvme
STREAMED = "streamed"  # the optimizer step's lane of state homed on the host and stepped on the device


@dataclass
class Estimate:
    params: int
    world: int
    units: int
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> part -> bytes, per rank
    notes: list[str] = field(default_factory=list)
    stage: int = 3
    step_ms: dict[str, float] = field(default_factory=dict)  # tier -> its share of Adam's time a step, at ``rates``
    prediction: StepPrediction | None = None  # the step's terms (a GPU's; an offloaded optimizer only)

    def total(self, tier: str) -> int:
        return sum(self.tiers.get(tier, {}).values())

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state on every tier: what the ZeRO formula counts (ours keeps fp32
        gradient accumulators, or with one 16-bit micro-batch the 16-bit gradients themselves, and 16-bit gradients
        whole in stages 0-1 too, where the formula has 16-bit gradients throughout), without buffers, pools or
        gathered units."""
        one = ("parameters", "shards", "gradients (whole, in .grad)", "optimizer state", "gradient accumulators",
               KEPT_GRADS)
        two = ("parameter shards (two slots per unit)", "optimizer state (two slots per sub-group)")
        return sum(n if part in one else n // 2 for tier in self.tiers.values() for part, n in tier.items()
                   if part in one + two)


def compute_bytes(config: Config) -> int:
    return 2 if config.bf16.enabled is True or config.fp16.enabled is True else 4


def model_state_formula(stage: int, params: int, world: int) -> int:
    """The ZeRO paper's model-state bytes per rank for mixed-precision Adam: 16-bit parameters and gradients,
    fp32 master and moments (2 + 2 + 12 bytes per parameter), partitioned as the stage says."""
    n, w = params, world
    return {0: 16 * n, 1: 4 * n + 12 * n // w, 2: 2 * n + 14 * n // w, 3: 16 * n // w}[stage]


@dataclass(frozen=True)
class ActivationShape:
    """What activation memory depends on: a transformer's shape and one rank's micro-batch."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro: int
    vocab: int
    scores_kept: bool = False  # eager attention keeps its s x s scores for backward; SDPA's fused kernels do not

    def per_layer(self, item: int) -> int:
        """Bytes one block keeps for backward: s*b*h*(34 + 5*a*s/h) in 16-bit (Korthikanti et al., 2022, without
        sequence or tensor parallelism), scaled to the compute dtype; the 5*a*s/h term (the attention's scores,
        its softmax and dropout mask) only where attention keeps them, not under SDPA's fused kernels (what the
        built-in GPT and Hugging Face's models run by default), which keep a log-sum-exp a row instead."""
        s, b, h, a = self.seq, self.micro, self.hidden, self.heads
        return int(s * b * h * (34 + (5 * a * s / h if self.scores_kept else 0)) * item / 2)

    def block_input(self, item: int) -> int:
        return self.seq * self.micro * self.hidden * item

    def logits(self, item: int) -> int:
        """The head's logits and the fp32 copy the loss takes of them."""
        return self.seq * self.micro * self.vocab * (item + 4)


def add_activations(est: Estimate, shape: ActivationShape, config: Config) -> None:
    """Activation bytes: every block's (no checkpointing), or with offload.checkpoint_blocks each block's input
    (on the host with cpu_checkpointing, two inputs in flight on the device) plus one block recomputing."""
    item = compute_bytes(config)
    device = est.tiers[Tier.DEVICE.value]
    if not config.offload.checkpoint_blocks:
        device["activations"] = shape.layers * shape.per_layer(item) + shape.logits(item)
        est.notes.append("activations: every block's, by Korthikanti et al.'s per-layer formula (no checkpointing"
                         + (")" if shape.scores_kept else "; no attention scores kept: SDPA)"))
        return
    inputs = shape.layers * shape.block_input(item)
    if config.activation_checkpointing.cpu_checkpointing:
        est.tiers[Tier.HOST.value]["activation checkpoints"] = inputs
        device["activations"] = 2 * shape.block_input(item) + shape.per_layer(item) + shape.logits(item)
        where = "block inputs in host memory"
    else:
        device["activations"] = inputs + shape.per_layer(item) + shape.logits(item)
        where = "block inputs on the device"
    est.notes.append(f"activations: checkpointed blocks ({where}) plus one block recomputing")


@dataclass(frozen=True)
class StepRates:
    """What a step's Adam streams through each tier, GB/s (None: not known, bytes only), and where they came from."""

    device_gbps: float | None = None  # device memory
    host_gbps: float | None = None  # host memory, as Adam streams it (`offload bench adam`)
    nvme_gbps: float | None = None  # the swap path, reads and writes together (`offload tune-nvme`)
    source: str = ""
    device_tflops: float | None = None  # the model's compute as plain PyTorch runs it (a preset's)
    h2d_gbps: float | None = None  # pinned host -> device (`offload bench pcie`)
    d2h_gbps: float | None = None
    others_source: str = ""  # where the compute and PCIe rates came from


    def for_step(self, compute_ms: float | None) -> Rates:
        """The rates the plan and the prediction price a step at, with the model's compute known or not."""
        return Rates(compute_ms, self.device_gbps, self.host_gbps, self.nvme_gbps, self.h2d_gbps, self.d2h_gbps)


def compute_ms(est_params: int, shape: ActivationShape | None, config: Config, rates: StepRates) -> float | None:
    """One step's forward and backward: 6 FLOPs a parameter a token, 8 with checkpointed blocks recomputing."""
    if shape is None or not rates.device_tflops:
        return None
    per_token = 8 if config.offload.checkpoint_blocks else 6
    return per_token * est_params * shape.seq * shape.micro / (rates.device_tflops * 1e12) * 1e3


def estimate(unit_numels: list[int], config: Config, world: int,
             activations: ActivationShape | None = None, *, discrete: bool = True,
             device_free: int | None = None, rates: StepRates | None = None) -> Estimate:
    """Bytes per tier of one rank for a model whose units hold ``unit_numels`` elements (all trained);
    activations too when their shape is given. ``discrete``: trained on a GPU (the default), not on a CPU compute
    device, whose engine reads host memory in place and so reserves less; ``device_free``: the device memory free
    at start, which bounds the gradient accumulators kept there without a device budget (see ``plan``)."""
    zero = config.zero_optimization
    stage = Stage(zero.stage)
    item = compute_bytes(config)
    parts = stage.partition_count(world)
    sizes = [(i, -(-n // parts)) for i, n in enumerate(unit_numels)]  # partition elements: padded, over P
    est = Estimate(sum(unit_numels), world, len(unit_numels), {t: {} for t in TIERS}, stage=stage.number)
    device, host, nvme = (est.tiers[t.value] for t in (Tier.DEVICE, Tier.HOST, Tier.NVME))
    param_dev = zero.offload_param.device
    dtype = torch.float16 if config.fp16.enabled is True else torch.bfloat16 if item == 2 else torch.float32
    rule = config.optimizer.rule if config.optimizer is not None else "adam"
    want = wanted(config, dtype, rule)
    rates = rates or StepRates()
    priced = rates.for_step(compute_ms(est.params, activations, config, rates))

    def placed(refit_room: int | None = None) -> Any:
        """The engine's own plan: at start-up auto's split by the rates (the compute is not known there); the
        refit's, state first as the refit moves it (offload/engine/refit.py)."""
        return plan(Shards(sizes, {i for i, _ in sizes}, item, held_moments(rule)), config,
                    StageLayout(parts=parts, resident_params=stage.resident_params,
                                whole_grads=0 if stage.reduce_every_micro_batch else est.params),
                    MachineOffer(discrete=discrete, device_free=device_free, refit_room=refit_room,
                                 rates=rates.for_step(None) if refit_room is None else None),
                    StepAsks(speculation=want.speculation, delayed=want.delayed, not_streamed=want.not_streamed))

    placement = placed()
    if activations is not None:
        add_activations(est, activations, config)
        # The refit stops at a shard homed on NVMe; beside NVMe parameters the start-up plan is what is known.
        if (discrete and device_free is not None and param_dev != "nvme"
                and refits(config, sized=True, delayed=want.delayed)):
            placement = _refitted(est, placement, placed(room_beside(device_free, device["activations"])))
    device.update(placement.device)
    gathered = placement.gathered(sizes)  # one rank's device homes on a GPU: none
    if not stage.resident_params and gathered:
        largest_unit = max(n * parts for n in gathered)
        device["gathered (at most)"] = item * min(int(zero.stage3_max_live_parameters),
                                                  largest_unit + int(cast(int, zero.stage3_prefetch_bucket_size)),
                                                  parts * sum(gathered))
    if param_dev == "nvme":
        est.notes.append(describe_placement(sizes, placement.nvme_params, zero.offload_param))
    nvme.update(placement.nvme)
    host.update(placement.host)
    if zero.offload_optimizer.device != "none" and placement.placed:
        note, est.step_ms = step_traffic(placement.groups, item, priced, rates.source)
        est.notes.append(note)
        if discrete:
            est.prediction = predict(traffic(placement, sizes, item, config), priced)
            est.notes.append(est.prediction.note("; ".join(x for x in (rates.source, rates.others_source) if x)))
    if placement.state_on_device:
        on_device = sum(g.numel for g in placement.groups if g.tier is Tier.DEVICE)
        est.notes.append(f"offload_optimizer.ratio {zero.offload_optimizer.ratio}: the optimizer state of "
                         f"{len(placement.state_on_device)} of {len(sizes)} units ({on_device:,} of "
                         f"{sum(n for _, n in sizes):,} elements) stays on the device and is stepped there")
    if placement.streamed:
        streamed = sum(g.numel for g in placement.groups if g.streamed)
        est.notes.append(f"offload.stream_state {config.offload.stream_state}: the device steps the state of "
                         f"{len(placement.streamed)} units ({streamed:,} elements) homed on the host, streamed over "
                         "the bus each step, beside the host's Adam on the rest")
    elif placement.state_fits_device and zero.offload_optimizer.device != "none" and not placement.state_on_device:
        est.notes.append("the whole optimizer state would fit on the device: offload_optimizer.ratio \"auto\" "
                         "keeps it there, where it steps faster")
    if want.speculation is not Speculation.NONE and placement.speculative_why:
        est.notes.append(f"the step does not speculate: {placement.speculative_why}")
    if discrete and device_free is not None and est.total(Tier.DEVICE.value) > device_free:
        est.notes.append(f"over the device's memory: this plan needs {est.total(Tier.DEVICE.value) / 2**30:.2f} GiB "
                         f"of its {device_free / 2**30:.2f} GiB; checkpoint the blocks (offload.checkpoint_blocks), "
                         "lower the micro-batch or offload more")
    for problem in placement.problems:  # the limits initialize holds every tier to
        est.notes.append(f"over {problem.path}: initialize would refuse this plan ({problem.reason})")
    if not placement.placed:
        return est
    buffers = host.get("optimizer NVMe buffers", 0)
    unpipelined = unpipelined_note(placement.groups, sub_group_elements(zero))
    if unpipelined:
        est.notes.append(unpipelined)
    elif buffers > est.total(Tier.HOST.value) // 4:
        largest = max((g for g in placement.groups if g.tier is Tier.NVME), key=lambda g: g.nbytes)
        if len(largest.members) > 1:
            smaller = sub_group_elements(zero) // 10
            est.notes.append(f"each optimizer NVMe buffer holds a whole sub-group (sub_group_size "
                             f"{sub_group_elements(zero):,} elements): {buffers / 2**30:.2f} GiB of buffers; a "
                             f"smaller sub_group_size (e.g. {smaller:.0e}) shrinks them")
        else:  # a unit is never split across sub-groups
            est.notes.append(f"each optimizer NVMe buffer holds the largest unit's state ({largest.numel:,} "
                             f"elements): {buffers / 2**30:.2f} GiB of buffers; a smaller offload.unit_bytes or "
                             "offload_optimizer.buffer_count shrinks them")
    est.notes.append(("not counted: " if activations is not None else "not counted: activations, ")
                     + "the CUDA context and allocator slack")
    return est


def _refitted(est: Estimate, start_up: Any, refitted: Any) -> Any:
    """The split `auto` ends with on a GPU (see [Note: the split refitted] in offload/engine/refit.py), said beside
    the one it starts with; the estimate goes on with the refitted one."""
    def kept(p: Any) -> tuple[int, int]:
        return len(p.state_on_device), sum(g.numel for g in p.groups if g.tier is Tier.DEVICE)

    (units0, n0), (units1, n1) = kept(start_up), kept(refitted)
    if n1 <= n0:
        return start_up
    est.notes.append(f"offload_optimizer.ratio auto: at start-up the optimizer state of {units0} units ({n0:,} "
                     f"elements) stays on the device (half the memory free then); after the first step, whose "
                     f"peak holds the activations estimated here, offload.auto_refit keeps it there for {units1} "
                     f"units ({n1:,} elements): the split below")
    return refitted


def step_traffic(groups: list[SubGroup], item: int, rates: Rates, source: str) -> tuple[str, dict[str, float]]:
    """What one optimizer step moves on each tier its state lives on, per rank, and what that costs in ms at
    ``rates`` (the bandwidths `offload bench adam` and `offload tune-nvme` measure; offload/store/step_cost.py
    prices them). The tiers step side by side (device Adam on the GPU beside the host's), so the longest is what
    the step waits for. State homed on the host and stepped on the device (streamed) is a lane of its own."""
    per_lane: dict[str, int] = {}
    for g in groups:
        lane = STREAMED if g.streamed else g.tier.value
        per_lane[lane] = per_lane.get(lane, 0) + g.numel
    state = groups[0].fmt.stepped_bytes if groups else STATE_BYTES
    parts, cost_ms = [], {}  # cost_ms by the lane's name: it is the estimate's step_ms, written to JSON
    for lane, n in per_lane.items():
        tier = Tier.DEVICE if lane == STREAMED else Tier(lane)
        memory = "device memory" if tier is Tier.DEVICE else "host memory"
        part = f"{lane}: {n:,} elements, {n * (adam_bytes(state) + item) / 1e9:.2f} GB through {memory}"
        if tier is Tier.NVME:
            part += f" and {n * 2 * state / 1e9:.2f} GB read and written on NVMe"
        if lane == STREAMED:
            part += f" and {n * state / 1e9:.2f} GB over the bus each way"
            passed = sum(g.numel for g in groups if g.streamed and g.tier is Tier.NVME)
            if passed:  # read and written by the step's NVMe pass, priced in the host's term
                part += f" ({passed * 2 * state / 1e9:.2f} GB of it read and written on NVMe)"
        ms = adam_ms(tier, n, item, rates, state)  # without the disk's rate an NVMe tier's cost is unknown: bytes only
        if ms is not None:
            cost_ms[lane] = ms
            part += f", about {ms:,.0f} ms"
        parts.append(part)
    note = "optimizer step traffic per rank and step, by where the state lives: " + "; ".join(parts)
    if cost_ms:
        note += f", at {source}" if source else ""
        if len(cost_ms) > 1:
            slowest = max(cost_ms, key=cost_ms.__getitem__)
            note += f"; the tiers step side by side, so the {slowest}'s {cost_ms[slowest]:,.0f} ms is the step's"
    return note, cost_ms


# ----------------------------------------------------------------------------- models


def model_units(model: torch.nn.Module, config: Config) -> list[int]:
    """The engine's units of ``model`` (built on the meta device: no memory needed)."""
    from offload.zero.plan import plan_units
    threshold = config.zero_optimization.stage3_param_persistence_threshold  # "auto" unresolved: no hidden size
    plans = plan_units(model, config.offload.unit_bytes, compute_bytes(config),
                       atomic=tuple(config.offload.atomic_modules or ()),
                       fold_below=threshold if isinstance(threshold, int) else 0)
    return [p.numel for p in plans]


MAX_UNITS = 1_000_000  # a plan of more units than this is refused (with the numbers) rather than built slowly


def synthetic_units(params: int, config: Config) -> list[int]:
    """Units of a model known only by its size: equal units of offload.unit_bytes."""
    per_unit = max(1, config.offload.unit_bytes // compute_bytes(config))
    count = max(1, math.ceil(params / per_unit))
    if count > MAX_UNITS:
        raise ConfigError("offload.unit_bytes", f"{params:,} parameters make {count:,} units of "
                                                f"{config.offload.unit_bytes:,} bytes, more than the {MAX_UNITS:,} "
                                                "this estimate plans one by one; raise offload.unit_bytes (in "
                                                "--config) to at least "
                                                f"{math.ceil(params / MAX_UNITS) * compute_bytes(config):,}")
    base, extra = divmod(params, count)
    return [base + (i < extra) for i in range(count)]


# ----------------------------------------------------------------------------- this machine


@dataclass
class Machine:
    device_bytes: int | None  # GPU memory; None: no GPU (the compute device is host memory)
    host_bytes: int  # RAM available now
    nvme_bytes: int  # free disk under nvme_path
    nvme_path: str

    @staticmethod
    def here(nvme_path: str | None) -> Machine:
        import psutil
        device = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
        path = Path(nvme_path or ".").expanduser()
        while not path.exists() and path != path.parent:
            path = path.parent
        return Machine(device, psutil.virtual_memory().available, shutil.disk_usage(path).free, str(path))


CHOICES: dict[str, dict[str, str]] = {
    "no offload": {"offload_param": "none", "offload_optimizer": "none"},
    "optimizer on cpu": {"offload_param": "none", "offload_optimizer": "cpu"},
    "params + optimizer on cpu": {"offload_param": "cpu", "offload_optimizer": "cpu"},
    "params on cpu, optimizer on nvme": {"offload_param": "cpu", "offload_optimizer": "nvme"},
    "params + optimizer on nvme": {"offload_param": "nvme", "offload_optimizer": "nvme"},
}


def choice_config(base: dict[str, Any], choice: dict[str, str], nvme_path: str) -> dict[str, Any]:
    raw = {**base, "zero_optimization": {**base.get("zero_optimization", {}), "stage": 3}}
    zero = raw["zero_optimization"]
    for section, device in choice.items():
        zero[section] = {**zero.get(section, {}), "device": device}
        if device == "nvme":
            zero[section]["nvme_path"] = nvme_path
    if choice["offload_param"] == "nvme":
        zero["offload_param"]["max_in_cpu"] = 0
    return raw  # sub_group_size as the config says; auto keeps NVMe state's buffers small (sub_groups.py)


def largest_trainable(base: dict[str, Any], machine: Machine, world: int = 1) -> dict[str, tuple[int, str]]:
    """Per offload choice: the most parameters it trains on ``machine`` and the tier that limits it (a choice the
    config's optimizer refuses is left out: Muon's state is never on NVMe)."""
    out: dict[str, tuple[int, str]] = {}
    muon = str((base.get("optimizer") or {}).get("type", "")).lower() == "muon"
    for name, choice in CHOICES.items():
        if muon and choice["offload_optimizer"] == "nvme":
            continue
        raw = choice_config(base, choice, machine.nvme_path)
        config = Config.load(raw).resolve(world_size=world)
        small, large = 10**9, 4 * 10**9  # both past the point where the NVMe buffers stop growing
        # Models this large leave the device no room for gradient accumulators: they accumulate on the host.
        a, b = (estimate(synthetic_units(n, config), config, world, discrete=machine.device_bytes is not None,
                         device_free=0) for n in (small, large))
        caps = {Tier.HOST: machine.host_bytes, Tier.NVME: machine.nvme_bytes}
        if machine.device_bytes is not None:
            caps[Tier.DEVICE] = machine.device_bytes
        best, limit = math.inf, ""  # limit: the tier's name, as printed and written to JSON
        for tier, cap in caps.items():
            tiers = (Tier.DEVICE, Tier.HOST) if tier is Tier.HOST and machine.device_bytes is None else (tier,)
            ranks = 1 if tier is Tier.DEVICE else world  # every rank runs here: each has a GPU, they share RAM and disk
            lo = ranks * sum(a.total(t.value) for t in tiers)
            hi = ranks * sum(b.total(t.value) for t in tiers)
            per = (hi - lo) / (large - small)
            fixed = lo - per * small
            if per > 0:
                n = (cap - fixed) / per
                if n < best:
                    best, limit = n, tier.value
        out[name] = (max(0, int(best)) if math.isfinite(best) else 0, limit)
    return out


# ----------------------------------------------------------------------------- report


def _count(params: int) -> str:
    return f"{params / 1e9:,.2f}B" if params >= 1e9 else f"{params / 1e6:,.1f}M"


def format_estimate(est: Estimate, config: Config) -> str:
    zero = config.zero_optimization
    lines = [f"{_count(est.params)} parameters in {est.units} units, W={est.world}, ZeRO stage {est.stage}: "
             f"{zero.placement_words()} (bytes per rank)"]
    for tier in TIERS:
        parts = est.tiers[tier]
        if not parts:
            continue
        lines.append(f"  {tier:6s} {_gib(est.total(tier)):>10s}")
        for what, nbytes in parts.items():
            lines.append(f"      {what:42s} {_gib(nbytes):>10s}")
    lines += [f"  ({note})" for note in est.notes]
    return "\n".join(lines)


def stage_config(raw: dict[str, Any], stage: int) -> dict[str, Any]:
    """``raw`` under another ZeRO stage, keeping its offload choices where that stage allows them (parameter
    offload needs stage 3; optimizer offload stage 1 or more)."""
    zero = {**raw.get("zero_optimization", {}), "stage": stage}
    if stage < 3:
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": "none"}
    if stage < 1:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "none"}
    return {**raw, "zero_optimization": zero}


def compare_stages(unit_numels: list[int], raw: dict[str, Any], world: int, hidden_size: int | None = None,
                   activations: ActivationShape | None = None) -> dict[int, Estimate]:
    """The same model and world size under each ZeRO stage."""
    out = {}
    for stage in range(4):
        config = Config.load(stage_config(raw, stage)).resolve(world_size=world, hidden_size=hidden_size)
        out[stage] = estimate(unit_numels, config, world, activations)
    return out


def format_stages(stages: dict[int, Estimate], raw: dict[str, Any]) -> str:
    first = next(iter(stages.values()))
    n, w = first.params, first.world
    lines = [f"per rank by ZeRO stage ({_count(n)} parameters, W={w}); the ZeRO formula counts 16-bit "
             "gradients where offload keeps fp32 accumulators (with one 16-bit micro-batch a step, the 16-bit "
             "gradients themselves):",
             f"  {'stage':5s} {'device':>10s} {'host':>10s} {'nvme':>10s} {'model states':>13s} {'ZeRO formula':>13s}"
             "  offload"]
    for stage, est in stages.items():
        zero = stage_config(raw, stage)["zero_optimization"]
        where = (f"params {zero.get('offload_param', {}).get('device', 'none')}, optimizer "
                 f"{zero.get('offload_optimizer', {}).get('device', 'none')}")
        lines.append(f"  {stage:5d} {_gib(est.total('device')):>10s} {_gib(est.total('host')):>10s} "
                     f"{_gib(est.total('nvme')):>10s} {_gib(est.model_states):>13s} "
                     f"{_gib(model_state_formula(stage, n, w)):>13s}  {where}")
    return "\n".join(lines)


def format_largest(largest: dict[str, tuple[int, str]], machine: Machine, world: int,
                   sub_group_size: object = "auto") -> str:
    gpu = f"GPU {_gib(machine.device_bytes)}" if machine.device_bytes is not None else "no GPU"
    lines = [f"this machine: {gpu}, RAM available {_gib(machine.host_bytes)}, free under {machine.nvme_path} "
             f"{_gib(machine.nvme_bytes)}; the largest model per choice (ZeRO stage 3, W={world} ranks here, "
             "sharing RAM and disk; limited by):"]
    for name, (n, tier) in largest.items():
        zero = CHOICES[name]
        extra = f", sub_group_size {sub_group_size}" if zero["offload_optimizer"] == "nvme" else ""
        extra += ", max_in_cpu 0" if zero["offload_param"] == "nvme" else ""
        lines.append(f"  {name:33s} {n / 1e9:7.2f}B params  ({tier:6s})  offload_param {zero['offload_param']}, "
                     f"offload_optimizer {zero['offload_optimizer']}{extra}")
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------- command line

DEFAULT_VOCAB = {"builtin": 256, "gpt2": 50304, "llama": 32000}


def build_config(path: str | None, overrides: dict[str, Any], nvme_path: str, stage: int | None = None,
                 checkpointing: str | None = None) -> dict[str, Any]:
    """The config to estimate: a file (or bf16 with the optimizer on the host), with the command line's devices."""
    raw: dict[str, Any] = Config.load(path).to_dict() if path else {
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    zero = raw.setdefault("zero_optimization", {})
    if stage is not None:
        zero["stage"] = stage
    if checkpointing is not None:
        raw.setdefault("offload", {})["checkpoint_blocks"] = checkpointing != "none"
        raw.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = checkpointing == "cpu"
    for section, device in overrides.items():
        if device is not None:
            zero[section] = {**zero.get(section, {}), "device": device}
        if zero.get(section, {}).get("device") == "nvme" and not zero[section].get("nvme_path"):
            zero[section]["nvme_path"] = nvme_path
    return raw


def step_rates(args: Any, preset: Any, threads: int | None = None) -> StepRates:
    """The bandwidths the step's cost is estimated at: ``preset`` (a machine of `offload bench replay`, with a
    name, device_gbps and host_gbps), each rate overridable (--host-gbps with what `offload bench adam` measured on
    yours); on a GPU machine without --machine, the rates start-up measures there with ``threads`` (the config's
    offload.cpu_threads; offload/engine/rates.py), so the estimate's `auto` split is the one initialize would
    choose, as far as two measurements of one machine agree (several ranks measure at once, and slower)."""
    measured = (measured_here(args, preset, threads)
                if torch.cuda.is_available() and getattr(args, "machine", "h100") is None else None)
    return measured or preset_rates(args, preset)


def preset_rates(args: Any, preset: Any) -> StepRates:
    """``preset``'s rates, each a flag overrides."""
    chosen = [(name, given or default, "given" if given else f"{preset.name} preset")
              for name, given, default in (("device", args.device_gbps, preset.device_gbps),
                                           ("host", args.host_gbps, preset.host_gbps),
                                           ("NVMe", args.nvme_gbps, None)) if given or default]
    by_origin: dict[str, list[str]] = {}
    for name, gbps, origin in chosen:
        by_origin.setdefault(origin, []).append(f"{name} {gbps:g}")
    source = ", ".join(f"{' and '.join(names)} GB/s from the {origin}" if origin != "given" else
                       f"{' and '.join(names)} GB/s as given" for origin, names in by_origin.items())
    rate = {name: gbps for name, gbps, _ in chosen}
    tflops = getattr(args, "device_tflops", None)
    others = (f"compute {tflops or preset.device_tflops:g} TFLOP/s {'as given' if tflops else 'from the preset'}, "
              f"host<->device {preset.h2d_gbps:g}/{preset.d2h_gbps:g} GB/s from the {preset.name} preset")
    return StepRates(rate["device"], rate["host"], rate.get("NVMe"), source, tflops or preset.device_tflops,
                     preset.h2d_gbps, preset.d2h_gbps, others)


def measured_here(args: Any, preset: Any, threads: int | None) -> StepRates | None:
    """This GPU machine's rates, measured as initialize measures them; a rate given on the command line wins."""
    from offload.engine.rates import measure
    from offload.machine.accelerator import Accelerator
    from offload.zero.collectives import Group
    here = measure(Accelerator(), threads, Group(0, 1, None))
    if here is None:  # the measuring failed, and said why: the preset's
        return None
    device = args.device_gbps or here.device_gbps
    host = args.host_gbps or here.host_gbps
    given_tflops = getattr(args, "device_tflops", None)
    tflops = given_tflops or preset.device_tflops
    source = (f"device {device:,.0f} and host {host:,.0f} GB/s measured on this machine" +
              (" (some as given)" if args.device_gbps or args.host_gbps else "") +
              (f", NVMe {args.nvme_gbps:g} GB/s as given" if args.nvme_gbps else ""))
    others = (f"compute {tflops:g} TFLOP/s {'as given' if given_tflops else f'from the {preset.name} preset'}, "
              f"host<->device {here.h2d_gbps:,.1f}/{here.d2h_gbps:,.1f} GB/s measured on this machine")
    return StepRates(device, host, args.nvme_gbps, source, tflops, here.h2d_gbps, here.d2h_gbps, others)


def device_memory(preset: Any) -> tuple[int | None, str]:
    """The device memory the plan may fill, and whence: this machine's GPU (free now), else the preset's."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0], "free on this machine's GPU"
    return (preset.device_bytes or None), f"the {preset.name} preset's"


def run_cli(args: Any, preset: Any) -> int:
    import sys
    try:
        raw = build_config(args.config, {"offload_optimizer": args.offload_optimizer,
                                         "offload_param": args.offload_param}, args.nvme_path, args.stage,
                           args.checkpointing)
        if args.params is not None:
            params = int(args.params)
            config = Config.load(raw).resolve(world_size=args.world)
            units = synthetic_units(params, config)
            hidden_size, shape = None, None
        else:
            name = args.model or "gpt2"
            if name not in MODELS:
                raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} or give --params N")
            family, layers, hidden, heads = MODELS[name]
            vocab = args.vocab or DEFAULT_VOCAB[family]
            with torch.device("meta"):  # sizes only: no memory, no initialisation
                model = build_model(name, vocab, args.seq, layers=args.layers, hidden=args.hidden)
            hidden_size = args.hidden or hidden
            config = Config.load(raw).resolve(world_size=args.world, hidden_size=hidden_size)
            units = model_units(model, config)
            micro = args.micro or int(resolved(config.train_micro_batch_size_per_gpu) or 1)
            eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
            shape = ActivationShape(args.layers or layers, hidden_size, heads * hidden_size // hidden, args.seq,
                                    micro, vocab, scores_kept=eager)
    except (ModelError, ConfigError) as e:
        print(f"offload estimate: {e}", file=sys.stderr)
        return 2
    device_free, where = device_memory(preset)
    threads = host_threads(config)
    est = estimate(units, config, args.world, shape, rates=step_rates(args, preset, threads),
                   device_free=device_free)
    if device_free is not None:
        est.notes.append(f"device memory: {device_free / 2**30:.1f} GiB ({where})")
    if not torch.cuda.is_available():  # the parts below are a GPU machine's; the last table is this one's
        print(f"(this machine has no GPU: the parts below are a GPU machine's, with {where} device memory, whose "
              "gradients land in pinned host buffers; the largest-model table at the end is this machine's own, "
              "where host memory is the device)")
    print(format_estimate(est, config))
    stages = compare_stages(units, raw, args.world, hidden_size, shape)
    print(format_stages(stages, raw))
    machine = Machine.here(args.nvme_path)
    largest = largest_trainable({k: v for k, v in raw.items() if k != "zero_optimization"} |
                                {"zero_optimization": {k: v for k, v in raw["zero_optimization"].items()
                                                       if k not in ("offload_param", "offload_optimizer")}},
                                machine, args.world)
    print(format_largest(largest, machine, args.world, raw["zero_optimization"].get("sub_group_size", "auto")))
    if args.json:
        import json
        from dataclasses import asdict
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"estimate": asdict(est), "machine": asdict(machine),
                                               "stages": {s: {"tiers": e.tiers, "model_states": e.model_states,
                                                              "zero_formula": model_state_formula(s, e.params,
                                                                                                  e.world)}
                                                          for s, e in stages.items()},
                                               "largest": {k: {"params": n, "limited_by": t}
                                                           for k, (n, t) in largest.items()}}, indent=2))
    return 0
