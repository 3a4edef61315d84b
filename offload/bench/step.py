"""`offload bench step`: a ZeRO-3 training step with the CPU optimizer beside plain single-process PyTorch.

Both train the same GPT on the same global batch: offload on W ranks over gloo (each
rank a process with cores/W threads, so both sides use the whole machine), torch in
one process with torch.optim.AdamW(fused=True) (with bf16: fp32 parameters under bf16
autocast; with --optimizer muon, torch.optim.Muon on the hidden matrices beside it).
Runs alternate (torch, offload, torch, ...) so drift of the shared machine falls on
both alike; each figure is a median.

The offload step is split by the engine's telemetry into gather, reduce-scatter,
waiting for gradients to reach the host, and the optimizer (norm + Adam); compute is
what remains. The copy and host threads' busy time (d2h, accumulate, h2d) runs beside
the step and is reported as background time. The ratio offload/torch is what
sharding costs on this machine: on one host the "device" is CPU memory, so every
gather and copy is overhead that a GPU job would spend on other buses.

With ``--offload nvme`` the swap files live under ``--nvme-path`` and these variants
alternate with torch: parameters and optimizer state both on NVMe (the headline),
both on the host (the cost of the disk is nvme/host), only the optimizer state on
NVMe, parameters on NVMe without read-ahead (prefetch off: every read on demand, the
gain of read-ahead), and the optimizer state on NVMe with one buffer (read, compute,
write in turn: the gain of pipelining is serial/pipelined on the optimizer phase),
and without clipping the optimizer state on NVMe with its sub-groups stepped during
backward beside the same all-host config. For parameter reads the share hidden is
1 - (time the training thread waited for a read) / (time reads were in flight); for
the optimizer state, 1 - (what the disk added to the step beside its all-host pair) /
(time its transfers were in flight).

With ``--stage 0,1,2,3`` the variants are the ZeRO stages instead, each with the
optimizer state where ``--offload`` says (stage 0 cannot offload it: on the compute
device), side by side with torch: step time, and each rank's bytes per tier from the
engine's own accounting, in one table and one plot (``stages.png``).

[Note: bytes per step] Times and phases are taken over the timed steps, whose first
forward waits for the last warm-up step's work still running (an early step's NVMe
pass), as every later one waits for its predecessor's: the steady state. Bytes are
counted when a transfer is issued, so that same window would count whatever of the
warm-up's pass came after its start, and whatever of the last pass came before its
end: how much depends on how fast the pass runs against the training thread (an H200
counted 0.8 GB a step more for nvme-early than for nvme, a CPU the same bytes). So
bytes are counted over whole steps instead: from the last warm-up step, begun with
nothing in flight, to the end of the last step's pass, scaled to the timed steps. The
step before that one must be like the timed ones: a whole step reads the next
forward's parameters ahead, an early one leaves them to the forward, so a whole first
step (it speculates) would put one forward's reads outside the window.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from offload.engine.muon_groups import uses_muon
from offload.machine.cpus import default_threads, usable_cpus
from offload.machine.host_malloc import DEFAULT_THRESHOLD, resident
from offload.machine.launch import run_ranks
from offload.models.catalog import lm_loss
from offload.observe.telemetry import BACKGROUND, FOREGROUND
from offload.store.state_format import FORMATS
from offload.zero.compiled import compile_blocks

NOISE_FLOOR_S = 0.05  # CPU steps shorter than this time mostly the machine's noise (thread wake-ups, other tenants)
# `--state-format`: offload.optimizer_state's (master, moments) by the names the benchmarks give them
STATE_FORMATS = {cli: FORMATS[name].names() for cli, name in (
    ("fp32", "fp32"), ("bf16-moments", "bf16 moments"), ("16+16", "16+16 master"),
    ("bf16-master", "bf16 master stochastic"),
    ("bf16-master-nearest", "bf16 master nearest"))}
# The variants `--optimizer muon` runs unless --variants names others: Muon's step runs whole after backward.
MUON_VARIANTS = ("host", "clip-after", "noclip-after", "params-host")
# Variants that run only when --variants names them.
NAMED_ONLY = ("ratio-auto", "ratio-half", "delayed", "host-spare-cores", "nvme-optimizer-speculative",
              "nvme-optimizer-speculative-kept", "nvme-optimizer-early", "nvme-early", "params-host-bf16-moments",
              "params-host-bf16-master", "params-host-16-16", "nvme-optimizer-bf16-moments",
              "nvme-optimizer-bf16-master", "params-host-stream-half", "params-host-stream-all",
              "params-host-stream-half-noclip", "params-host-stream-half-16-16", "params-host-stream-auto")


@dataclass(kw_only=True)
class StepBench:
    # A model of offload/models/catalog.py by name (gpt2, llama-1b, ...) at its own size, which hidden, layers
    # and heads override where they are not 0; "": the built-in GPT at hidden x layers.
    model: str = ""
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 4096
    seq: int = 128
    micro: int = 4
    accum: int = 1  # micro-batches per step (gradient accumulation), on both sides
    unit_bytes: int = 4 << 20  # offload.unit_bytes of the offload variants
    world: int = 2
    steps: int = 5
    # Three: the first step differs (it speculates, so it is stepped whole), and bytes count from the last warm-up
    # step on, which must follow one like the timed steps (see [Note: bytes per step]).
    warmup: int = 3
    repeats: int = 2
    dtype: str = "fp32"
    offload: str = "cpu"  # where the optimizer state lives: cpu, or nvme (then three variants run)
    nvme_path: str = "/tmp/offload-bench-step"
    sub_group_size: int = 1_000_000
    buffer_count: int = 4
    param_buffers: int = 4  # offload_param.buffer_count for the variants with parameters on NVMe (fewer than units)
    trace_dir: str = ""  # where rank 0 of each variant writes a Chrome trace of its timed steps ("": none)
    profile: bool = False  # rank 0 of the headline variant's timed steps under torch's profiler, into trace_dir
    device: str = "cpu"  # cpu, or cuda: both sides compute on the GPU (then world must be 1)
    headline_only: bool = False  # only the headline variant (and, for nvme, the host one beside it): a smoke run
    stages: tuple[int, ...] = (3,)  # ZeRO stages; more than stage 3 alone: one variant per stage (see the docstring)
    checkpointing: str = "none"  # activation checkpointing of every block in every variant: none, device or cpu
    only: tuple[str, ...] = ()  # run only these variants (by name, the first one is the headline); (): all
    # offload.budgets.device of offload's variants (None: what is free at start). A budget below the optimizer
    # state's size makes ratio "auto" split it as it would on a smaller GPU; plain PyTorch is not bounded.
    device_budget: int | None = None
    # offload.optimizer_state (master, moments) of every variant that names none (`--state-format`)
    state: tuple[str, str] = STATE_FORMATS["fp32"]
    compile: str = ""  # a torch.compile backend: every side's repeated blocks compiled with it ("": eager)
    # adamw, or muon: torch.optim.Muon on the hidden matrices beside AdamW on the rest on every side (offload: the
    # config's type Muon, whose step runs whole after backward: only the variants that take it run)
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.warmup < 1:  # bytes count from the last warm-up step, begun with nothing in flight
            raise ValueError(f"warmup must be at least 1 step, got {self.warmup}")
        if self.model:
            from offload.models.catalog import require
            require(self.model)  # ModelError is a ValueError: the command line's usage error
        elif not (self.hidden and self.layers and self.heads):
            raise ValueError(f"the built-in GPT needs hidden, layers and heads, got {self.hidden}, {self.layers}, "
                             f"{self.heads}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: this machine has no usable GPU (torch.cuda.is_available() is False)")
        if self.device == "cuda" and self.world != 1:
            raise ValueError(f"device cuda runs one rank on the one GPU; got world {self.world}: pass --world 1")
        if self.checkpointing not in ("none", "device", "cpu"):
            raise ValueError(f"checkpointing must be none, device or cpu, got {self.checkpointing!r}")
        if not self.stages or any(s not in (0, 1, 2, 3) for s in self.stages):
            raise ValueError(f"stages must be ZeRO stages 0-3, got {self.stages}")
        if self.profile and not self.trace_dir:
            raise ValueError("profile writes its trace into trace_dir: give one")
        if self.accum < 1 or self.unit_bytes < 1:
            raise ValueError(f"accum and unit_bytes must be >= 1, got {self.accum} and {self.unit_bytes}")
        if self.device_budget is not None and self.device_budget < 1:
            raise ValueError(f"device_budget must be a positive number of bytes, got {self.device_budget}")
        if self.offload == "none" and self.stages == (3,):
            raise ValueError("offload none compares stages only: pass stages (e.g. --stage 0,1,2,3)")
        unknown = [name for name in self.only if name not in self._all_variants()]
        if unknown:
            raise ValueError(f"no variant {', '.join(map(repr, unknown))} with offload {self.offload}: choose from "
                             + ", ".join(self._all_variants()))

    @property
    def compares_stages(self) -> bool:
        return tuple(self.stages) != (3,)

    def variants(self) -> dict[str, dict[str, Any]]:
        """Offload configurations compared in this run, by name: the first one is the headline."""
        every = self._all_variants()
        if self.only:
            return {name: every[name] for name in self.only}
        if self.optimizer == "muon":
            return {name: v for name, v in every.items() if name in MUON_VARIANTS}
        return {name: v for name, v in every.items() if name not in NAMED_ONLY}

    def _all_variants(self) -> dict[str, dict[str, Any]]:
        if self.compares_stages:
            out = {}
            for stage in self.stages:
                device = self.offload if stage > 0 else "none"
                variant: dict[str, Any] = {"device": device, "stage": stage}
                if device == "nvme":
                    variant["buffer_count"] = self.buffer_count
                out[f"stage{stage}"] = variant
            return out
        if self.headline_only:
            every = StepBench(offload=self.offload)._all_variants()
            return {k: v for k, v in every.items() if k in ("host", "nvme")}
        if self.offload == "cpu":
            return {"host": {"device": "cpu"}, "host-no-prefetch": {"device": "cpu", "prefetch": 0},
                    # Clipping (max norm 1.0) gates the update: Adam after backward, or speculated during it with
                    # the unclipped factor, kept where clipping does not fire (max norm 1e9) and recomputed where
                    # it does (1e-9).
                    "clip-after": {"device": "cpu", "speculative": "off"},
                    "clip-speculative-kept": {"device": "cpu", "clip": 1e9, "speculative": "on"},
                    "clip-speculative-recomputed": {"device": "cpu", "clip": 1e-9, "speculative": "on"},
                    # Run only when named (--variants): part of the optimizer state on the device.
                    "ratio-auto": {"device": "cpu", "ratio": "auto"}, "ratio-half": {"device": "cpu", "ratio": 0.5},
                    # ... and the delayed update after one exact step (not exact: results differ by design).
                    "delayed": {"device": "cpu", "delayed": 1},
                    # ... and the host Adam on two threads fewer than the cores this process may use, leaving them
                    # to the training thread and the driver (the pool splits each call evenly: one thread that
                    # loses its core holds up the whole call). Per rank: W ranks on one host take that many each.
                    "host-spare-cores": {"device": "cpu", "spare_cores": 2},
                    # Without clipping the step can overlap backward; the same config with overlap off is its pair.
                    "noclip-overlap": {"device": "cpu", "clip": 0.0, "overlap": "on"},
                    "noclip-after": {"device": "cpu", "clip": 0.0, "overlap": "off"},
                    # Parameters homed on the host too (the early step needs host homes), stepped whole and early.
                    "params-host": {"device": "cpu", "params": "cpu", "early": "off"},
                    "params-host-early": {"device": "cpu", "params": "cpu", "early": "on"},
                    # The state in fewer bytes (run when named; a bf16 master needs --dtype bf16).
                    "params-host-bf16-moments": {"device": "cpu", "params": "cpu", "early": "off",
                                                 "state": STATE_FORMATS["bf16-moments"]},
                    "params-host-bf16-master": {"device": "cpu", "params": "cpu", "early": "off",
                                                "state": STATE_FORMATS["bf16-master"]},
                    # the 16+16 master, its high halves the host-homed weights (6 bytes of state an element)
                    "params-host-16-16": {"device": "cpu", "params": "cpu", "early": "off",
                                          "state": STATE_FORMATS["16+16"]},
                    # The streamed lane (offload.stream_state): the device steps part of the host-homed state
                    # over the bus beside the host's Adam (run when named; a CPU device streams nothing).
                    "params-host-stream-half": {"device": "cpu", "params": "cpu", "stream": 0.5},
                    "params-host-stream-all": {"device": "cpu", "params": "cpu", "stream": 1.0},
                    # the share chosen by the rates start-up measures (offload.stream_state auto)
                    "params-host-stream-auto": {"device": "cpu", "params": "cpu", "stream": "auto"},
                    "params-host-stream-half-noclip": {"device": "cpu", "params": "cpu", "stream": 0.5, "clip": 0.0},
                    "params-host-stream-half-16-16": {"device": "cpu", "params": "cpu", "stream": 0.5,
                                                      "state": STATE_FORMATS["16+16"]}}
        return {"nvme": {"device": "nvme", "buffer_count": self.buffer_count, "params": "nvme"},
                "host": {"device": "cpu", "params": "cpu"},
                "nvme-optimizer": {"device": "nvme", "buffer_count": self.buffer_count, "params": "cpu"},
                "nvme-no-readahead": {"device": "nvme", "buffer_count": self.buffer_count, "params": "nvme",
                                      "prefetch": 0},
                "nvme-serial": {"device": "nvme", "buffer_count": 1, "params": "cpu"},
                # Without clipping the optimizer's NVMe sub-groups step during backward; all-host is its baseline.
                "nvme-optimizer-overlap": {"device": "nvme", "buffer_count": self.buffer_count, "params": "cpu",
                                           "clip": 0.0, "overlap": "on"},
                "host-overlap": {"device": "cpu", "params": "cpu", "clip": 0.0, "overlap": "on"},
                # With clipping, the optimizer's NVMe sub-groups speculated during backward (run when named).
                "nvme-optimizer-speculative": {"device": "nvme", "buffer_count": self.buffer_count,
                                               "params": "cpu", "speculative": "on"},
                "nvme-optimizer-speculative-kept": {"device": "nvme", "buffer_count": self.buffer_count,
                                                    "params": "cpu", "speculative": "on", "clip": 1e9},
                # ... and its pass run beside the next forward and backward, after step() returned (run when named).
                "nvme-optimizer-early": {"device": "nvme", "buffer_count": self.buffer_count, "params": "cpu",
                                         "early": "on"},
                # ... with the parameter shards on NVMe too, written after step() returned (run when named).
                "nvme-early": {"device": "nvme", "buffer_count": self.buffer_count, "params": "nvme",
                               "early": "on"},
                # ... and the state in fewer bytes, read and written each step (run when named).
                "nvme-optimizer-bf16-moments": {"device": "nvme", "buffer_count": self.buffer_count, "params": "cpu",
                                                "state": STATE_FORMATS["bf16-moments"]},
                "nvme-optimizer-bf16-master": {"device": "nvme", "buffer_count": self.buffer_count, "params": "cpu",
                                               "state": STATE_FORMATS["bf16-master"]}}

    def model_config(self) -> Any:
        from offload.models import GPTConfig
        return GPTConfig(vocab_size=self.vocab, context=self.seq, hidden_size=self.hidden, layers=self.layers,
                         heads=self.heads)

    def build_model(self, on_device: bool = False, dtype: torch.dtype | None = None) -> nn.Module:
        """The model every side trains, freshly initialised (the caller seeds torch first): in host memory, as a
        user's model reaches ``offload.initialize``, or with ``on_device`` on the device (in ``dtype`` if given), as
        plain PyTorch trains it.

        On a GPU its weights are drawn there, where the model fits in half its free memory: torch's CPU generator
        draws one value at a time, twice over each weight (the layer's own initialiser, then the model's): 13 s a
        side for the 0.91B GPT on a 2-core Xeon, about a minute for the 4.5B one, five sides a round, where the GPU
        takes milliseconds. Every side draws from the same generator, so all train the same weights, and the GPU's
        high-water mark is reset after the build: what a side reports is its own, not the construction's."""
        on_gpu = self.device == "cuda" and draw_on_gpu(self.num_parameters(), torch.cuda.mem_get_info()[0])
        with torch.device("cuda" if on_gpu else "cpu"):
            model = self._construct()
        if on_device:
            model = model.to(self.device, dtype)
        elif on_gpu:
            model = model.cpu()
        if self.device == "cuda":
            torch.cuda.empty_cache()  # nothing of the construction stays cached to crowd what `auto` measures
            torch.cuda.reset_peak_memory_stats()
        return model

    def _construct(self) -> nn.Module:
        if not self.model:
            from offload.models import GPT
            return GPT(self.model_config())
        from offload.models.catalog import build_model
        return build_model(self.model, self.vocab, self.seq, self.layers or None, self.hidden or None,
                           self.heads or None)

    def num_parameters(self) -> int:
        if not self.model:
            return self.model_config().num_parameters
        with torch.device("meta"):  # a size, not a model: no memory, no initialisation
            return sum(p.numel() for p in self._construct().parameters())


def draw_on_gpu(params: int, free_bytes: int) -> bool:
    """Whether a model of ``params`` weights is initialised on the GPU: where their fp32 bytes fit in half of the
    ``free_bytes`` it has (the rest for the side's own work), else on the host."""
    return 4 * params <= free_bytes // 2


def describe_model(bench: dict[str, Any], params: int) -> str:
    """A run's model (``asdict`` of its StepBench) in a table's title, its parenthesis left open."""
    if not bench.get("model"):
        return f"GPT {params / 1e6:.1f}M ({bench['layers']} x {bench['hidden']}"
    size = ", ".join(f"{k} {bench[k]}" for k in ("layers", "hidden") if bench[k])
    return f"{bench['model']} {params / 1e6:.1f}M ({size or 'its own size'}"


@dataclass
class StepResult:
    bench: dict[str, Any]
    params: int
    torch_step_s: float | None  # None: plain PyTorch did not fit on the device (torch_note says so)
    offload_step_s: float
    ratio: float | None
    phases_s: dict[str, float] = field(default_factory=dict)  # per step, training thread
    background_s: dict[str, float] = field(default_factory=dict)  # per step, copy/host threads
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    variants: dict[str, dict[str, float]] = field(default_factory=dict)  # per variant: step, optimizer, NVMe stall
    peak_device_bytes: dict[str, int] = field(default_factory=dict)  # on a GPU: torch's and each variant's high water
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # per variant: rank 0's bytes per tier (accounting)
    # per variant, measured: the largest rank's anonymous RSS after its timed steps ("rss", what it allocated; None
    # where the system does not say) and its peak RSS ("peak", model construction included), in the last round
    host_rss: dict[str, dict[str, int | None]] = field(default_factory=dict)
    torch_note: str = ""  # why plain PyTorch has no time ("": it ran)

    def vs_torch(self, seconds: float) -> str:
        return f"{seconds / self.torch_step_s:.2f}x torch" if self.torch_step_s else "torch did not fit"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def batches(b: StepBench, n: int, rows: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, b.vocab, (rows, b.seq + 1), generator=gen) for _ in range(n)]


def engine_config(b: StepBench, variant: dict[str, Any]) -> dict[str, Any]:
    """The engine config of one variant (its keys as ``StepBench.variants`` gives them)."""
    optimizer = {"device": variant["device"], "ratio": variant.get("ratio", 1.0)}
    if variant["device"] == "nvme":
        optimizer.update(nvme_path=b.nvme_path, buffer_count=variant["buffer_count"])
    param = {"device": variant.get("params", "none")}
    if param["device"] == "nvme":  # every shard on NVMe: what the disk costs, not what max_in_cpu hides
        param.update(nvme_path=b.nvme_path, max_in_cpu=0, buffer_count=b.param_buffers)
    config = {"train_micro_batch_size_per_gpu": b.micro, "gradient_accumulation_steps": b.accum,
              "gradient_clipping": variant.get("clip", 1.0),
              "optimizer": {"type": "Muon", "params": {"lr": 1e-4, "muon_lr": MUON_LR, "weight_decay": 0.1}}
              if b.optimizer == "muon" else {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "bf16": {"enabled": b.dtype == "bf16"},
              "zero_optimization": {"stage": variant.get("stage", 3), "offload_optimizer": optimizer,
                                    "offload_param": param,
                                    "sub_group_size": b.sub_group_size,
                                    "stage3_prefetch_bucket_size": variant.get("prefetch", 50_000_000)},
              "offload": {"unit_bytes": b.unit_bytes, "overlap_step": variant.get("overlap", "auto"),
                          "cpu_threads": max(1, default_threads() - variant["spare_cores"])
                          if "spare_cores" in variant else None,
                          "early_step": variant.get("early", "auto"),
                          "speculative_step": variant.get("speculative", "auto"),
                          "delayed_update": {"warmup_steps": variant.get("delayed")},
                          "stream_state": variant.get("stream", 0.0),
                          "checkpoint_blocks": b.checkpointing != "none",
                          "optimizer_state": dict(zip(("master", "moments"), variant.get("state", b.state),
                                                      strict=False)),
                          "budgets": {"device": b.device_budget},
                          # as `offload train` sets it: the RSS each variant reports then tracks what is live
                          "host_malloc": {"mmap_threshold": DEFAULT_THRESHOLD}},
              "activation_checkpointing": {"cpu_checkpointing": b.checkpointing == "cpu"}}
    return config


def _engine_rank(rank: int, world: int, bench: dict[str, Any], variant: dict[str, Any]) -> dict[str, Any]:
    import offload
    b = StepBench(**bench)
    torch.manual_seed(0)
    model = b.build_model()
    if b.compile:  # before initialize: each block is then one unit (see offload/zero/compiled.py)
        compile_blocks(model, b.compile, {})
    engine, *_ = offload.initialize(model=model, config=engine_config(b, variant))
    profiler = _profiler(b) if b.profile and rank == 0 and variant["name"] == next(iter(b.variants())) else None
    times = []
    start = engine.telemetry.snapshot()
    for i, tokens in enumerate(batches(b, b.warmup + b.steps, b.micro * world * b.accum)):
        if i == b.warmup - 1:  # bytes count from here, nothing in flight (see [Note: bytes per step])
            engine.optimizer.drain()
            engine.telemetry.reset()
        if i == b.warmup:
            start = engine.telemetry.snapshot()
            engine.telemetry.start_trace()
            if profiler is not None:
                profiler.start()
        sync(b.device)
        t0 = time.perf_counter()
        for a in range(b.accum):  # micro-batch a of the step: this rank's rows of it
            first = (a * world + rank) * b.micro
            rows = tokens[first:first + b.micro].to(engine.accel.device)
            engine.backward(lm_loss(model, engine, rows))
            engine.step()
        sync(b.device)
        if i >= b.warmup:
            times.append(time.perf_counter() - t0)
    if profiler is not None:
        profiler.stop()
        Path(b.trace_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(b.trace_dir) / f"profile-{variant['name']}.json"))
    peak = engine.accel.memory_stats().peak_allocated if b.device == "cuda" else 0
    timed = engine.telemetry.snapshot()
    engine.telemetry.stop_trace()  # the trace and the overlap share are the timed steps', not the drain's
    engine.optimizer.drain()  # the last step's pass, if it returned early: its bytes are this window's
    moved, counted = engine.telemetry.snapshot().bytes, b.steps + 1
    if b.trace_dir and rank == 0:
        engine.telemetry.export_chrome_trace(Path(b.trace_dir) / f"step-trace-{variant['name']}.json", rank)
    overlap = engine.telemetry.overlap_share()
    memory = {tier: sum(v for k, v in parts.items()
                        if k not in ("total", "peak", "budget", "gathered_now", "activations_now"))
              for tier, parts in engine.memory_summary().items()}
    rss = resident()  # after the timed steps, the engine still open: what the training holds
    engine.close()
    return {"times": times, "rss": rss.anon, "peak_rss": rss.peak, "seconds": _since(start.seconds, timed.seconds),
            "counts": _since(start.counts, timed.counts),
            "bytes": {k: v * b.steps / counted for k, v in moved.items()},  # as for b.steps steps
            "overlap": overlap, "peak": peak, "memory": memory,
            "adam_threads": engine.optimizer.threads or default_threads()}  # the host kernels' (per rank)


def _since(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in now.items()}


def _profiler(b: StepBench) -> torch.profiler.profile:
    """torch's profiler over the timed steps: kernels and copies per stream on a GPU, and the engine's phases as
    ranges on their threads (telemetry opens them while a profiler records)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if b.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _torch_steps(b: StepBench) -> tuple[list[float], int, str]:
    """Step times of plain PyTorch and its GPU memory high water, or no times and why: a model offload is for may
    not fit on the GPU without it, and the offload variants still compare with each other."""
    try:
        return (*_torch_timed(b), "")
    except RuntimeError as e:  # torch.OutOfMemoryError is one, and so are cuBLAS's failed allocations
        if not isinstance(e, torch.OutOfMemoryError) and not _out_of_memory(str(e)):
            raise
        why = str(e).splitlines()[0] if str(e) else "out of memory"
    # Outside the handler: the traceback, and the model and optimizer its frames hold, are gone.
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    return [], 0, f"plain PyTorch ran out of {b.device} memory ({why})"


def _out_of_memory(message: str) -> bool:
    return "out of memory" in message.lower() or "ALLOC_FAILED" in message


MUON_LR = 0.02  # the Muon matrices' rate (the rest's AdamW keeps 1e-4)


def _torch_optimizers(b: StepBench, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Plain PyTorch's optimizers: the fused AdamW, or torch.optim.Muon on the matrices offload's type Muon gives
    it (offload/engine/muon_groups.py) and the fused AdamW on the rest."""
    if b.optimizer != "muon":
        return [torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)]
    halves: dict[bool, list[nn.Parameter]] = {True: [], False: []}
    for name, param in model.named_parameters():
        halves[uses_muon(param, name)].append(param)
    return [torch.optim.Muon(halves[True], lr=MUON_LR, weight_decay=0.1),
            torch.optim.AdamW(halves[False], lr=1e-4, weight_decay=0.1, fused=True)]


def _torch_timed(b: StepBench) -> tuple[list[float], int]:
    """Step times of plain PyTorch (model and AdamW on ``b.device``) and, on a GPU, its memory high water.

    With bf16 the baseline is what a PyTorch user runs: fp32 parameters, bf16 autocast, and the fused AdamW."""
    torch.manual_seed(0)
    model = b.build_model(on_device=True)
    if b.compile:
        compile_blocks(model, b.compile, {})
    opts = _torch_optimizers(b, model)
    autocast = torch.autocast(b.device, dtype=torch.bfloat16, enabled=b.dtype == "bf16")
    times = []
    rows = b.micro * b.world
    for i, tokens in enumerate(batches(b, b.warmup + b.steps, rows * b.accum)):
        tokens = tokens.to(b.device)
        sync(b.device)
        t0 = time.perf_counter()
        for a in range(b.accum):  # the step's micro-batches, every rank's rows at once
            part = tokens[a * rows:(a + 1) * rows]
            with autocast:
                loss = lm_loss(model, model, part)
            (loss / b.accum if b.accum > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(b.device)
        if i >= b.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if b.device == "cuda" else 0
    del model, opts
    if b.device == "cuda":
        torch.cuda.empty_cache()
    return times, peak


def run(b: StepBench, out_path: Path | None = None, log: TextIO | None = None) -> StepResult:
    cores = usable_cpus()  # not the host's count: a container's slice of it (offload/machine/cpus.py)
    variants = b.variants()
    torch_times: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in variants}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    peaks: dict[str, int] = {}
    last: dict[str, list[dict[str, Any]]] = {}  # each variant's ranks in the last round
    # A CPU comparison keeps a GPU out of it: the one-rank child would otherwise pick it up.
    env = {"CUDA_VISIBLE_DEVICES": ""} if b.device == "cpu" else {}
    torch_note = ""
    for r in range(b.repeats):
        if not torch_note:
            torch_run, peak, torch_note = _torch_steps(b)
            torch_times += torch_run
            if not torch_note:
                peaks["torch"] = peak
            else:  # no times at all then, not some rounds': a baseline that fits only sometimes is none
                torch_times.clear()
                peaks.pop("torch", None)
                if log:
                    print(f"  {torch_note}: the offload variants run without it", file=log, flush=True)
        for name, variant in variants.items():
            ranks = run_ranks(_engine_rank, b.world, timeout=1800, threads=max(1, cores // b.world),
                              env=env, bench=asdict(b), variant={**variant, "name": name})
            peaks[name] = ranks[0]["peak"]
            # a step ends on the last rank
            times[name] += [max(ts) for ts in zip(*(rank["times"] for rank in ranks), strict=True)]
            runs[name].append(ranks[0])
            last[name] = ranks
        if log:
            mine = f"{statistics.median(torch_times):.3f} s/step" if torch_times else "did not fit"
            print(f"  round {r + 1}/{b.repeats}: torch {mine}, " + ", ".join(
                f"offload {n} {statistics.median(t):.3f}" for n, t in times.items()), file=log, flush=True)
    steps = b.steps * b.repeats

    def per_step(name: str, key: str, what: str = "seconds") -> float:
        return sum(run[what].get(key, 0.0) for run in runs[name]) / steps

    head = next(iter(variants))
    t_off = statistics.median(times[head])
    t_torch = statistics.median(torch_times) if torch_times else None
    phases = {k: per_step(head, k) for k in FOREGROUND}  # nested inside forward/backward or after them
    phases["compute"] = max(0.0, t_off - sum(phases.values()))
    result = StepResult(
        bench=asdict(b), params=b.num_parameters(), torch_step_s=t_torch, offload_step_s=t_off,
        ratio=t_off / t_torch if t_torch else None, phases_s=phases,
        background_s={k: per_step(head, k) for k in BACKGROUND},
        bytes_per_step={k: per_step(head, k, "bytes") for k in ("all_gather", "reduce_scatter", "all_reduce", "d2h",
                                                                  "h2d", "nvme_read", "nvme_write")},
        samples={"torch": torch_times, **times},
        variants={name: {"step_s": statistics.median(times[name]), "optimizer_s": per_step(name, "optimizer"),
                         # Adam wherever it ran: the training thread, or a host thread (early, overlapped, delayed)
                         "adam_s": sum(per_step(name, k) for k in ("optimizer", "optimizer_early",
                                                                     "optimizer_overlapped", "optimizer_delayed")),
                         "gather_s": per_step(name, "gather") + per_step(name, "gather_wait"),
                         "copies_hidden": statistics.mean(run["overlap"] for run in runs[name])
                         if all(run["overlap"] is not None for run in runs[name]) else -1.0,
                         "nvme_wait_s": per_step(name, "nvme_wait"),
                         "speculative_s": per_step(name, "optimizer_speculative"),
                         "speculation_kept": per_step(name, "speculation_kept", "counts"),
                         "speculation_recomputed": per_step(name, "speculation_recomputed", "counts"),
                         # shards whose speculation the step took over before it began (it stepped them itself)
                         "speculation_cancelled": per_step(name, "speculation_cancelled", "counts"),
                         "param_wait_s": per_step(name, "param_wait"),
                         "param_read_s": per_step(name, "param_read"),
                         "optimizer_io_s": per_step(name, "optimizer_io"),
                         "nvme_bytes": per_step(name, "nvme_read", "bytes") + per_step(name, "nvme_write", "bytes"),
                         # reads (and writes) for nothing: read ahead and dropped unused, parameters' and
                         # sub-groups', or by an optimizer pass that was aborted (in nvme_bytes too)
                         "wasted_read_bytes": per_step(name, "nvme_read_wasted", "bytes"),
                         "wasted_write_bytes": per_step(name, "nvme_write_wasted", "bytes"),
                         "early": 1.0 if variants[name].get("early") == "on" else 0.0,  # step() returned before Adam
                         "adam_threads": float(runs[name][0]["adam_threads"]),
                         "collective_bytes": sum(per_step(name, k, "bytes")
                                                 for k in ("all_gather", "reduce_scatter", "all_reduce"))}
                  for name in variants},
        peak_device_bytes=peaks if b.device == "cuda" else {},
        memory={name: runs[name][-1]["memory"] for name in variants}, torch_note=torch_note,
        host_rss={name: rss_of(last[name]) for name in variants})
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(asdict(result), indent=2))
        if b.compares_stages:
            plot_stages(result, out_path.with_name("stages.png"))
    return result


def rss_of(ranks: list[dict[str, Any]]) -> dict[str, int | None]:
    """The largest rank's measured RSS after its timed steps, and its peak."""
    now = [r["rss"] for r in ranks if r.get("rss") is not None]
    return {"rss": max(now) if now else None, "peak": max(r["peak_rss"] for r in ranks)}


def speculation_counts(row: dict[str, float]) -> str:
    """What became of a step's speculations: kept, recomputed, or taken over by the step before they began."""
    return (f"{row['speculation_kept']:.0f} kept / {row['speculation_recomputed']:.0f} recomputed / "
            f"{row['speculation_cancelled']:.0f} stepped by the step itself")


def speculation_hidden(row: dict[str, float], after: dict[str, float]) -> float:
    """Share of the after-backward step's Adam time (on whichever thread it ran: with an early return it is not the
    training thread's) that the speculative step took off the step (negative: it made the step longer)."""
    adam = after.get("adam_s", after["optimizer_s"])
    return (after["step_s"] - row["step_s"]) / adam if adam else 0.0


def optimizer_io_hidden(row: dict[str, float], base: dict[str, float]) -> float:
    """Share of the optimizer's NVMe transfer time that did not lengthen the step: what the disk added to the step
    beside the same config with the state on the host, against the time its transfers were in flight."""
    if not row["optimizer_io_s"]:
        return 0.0
    return min(1.0, max(0.0, 1 - (row["step_s"] - base["step_s"]) / row["optimizer_io_s"]))


def plot_stages(result: StepResult, path: Path) -> None:
    """Step time beside torch's, and rank 0's bytes per tier, for each stage."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result.variants)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [result.variants[n]["step_s"] * 1e3 for n in names], color="tab:blue")
    if result.torch_step_s:
        left.axhline(result.torch_step_s * 1e3, color="tab:red", linestyle="--", label="plain torch")
    left.set_ylabel("ms per step")
    left.set_title("step time")
    left.legend()
    bottom = [0.0] * len(names)
    for tier, color in (("device", "tab:green"), ("host", "tab:orange"), ("nvme", "tab:gray")):
        values = [result.memory[n].get(tier, 0) / 2**20 for n in names]
        right.bar(names, values, bottom=bottom, color=color, label=tier)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]
    right.set_ylabel("MiB per rank")
    right.set_title("memory per rank (engine accounting)")
    right.legend()
    b = result.bench
    fig.suptitle(f"ZeRO stages: GPT {result.params / 1e6:.1f}M, W={b['world']}, optimizer {b['offload']} "
                 "(stage 0: on the device)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(result: StepResult, out: TextIO) -> None:
    b = result.bench
    checkpointing = b.get("checkpointing", "none")
    print(f"{describe_model(b, result.params)}), seq {b['seq']}, "
          f"global batch {b['micro'] * b['world']} ({b['dtype']})"
          + ("" if checkpointing == "none" else f", offload with every block checkpointed (inputs on the "
                                                 f"{'host' if checkpointing == 'cpu' else 'device'}; torch without)"),
          file=out)
    samples = len(result.samples.get(next(iter(result.variants), ""), []))
    fastest = min([result.torch_step_s or float("inf")] + [v["step_s"] for v in result.variants.values()])
    if b.get("device") != "cuda" and (fastest < NOISE_FLOOR_S or samples < 3):
        print(f"  caution: {samples} timed step(s) of as little as {fastest * 1e3:.1f} ms: a shared CPU's threads "
              f"and clock move such steps by several times; quote ratios of steps over {NOISE_FLOOR_S * 1e3:.0f} "
              "ms, several of them (--steps, --rounds, a larger --hidden)", file=out)
    where = "on the GPU" if b.get("device") == "cuda" else "1 process"
    print(f"  plain torch, {where}:       " + (f"{result.torch_step_s * 1e3:8.1f} ms/step" if result.torch_step_s
                                                 else result.torch_note), file=out)
    if tuple(b.get("stages", (3,))) != (3,):  # a list once read back from JSON
        print(f"  ZeRO stages, W={b['world']} (per rank: device / host / nvme bytes from the engine's accounting; "
              "collective bytes received per step):", file=out)
        for name, row in result.variants.items():
            mem = result.memory.get(name, {})
            print(f"    {name:7s} {row['step_s'] * 1e3:8.1f} ms/step = {result.vs_torch(row['step_s']):>11s}   "
                  + " / ".join(f"{mem.get(t, 0) / 2**20:7.1f}" for t in ("device", "host", "nvme"))
                  + f" MiB   {row['collective_bytes'] / 2**20:7.1f} MiB", file=out)
        return
    print(f"  offload ZeRO-3, W={b['world']}: {result.offload_step_s * 1e3:8.1f} ms/step  "
          f"= {result.vs_torch(result.offload_step_s)}", file=out)
    if result.peak_device_bytes:
        print("  GPU memory high water: " + ", ".join(
            f"{k} {v / 2**20:.0f} MiB" for k, v in result.peak_device_bytes.items()), file=out)
    for name, s in result.phases_s.items():
        print(f"    {name:15s} {s * 1e3:8.1f} ms  {s / result.offload_step_s:6.1%}", file=out)
    hidden = next(iter(result.variants.values()))["copies_hidden"]
    print("  beside it (copy/host threads): " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in result.background_s.items())
        + (f"; {hidden:.0%} of that ran during forward/backward" if hidden >= 0 else ""), file=out)
    print("  bytes per step per rank: " + ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in result.bytes_per_step.items() if v), file=out)
    v = result.variants
    if "host-no-prefetch" in v and "host" in v:
        print(f"  without prefetch: {v['host-no-prefetch']['step_s'] * 1e3:.1f} ms/step; prefetch's gain "
              f"{v['host-no-prefetch']['step_s'] / v['host']['step_s']:.2f}x", file=out)
    if "noclip-overlap" in v and "noclip-after" in v:
        print(f"  without clipping: step after backward {v['noclip-after']['step_s'] * 1e3:.1f} ms, overlapped with "
              f"backward {v['noclip-overlap']['step_s'] * 1e3:.1f} ms; overlap's gain "
              f"{v['noclip-after']['step_s'] / v['noclip-overlap']['step_s']:.2f}x", file=out)
    if "clip-after" in v:
        after = v["clip-after"]
        print(f"  with clipping: Adam after backward {after['step_s'] * 1e3:.1f} ms/step (optimizer phase "
              f"{after['optimizer_s'] * 1e3:.1f} ms); speculated during backward:", file=out)
        for name in ("host", "clip-speculative-kept", "clip-speculative-recomputed"):
            if name in v and (v[name]["speculation_kept"] or v[name]["speculation_recomputed"]):
                row = v[name]
                off_thread = 1 - row["optimizer_s"] / after["optimizer_s"] if after["optimizer_s"] else 0.0
                print(f"    {name:28s} {row['step_s'] * 1e3:8.1f} ms/step, {speculation_counts(row)} per step; of "
                      f"the optimizer's time {speculation_hidden(row, after):.0%} off the step, {off_thread:.0%} off "
                      "the training thread", file=out)
    elif "host" in v and "clip-speculative-kept" in v:  # on a GPU the host step returns early: the fair baseline
        row, host = v["clip-speculative-kept"], v["host"]
        print(f"  speculated during backward (clip-speculative-kept) {row['step_s'] * 1e3:.1f} ms/step against the "
              f"host step's {host['step_s'] * 1e3:.1f} ({row['step_s'] / host['step_s']:.2f}x), "
              f"{speculation_counts(row)} per step; of the host step's Adam {speculation_hidden(row, host):.0%} off "
              "the step", file=out)
    if b.get("device_budget"):
        print(f"  offload's device budget (offload.budgets.device): {b['device_budget'] / 2**20:.0f} MiB; plain "
              "PyTorch unbounded", file=out)
    for name in NAMED_ONLY:
        if name in v:
            mem = result.memory.get(name, {})
            print(f"  {name}: {v[name]['step_s'] * 1e3:.1f} ms/step = {result.vs_torch(v[name]['step_s'])}; "
                  f"device {mem.get('device', 0) / 2**20:.1f} MiB, host {mem.get('host', 0) / 2**20:.1f} MiB; "
                  f"host kernels on {v[name]['adam_threads']:.0f} threads", file=out)
    if "params-host-early" in v and "params-host" in v:
        print(f"  parameters on the host: step() whole {v['params-host']['step_s'] * 1e3:.1f} ms/step, returning "
              f"before Adam {v['params-host-early']['step_s'] * 1e3:.1f} ms/step; the early step's gain "
              f"{v['params-host']['step_s'] / v['params-host-early']['step_s']:.2f}x", file=out)
    if result.host_rss:
        print("  host memory per rank, measured after the timed steps (the largest rank's anonymous RSS; its peak RSS, "
              "the model's construction included) against the engine's accounted host bytes:", file=out)
        for name, rss in result.host_rss.items():
            now = f"{measured / 2**20:8.0f} MiB" if (measured := rss.get("rss")) is not None else "       ? MiB"
            print(f"    {name:28s} {now} (peak {(rss['peak'] or 0) / 2**20:.0f}), accounted "
                  f"{result.memory.get(name, {}).get('host', 0) / 2**20:.0f} MiB", file=out)
    if any(name.startswith("nvme") for name in v):
        print("  optimizer state placement (step / optimizer phase / of which NVMe stall, per step):", file=out)
        for name, row in v.items():
            early = row.get("early", 0.0) == 1.0  # its NVMe pass runs after step() returned
            gbps = row["nvme_bytes"] / row["optimizer_s"] / 1e9 if row["nvme_bytes"] and row["optimizer_s"] else 0
            note = ("  (the NVMe pass runs after step() returned; its stall is the forward's)" if early and gbps
                    else f"  ({gbps:.2f} GB/s through the optimizer phase)" if gbps else "")
            # Read ahead and dropped unused, or read (and written) by a pass a wrong speculation or failure aborted.
            wasted, rewritten = row["wasted_read_bytes"], row["wasted_write_bytes"]
            print(f"    {name:12s} {row['step_s'] * 1e3:8.1f} ms  {row['optimizer_s'] * 1e3:8.1f} ms  "
                  f"{row['nvme_wait_s'] * 1e3:8.1f} ms" + note
                  + (f"; {wasted / 2**20:.1f} MiB a step read for nothing" if wasted else "")
                  + (f", {rewritten / 2**20:.1f} MiB written for nothing" if rewritten else ""), file=out)
        if "nvme" in v and "host" in v:
            print(f"  the disk's cost: nvme/host step {v['nvme']['step_s'] / v['host']['step_s']:.2f}x", file=out)
        if "nvme-serial" in v and "nvme-optimizer" in v:
            print(f"  pipelining's gain: serial/pipelined optimizer phase "
                  f"{v['nvme-serial']['optimizer_s'] / v['nvme-optimizer']['optimizer_s']:.2f}x", file=out)
        for name in [n for n in ("nvme", "nvme-no-readahead", "nvme-early") if n in v]:
            row = v[name]
            hidden = 1 - row["param_wait_s"] / row["param_read_s"] if row["param_read_s"] else 0.0
            print(f"  parameter reads ({name}): {row['param_read_s'] * 1e3:.1f} ms in flight, the training thread "
                  f"waited {row['param_wait_s'] * 1e3:.1f} ms: {max(0.0, hidden):.0%} hidden", file=out)
        if "nvme-no-readahead" in v and "nvme" in v:
            print(f"  read-ahead's gain: {v['nvme-no-readahead']['step_s'] / v['nvme']['step_s']:.2f}x", file=out)
        for name, base in (("nvme-optimizer", "host"), ("nvme-optimizer-overlap", "host-overlap")):
            if name in v and base in v:
                hidden = optimizer_io_hidden(v[name], v[base])
                print(f"  optimizer state transfers ({name}): {v[name]['optimizer_io_s'] * 1e3:.1f} ms in flight per "
                      f"step, the step {(v[name]['step_s'] - v[base]['step_s']) * 1e3:+.1f} ms beside {base}: "
                      f"{hidden:.0%} hidden", file=out)
        if "nvme-optimizer-overlap" in v and "nvme-optimizer" in v:
            print(f"  stepping NVMe sub-groups during backward: "
                  f"{v['nvme-optimizer']['step_s'] / v['nvme-optimizer-overlap']['step_s']:.2f}x the step after "
                  "backward (that one clips, this one cannot)", file=out)
