"""`offload bench step --baseline deepspeed`: offload beside DeepSpeed's ZeRO-Offload/Infinity and plain PyTorch.

For each variant (params and optimizer on the host; with ``--offload nvme`` both on
NVMe too) one config is written once, in DeepSpeed's format, which offload reads as it
is, and both engines are built from that same file, so a reader sees they ran the same
thing. Each side runs in its own processes (W gloo ranks, cores/W threads each; torch one
process on the whole global batch) on the same GPT, seed and batches; rounds alternate
torch, offload, DeepSpeed, so drift of the shared machine falls on all of them alike.
In bf16, plain PyTorch runs twice: under autocast over fp32 weights with fused AdamW (the
same training: fp32 master weights), and on bf16 weights (``torch-bf16``: the compute
offload's and DeepSpeed's bf16 steps do, without master weights, so a speed floor rather
than the same training; autocast casts every weight on every use and is the slower
baseline). Forward, backward and step are timed from outside (synchronised on a GPU),
the same way for every side; each figure is a median over rounds x steps, with its
spread. Peak RSS is the largest rank's.

DeepSpeed builds its ``cpu_adam`` (and, for NVMe, ``async_io``) ops by JIT on first
use, outside the timed steps; the start-up time is reported so users know its cost. Where
``cpu_adam`` does not build (a GPU without the CUDA toolkit its builder wants), DeepSpeed
runs the same config with its ``torch_adam`` switch, and the optimizer column says so.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from offload.bench.step import StepBench, batches, describe_model, sync
from offload.machine.cpus import usable_cpus
from offload.machine.launch import RankError, run_ranks
from offload.models.catalog import lm_loss

if TYPE_CHECKING:
    from offload.optim.sharded import ShardedAdam

INSTALL = ("DeepSpeed is not installed in this environment. Install it beside the torch already here (its own "
           "requirements minus torch), then run again:\n"
           "  pip install --no-deps deepspeed && pip install einops hjson msgpack ninja py-cpuinfo pydantic tqdm\n"
           "or `./dev.sh deepspeed`. On a CPU-only machine it runs on its CPU accelerator (DS_ACCELERATOR=cpu, set "
           "by this command); its NVMe variant needs libaio's headers (apt-get install libaio-dev).")
# torch-bf16 (bf16 runs only): plain PyTorch with bf16 weights as offload's and DeepSpeed's compute has them, and no
# fp32 master weights (not the same training: a speed floor for the like-for-like comparison, where "torch" under
# autocast casts every fp32 weight on every use).
SIDES = ("torch", "torch-bf16", "offload", "deepspeed")
PLAIN = ("torch", "torch-bf16")  # no placement: one run a round serves every variant
PHASES = ("forward", "backward", "optimizer")  # the last: the time in step()


def sides(b: StepBench) -> tuple[str, ...]:
    """The sides this bench runs: torch-bf16 only in bf16, where it differs from torch."""
    return tuple(s for s in SIDES if s != "torch-bf16" or b.dtype == "bf16")


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version, without importing it (None: not installed)."""
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Placement:
    """Where one variant puts parameters and optimizer state, the same for both engines."""

    params: str
    optimizer: str
    ratio: float = 1.0  # offload_optimizer.ratio: the fraction of the optimizer state offloaded
    torch_adam: bool = False  # DeepSpeed steps with torch's Adam instead of its CPU Adam (offload: no effect)

    def describe(self) -> str:
        where = {"none": "the device", "cpu": "the host", "nvme": "NVMe"}
        optimizer = where[self.optimizer] + (f" ({self.ratio:g} of it; the rest on the device)" if self.ratio != 1.0
                                             else "")
        return (f"params on {where[self.params]}, optimizer state on {optimizer}"
                + ("; DeepSpeed steps with torch's Adam" if self.torch_adam else ""))


# The first two run by default (nvme with --offload nvme); the rest when --variants names them.
PLACEMENTS = {"host": Placement("cpu", "cpu"), "nvme": Placement("nvme", "nvme"),
              "optimizer-host": Placement("none", "cpu"),  # ZeRO-Offload's classic setting
              "optimizer-host-torch-adam": Placement("none", "cpu", torch_adam=True),
              "ratio-half": Placement("none", "cpu", ratio=0.5),  # half the optimizer state stays on the device
              "device": Placement("none", "none")}  # nothing offloaded


def variants(b: StepBench, names: tuple[str, ...] = ()) -> dict[str, Placement]:
    """Variant name -> placement (ValueError: a name that is not one)."""
    unknown = [n for n in names if n not in PLACEMENTS]
    if unknown:
        raise ValueError(f"no DeepSpeed variant {', '.join(map(repr, unknown))}: choose from {', '.join(PLACEMENTS)}")
    if names:
        return {n: PLACEMENTS[n] for n in names}
    return {"host": PLACEMENTS["host"]} | ({"nvme": PLACEMENTS["nvme"]} if b.offload == "nvme" else {})


def shared_config(b: StepBench, where: Placement | str) -> dict[str, Any]:
    """The one config both engines read: DeepSpeed's keys only, so neither runs anything the other was not told."""
    place = where if isinstance(where, Placement) else Placement(where, where)
    param: dict[str, Any] = {"device": place.params}
    optimizer: dict[str, Any] = {"device": place.optimizer}
    if place.params == "nvme":
        param.update(nvme_path=b.nvme_path, buffer_count=b.param_buffers)
    if place.optimizer == "nvme":
        optimizer.update(nvme_path=b.nvme_path, buffer_count=b.buffer_count)
    if place.ratio != 1.0:
        optimizer["ratio"] = place.ratio
    adam: dict[str, Any] = {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    extra: dict[str, Any] = {}
    if place.torch_adam:
        adam["torch_adam"] = True
        extra["zero_force_ds_cpu_optimizer"] = False  # DeepSpeed refuses a non-DeepSpeed optimizer with offload
    return extra | {
            "train_micro_batch_size_per_gpu": b.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": adam},
            "bf16": {"enabled": b.dtype == "bf16"},
            "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optimizer,
                                  "sub_group_size": b.sub_group_size,
                                  "stage3_prefetch_bucket_size": 50_000_000},
            "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


@dataclass
class SideRun:
    """One side's timed steps in one round (rank 0's phases; a step's wall time is the slowest rank's)."""

    step_s: list[float]
    phases_s: dict[str, list[float]]
    peak_rss: int
    peak_device: int = 0
    start_s: float = 0.0  # building the engine (DeepSpeed: its JIT op builds on first use)
    optimizer: str = ""  # what stepped: "torch AdamW (fused)", "offload native Adam", DeepSpeed's class


@dataclass
class VersusResult:
    bench: dict[str, Any]
    params: int
    deepspeed: str
    configs: dict[str, str]  # variant -> the config file both engines read
    # variant -> side -> {"step_s", "spread_s", "forward_s", "backward_s", "optimizer_s", "peak_rss",
    # "peak_device", "start_s", "optimizer"}
    table: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> offload/deepspeed, .../torch
    errors: dict[str, str] = field(default_factory=dict)  # "variant/side" -> why it did not run
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def timed(forward: Any, backward: Any, step: Any, b: StepBench, world: int, rank: int, device: str
           ) -> tuple[list[float], dict[str, list[float]]]:
    steps: list[float] = []
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    for i, tokens in enumerate(batches(b, b.warmup + b.steps, b.micro * world)):
        rows = tokens[rank * b.micro:(rank + 1) * b.micro].to(device)
        marks = [time.perf_counter()]
        for fn in (functools.partial(forward, rows), backward, step):
            fn()
            sync(b.device)
            marks.append(time.perf_counter())
        if i >= b.warmup:
            steps.append(marks[-1] - marks[0])
            for p, (a, z) in zip(PHASES, zip(marks, marks[1:], strict=False), strict=True):
                phases[p].append(z - a)
    return steps, phases


def side_rank(rank: int, world: int, side: str, bench: dict[str, Any], config_path: str, clip: float = 1.0
              ) -> dict[str, Any]:
    """One rank of one side: build the model (seed 0), the engine from ``config_path``, time the steps (plain
    PyTorch clips at ``clip``, 0: not at all; an engine as its config says)."""
    b = StepBench(**bench)
    torch.manual_seed(0)
    pure = side == "torch-bf16"
    model = b.build_model(on_device=side in PLAIN, dtype=torch.bfloat16 if pure else None)
    started = time.perf_counter()
    loss: list[torch.Tensor] = []
    opt: torch.optim.Optimizer | ShardedAdam  # plain PyTorch's, or the engine's
    if side in PLAIN:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        autocast = torch.autocast(b.device, dtype=torch.bfloat16, enabled=b.dtype == "bf16" and not pure)
        name = "torch AdamW (fused)" + (" on bf16 weights, no fp32 master" if pure else "")

        def forward(rows: torch.Tensor) -> None:
            with autocast:
                loss[:] = [lm_loss(model, model, rows)]

        def backward() -> None:
            loss[0].backward()

        def step() -> None:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        device = b.device
    else:
        if side == "deepspeed":
            engine, name = deepspeed_engine(model, b, config_path)
        else:
            import offload
            engine, optimizer, _, _ = offload.initialize(model=model, config=config_path)
            opt = engine.optimizer  # where the state is, as the engine placed it ("auto" included)
            on_host = any(opt.steps_on_host(i) for i in opt.shards)
            name = _offload_optimizer_name(on_host, not opt.offload or opt.partial, engine.step_mode,
                                           discrete=not engine.accel.host_is_device)
        device = str(engine.device) if side == "deepspeed" else str(engine.accel.device)

        def forward(rows: torch.Tensor) -> None:
            loss[:] = [lm_loss(model, engine, rows)]

        def backward() -> None:
            engine.backward(loss[0])

        def step() -> None:
            engine.step()
    start_s = time.perf_counter() - started
    steps, phases = timed(forward, backward, step, b, world, rank, device)
    peak_device = torch.cuda.max_memory_allocated() if b.device == "cuda" else 0
    if side == "offload":
        engine.close()  # its swap files go with it
    return asdict(SideRun(steps, phases, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_device,
                          start_s, name))


def _offload_optimizer_name(on_host: bool, on_device: bool, step_mode: str, discrete: bool = True) -> str:
    """Which Adam offload ran: its native kernel for state on the host, torch's fused kernel for state on a
    discrete device (on a CPU device, the native kernel there too)."""
    mode = step_mode.split(" (")[0].split(":")[0]
    if on_device and not discrete:
        where = "on the host and the device" if on_host else "on the device"
        return f"offload native Adam {where} ({mode})"
    if not on_host:
        return f"offload torch fused Adam on the device ({mode})"
    if on_device:
        return f"offload native Adam on the host, torch fused Adam on the device ({mode})"
    return f"offload native Adam ({mode})"


# What DeepSpeed's op builder says when it cannot build an op (no CUDA toolkit beside a visible GPU, say).
OP_BUILD_FAILURES = ("cpu_adam", "CUDA_HOME", "nvcc", "Error building extension")


def deepspeed_arch_list(archs: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT builder parses it: without the arch-specific suffixes
    ("9.0a", "10.0f") that CUDA 12.8+ images set and its version sort cannot read."""
    return re.sub(r"(\d+\.\d+)[af]", r"\1", archs)


def _op_build_failed(e: BaseException) -> bool:
    """Whether ``e`` came out of DeepSpeed's op builder: its message names the build, or it was raised inside the
    builder (on torch 2.11 with CUDA 13 the builder's parsing of the arch "9.0a" raises a bare ValueError)."""
    if any(word in str(e) for word in OP_BUILD_FAILURES):
        return True
    tb = e.__traceback__
    while tb is not None:
        if "op_builder" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def deepspeed_engine(model: Any, b: StepBench, config_path: str) -> tuple[Any, str]:
    """DeepSpeed's engine from the shared config, and the name of the optimizer it steps with. Where its
    cpu_adam op does not build, the same config with DeepSpeed's own switch to torch's Adam (a key offload reads
    as no effect), and the name says so."""
    import deepspeed
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # this is DeepSpeed's own process: its builder reads it
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    deepspeed.init_distributed(dist_backend="gloo" if b.device == "cpu" else "nccl")
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config_path)
        return engine, type(getattr(optimizer, "optimizer", optimizer)).__name__
    except Exception as e:  # noqa: BLE001 - DeepSpeed's op builds raise what their tools raise
        if not _op_build_failed(e):
            raise
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120] if str(e).strip() else ''}"
    config = json.loads(Path(config_path).read_text())
    config["optimizer"]["params"]["torch_adam"] = True
    config["zero_force_ds_cpu_optimizer"] = False
    torch.manual_seed(0)  # a fresh model: the failed initialize may have partitioned the first
    fresh = b.build_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=config)
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__
    return engine, f"{name} (torch_adam: DeepSpeed's Adam op did not build: {reason})"


def run(b: StepBench, out: Path, log: TextIO | None = None, names: tuple[str, ...] = ()) -> VersusResult:
    """Alternating rounds of torch, offload and DeepSpeed per variant (``names``: these, see ``PLACEMENTS``), the
    result in ``out`` and the config each variant's sides read beside it; raises RuntimeError without DeepSpeed."""
    version = deepspeed_version()
    if version is None:
        raise RuntimeError(INSTALL)
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, usable_cpus() // b.world)
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if b.device == "cpu" else {}
    configs = {}
    path: Path | str  # a variant's config: written to a Path, handed to its ranks as a string
    for name, where in variants(b, names).items():
        path = out_dir / f"config-{name}.json"
        path.write_text(json.dumps(shared_config(b, where), indent=2))
        configs[name] = str(path)
    result = VersusResult(asdict(b), b.num_parameters(), version, configs)
    plain: dict[str, list[dict[str, Any]]] = {s: [] for s in PLAIN}  # one run a round serves every variant
    runs = {v: plain | {"offload": [], "deepspeed": []} for v in configs}
    for r in range(b.repeats):
        for name, path in configs.items():
            for side in sides(b):
                if side in PLAIN and len(plain[side]) > r:
                    continue
                key = f"{name}/{side}"
                if key in result.errors:
                    continue
                # torch is one process on the whole global batch (the same rows), as a PyTorch user runs it
                world, bench = (1, replace(b, micro=b.micro * b.world, world=1)) if side in PLAIN else (b.world, b)
                try:
                    ranks = run_ranks(side_rank, world, timeout=3600, threads=threads * b.world // world, env=env,
                                      side=side, bench=asdict(bench), config_path=path)
                except RankError as e:
                    result.errors[key] = str(e).strip().splitlines()[-1]
                    if log:
                        print(f"  {key} failed: {result.errors[key]}", file=log, flush=True)
                    continue
                first = dict(ranks[0])
                first["step_s"] = [max(ts) for ts in zip(*(rank["step_s"] for rank in ranks), strict=True)]
                first["peak_rss"] = max(rank["peak_rss"] for rank in ranks)
                runs[name][side].append(first)
            if log:
                print(f"  round {r + 1}/{b.repeats} {name}: " + ", ".join(
                    f"{s} {statistics.median(x for run in runs[name][s] for x in run['step_s']):.3f} s"
                    for s in sides(b) if runs[name][s]), file=log, flush=True)
    for name in configs:
        result.table[name], result.samples[name] = {}, {}
        for side in sides(b):
            done = runs[name][side]
            if not done:
                continue
            steps = [x for run in done for x in run["step_s"]]
            row: dict[str, Any] = {"step_s": statistics.median(steps), "spread_s": [min(steps), max(steps)]}
            row |= {f"{p}_s": statistics.median(x for run in done for x in run["phases_s"][p]) for p in PHASES}
            row |= {"peak_rss": max(run["peak_rss"] for run in done),
                    "peak_device": max(run["peak_device"] for run in done),
                    "start_s": done[0]["start_s"], "optimizer": done[0]["optimizer"]}
            result.table[name][side] = row
            result.samples[name][side] = steps
        t = {s: result.table[name][s]["step_s"] for s in result.table[name]}
        result.ratios[name] = {f"offload/{s}": t["offload"] / t[s] for s in ("deepspeed", *PLAIN)
                               if "offload" in t and s in t}
        result.ratios[name] |= {f"deepspeed/{s}": t["deepspeed"] / t[s] for s in PLAIN if "deepspeed" in t and s in t}
    out.write_text(json.dumps(asdict(result), indent=2))
    return result


def print_table(result: VersusResult, out: TextIO) -> None:
    b = result.bench
    print(f"{describe_model(b, result.params)}, vocabulary {b['vocab']}, seq {b['seq']}, "
          f"micro-batch {b['micro']}), {b['dtype']}, W = {b['world']}, {b['device']}; DeepSpeed {result.deepspeed}; "
          f"median of {b['repeats']} rounds x {b['steps']} steps (min-max)", file=out)
    for name, sides in result.table.items():
        print(f"\n{name}: {PLACEMENTS[name].describe() if name in PLACEMENTS else name} "
              f"(both read {result.configs[name]})", file=out)
        gpu = b["device"] == "cuda"  # the GPU memory high-water mark, beside the host's peak RSS
        print(f"  {'side':10s} {'step s':>8s} {'min-max':>15s} {'forward':>8s} {'backward':>8s} {'step':>7s} "
              f"{'peak RSS':>9s}{'  GPU peak' if gpu else ''} {'start s':>8s}  optimizer", file=out)
        for side, row in sides.items():
            lo, hi = row["spread_s"]
            device = f" {row.get('peak_device', 0) / 2**30:9.2f}G" if gpu else ""
            print(f"  {side:10s} {row['step_s']:8.3f} {f'{lo:.3f}-{hi:.3f}':>15s} {row['forward_s']:8.3f} "
                  f"{row['backward_s']:8.3f} {row['optimizer_s']:7.3f} {row['peak_rss'] / 2**30:8.2f}G{device} "
                  f"{row['start_s']:8.1f}  {row['optimizer']}", file=out)
        ratios = result.ratios.get(name, {})
        if ratios:
            print("  " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), file=out)
    for key, why in result.errors.items():
        print(f"\n{key} did not run: {why}", file=out)
