"""`offload train`: a causal language model trained through the runtime, with sensible defaults.

The model is a Hugging Face family built from its config, the built-in GPT, or a local
pretrained checkpoint directory (``--model DIR``: its weights read into the shards, its
tokenizer used for text when the directory has one; nothing is ever downloaded); the
data a text file (bytes are tokens unless the checkpoint has a tokenizer), pre-tokenized
``.npy`` / ``.bin`` (uint16) tokens, or the embedded default text. Everything that can be wrong
(the data file, the model name, the config, the budgets) is checked before the first
step. While it runs one line per print interval shows loss, tokens/s and memory per
tier against its budget; at the end it prints a summary and writes the JSON record,
the Chrome trace and the loss curve into ``--out``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from offload.commands.cli_types import directory_problem
from offload.config import Config, ConfigError
from offload.files.training_checkpoint import latest_tag
from offload.machine.host_malloc import DEFAULT_THRESHOLD
from offload.models.catalog import ModelError
from offload.models.catalog import build_model as build_named_model
from offload.zero.compiled import CompileReport, compile_blocks


class TrainError(ValueError):
    """A bad argument found before any work started; the message says what would be right."""


@dataclass(kw_only=True)
class TrainArgs:
    model: str = "gpt-tiny"
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq: int = 64
    data: str | None = None  # None: the embedded default text
    vocab: int | None = None  # pre-tokenized data: default max token + 1
    config: str | None = None  # None: the embedded default config
    steps: int = 150
    micro_batch: int | None = None
    lr: float | None = None
    offload_optimizer: str | None = None  # none, cpu or nvme: overrides the config
    offload_param: str | None = None  # none, cpu or nvme: overrides the config
    max_in_cpu: int | None = None  # offload_param.max_in_cpu: parameter elements kept on the host with nvme
    stage: int | None = None  # ZeRO stage: overrides the config
    checkpointing: str | None = None  # none, device or cpu: activation checkpointing of every block
    compile: str | None = None  # a torch.compile backend: engine.compile() before the first step
    nvme_path: str = "offload-swap"  # under the working directory unless absolute
    init_empty: bool = False
    seed: int = 0
    out: str = "offload-train-out"
    save_every: int = 0
    save_dir: str | None = None  # default: <out>/checkpoints
    resume: bool = False
    tag: str | None = None  # with resume: this checkpoint tag instead of the latest
    save_on_stop: bool = True  # a SIGTERM or SIGINT saves a checkpoint of the step it stops after
    keep_last: int | None = None  # offload.checkpoints.keep_last: the newest N checkpoints kept (None: the config's)
    print_every: int | None = None  # None: the config's steps_per_print
    verbose: bool = False  # the reasons behind each 'auto' choice of the step, on screen too


@dataclass
class TrainRecord:
    args: dict[str, Any]
    params: int
    world: int
    device: str
    step_mode: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds_per_step: dict[str, float] = field(default_factory=dict)
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    overlap_share: float | None = None
    peak_rss_bytes: int = 0
    peak_device_bytes: int = 0
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    compile: dict[str, Any] | None = None  # engine.compile_report(): graphs, graph breaks, recompiles
    # Stopped early by a signal (see [Note: stopping at an agreed step] in offload/engine/stopping.py): the reason,
    # the step, the checkpoint saved of it (or None) and the process's exit status.
    stopped: dict[str, Any] | None = None


# ----------------------------------------------------------------------------- checks, before any work


def pretrained_dir(args: TrainArgs) -> Path | None:
    """The local checkpoint directory ``--model`` names, or None when it names a model of the catalog."""
    from offload.models.catalog import MODELS
    if args.model in MODELS:
        return None
    looks_like_path = os.sep in args.model or args.model.startswith(".") or Path(args.model).expanduser().exists()
    if not looks_like_path:
        raise TrainError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)} (and --layers/--hidden/"
                         "--heads for other sizes), or give a local Hugging Face checkpoint directory")
    from offload.files.pretrained import PretrainedError, local_checkpoint
    try:
        path = local_checkpoint(args.model)
    except PretrainedError as e:
        raise TrainError(f"--model {e}") from None
    if any(v is not None for v in (args.layers, args.hidden, args.heads)):
        raise TrainError(f"--model {path} is a pretrained checkpoint: its size is its config.json's; drop "
                         "--layers/--hidden/--heads")
    return path


def load_tokens(args: TrainArgs) -> tuple[torch.Tensor, int]:
    """The token stream and its vocabulary size (a pretrained checkpoint's own, which the data must fit)."""
    checkpoint = pretrained_dir(args)
    tokens, vocab = _read_tokens(args, checkpoint)
    if checkpoint is not None:
        model_vocab = _checkpoint_vocab(checkpoint)
        if int(tokens.max()) >= model_vocab:
            raise TrainError(f"--data has token id {int(tokens.max())}, but the checkpoint {checkpoint} has a "
                             f"vocabulary of {model_vocab}")
        vocab = model_vocab
    return tokens, vocab


def _checkpoint_vocab(checkpoint: Path) -> int:
    try:
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainError(f"--model {checkpoint}: config.json names no vocab_size ({e})") from None
    return int(vocab)


def _tokenizer(checkpoint: Path | None) -> Any:
    """The checkpoint's own tokenizer, if the directory holds one (None: bytes are tokens)."""
    if checkpoint is None or not any((checkpoint / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


def _text_tokens(text: bytes, checkpoint: Path | None) -> tuple[torch.Tensor, int]:
    tokenizer = _tokenizer(checkpoint)
    if tokenizer is None:
        return torch.tensor(list(text), dtype=torch.long), 256
    ids = tokenizer(text.decode("utf-8", errors="replace"))["input_ids"]
    return torch.tensor(ids, dtype=torch.long), len(tokenizer)


def _read_tokens(args: TrainArgs, checkpoint: Path | None) -> tuple[torch.Tensor, int]:
    if args.data is None:
        from offload.commands.demo import TEXT
        return _text_tokens(TEXT.encode(), checkpoint)
    path = Path(args.data)
    if not path.is_file():
        raise TrainError(f"--data {path}: no such file (give a text file, or tokens as .npy or uint16 .bin)")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as e:  # pickled objects, or not an .npy file at all
            raise TrainError(f"--data {path} is not an array of token ids saved with numpy.save ({e})") from None
        if array.dtype.kind not in "iu":
            raise TrainError(f"--data {path} holds {array.dtype} values; token ids are integers (save them as an "
                             "integer array, e.g. numpy.uint16 or int32)")
        tokens = torch.from_numpy(array.astype(np.int64).reshape(-1))
    elif path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise TrainError(f"--data {path} is {path.stat().st_size} bytes: a .bin holds uint16 token ids, two "
                             "bytes each, so its size must be even (a truncated file?)")
        tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    else:
        return _text_tokens(path.read_bytes(), checkpoint)
    if tokens.numel() == 0 or int(tokens.min()) < 0:
        raise TrainError(f"--data {path}: {tokens.numel()} tokens, min {int(tokens.min()) if tokens.numel() else '-'}"
                         ": pre-tokenized data must be non-empty non-negative token ids")
    vocab = args.vocab or int(tokens.max()) + 1
    if int(tokens.max()) >= vocab:
        raise TrainError(f"--data {path} has token id {int(tokens.max())}, not below --vocab {vocab}")
    return tokens, vocab


def _check_writable(directory: Path, flag: str) -> None:
    """``directory`` exists as a writable directory, or can be created (without creating it now)."""
    problem = directory_problem(directory)
    if problem is not None:
        raise TrainError(f"{flag} {directory}: {problem}; choose another directory")


def _check_fits(args: TrainArgs, vocab: int, config: dict[str, Any]) -> None:
    """The model, built on the meta device, against the memory this machine has now: the engine's own plan (as
    `offload estimate` computes it) plus the full fp32 build unless --init-empty builds it unit by unit."""
    import psutil

    from offload.commands.estimate import estimate, model_units
    from offload.engine import hidden_size_of
    with torch.device("meta"):
        model = build_model(args, vocab)
    params = sum(p.numel() for p in model.parameters())
    unit_by_unit = args.init_empty or pretrained_dir(args) is not None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = Config.load(config).resolve(world_size=world, hidden_size=hidden_size_of(model))
    except ConfigError as e:
        raise TrainError(f"the config cannot run here: {e}") from e
    est = estimate(model_units(model, cfg), cfg, world, discrete=torch.cuda.is_available(),
                   device_free=torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    need = ranks_here * (est.total("host") + (0 if torch.cuda.is_available() else est.total("device"))
                         + (0 if unit_by_unit else 4 * params))
    available = psutil.virtual_memory().available
    if need > available:
        raise TrainError(f"model {args.model} ({params:,} parameters) needs about {need / 2**30:.1f} GiB of host "
                         f"memory on this machine ({ranks_here} rank(s): the plan per tier, plus the fp32 build "
                         f"without --init-empty) and {available / 2**30:.1f} GiB is available; use --init-empty, "
                         "offload to NVMe (--offload-optimizer nvme --offload-param nvme), more machines, or a "
                         "smaller model (`offload estimate --model` shows the split)")


def _write_record(record: TrainRecord, out_dir: Path) -> None:
    """record.json, replaced whole (a reader never sees half of one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".record.json.tmp"
    tmp.write_text(json.dumps(asdict(record), indent=1))
    tmp.replace(out_dir / "record.json")


def _earlier_losses(record: Path, first_step: int) -> list[float]:
    """The losses a resumed run's record already holds for the steps before ``first_step`` (kept, not replaced)."""
    try:
        earlier = json.loads(record.read_text())
        keep = first_step - int(earlier["first_step"])  # the record's steps before the checkpoint
        return [float(x) for x in earlier["losses"][:keep]] if keep >= 0 else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def build_model(args: TrainArgs, vocab: int) -> nn.Module:
    """The model ``args`` name (offload/models/catalog.py) at its size or theirs, or the pretrained checkpoint's
    model on the meta device (its weights come in as the engine builds each unit)."""
    checkpoint = pretrained_dir(args)
    if checkpoint is not None:
        from offload.files.pretrained import PretrainedError
        from offload.hf import meta_model
        try:
            return meta_model(checkpoint)
        except PretrainedError as e:
            raise TrainError(f"--model {e}") from None
    try:
        return build_named_model(args.model, vocab, args.seq, args.layers, args.hidden, args.heads)
    except ModelError as e:
        raise TrainError(str(e)) from None


def build_config(args: TrainArgs) -> dict[str, Any]:
    from offload.commands.demo import default_config_text
    path: Path | str  # the config file, then each NVMe directory as the config or --nvme-path names it
    if args.config is None:
        raw = json.loads(default_config_text())
    else:
        path = Path(args.config)
        if not path.is_file():
            raise TrainError(f"--config {path}: no such file (see configs/ for examples)")
        raw = Config.load(path).to_dict()
    zero = raw.setdefault("zero_optimization", {})
    if args.micro_batch is not None:
        raw["train_micro_batch_size_per_gpu"] = args.micro_batch
        raw.pop("train_batch_size", None)
    if args.lr is not None:
        raw.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})["lr"] = args.lr
    if args.offload_optimizer is not None:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": args.offload_optimizer}
    if args.offload_param is not None:
        zero["offload_param"] = {**zero.get("offload_param", {}), "device": args.offload_param}
    if args.max_in_cpu is not None:
        zero["offload_param"] = {**zero.get("offload_param", {}), "max_in_cpu": args.max_in_cpu}
    if args.stage is not None:
        zero["stage"] = args.stage
        if args.stage == 0 and args.offload_optimizer is None:
            zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "none"}  # stage 0 cannot
        if args.stage < 3 and args.offload_param is None:
            zero["offload_param"] = {**zero.get("offload_param", {}), "device": "none"}  # stages 0-2 cannot
    if args.checkpointing is not None:
        raw.setdefault("offload", {})["checkpoint_blocks"] = args.checkpointing != "none"
        raw.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = args.checkpointing == "cpu"
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section, {}).get("device") == "nvme":
            path = zero[section].get("nvme_path") or args.nvme_path
            zero[section]["nvme_path"] = str(Path(path).absolute())
    if args.keep_last is not None:
        raw.setdefault("offload", {}).setdefault("checkpoints", {})["keep_last"] = args.keep_last
    malloc = raw.setdefault("offload", {}).setdefault("host_malloc", {})
    if malloc.get("mmap_threshold") is None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        malloc["mmap_threshold"] = DEFAULT_THRESHOLD  # an application may fix it: RSS then tracks the budgets
    Config.load(raw)  # a bad key or value is an error now, with its key path
    return raw


# ----------------------------------------------------------------------------- the run


def _windows(tokens: torch.Tensor, seq: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq - 1, (rows,), generator=gen)
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def _loss(engine: Any, batch: torch.Tensor) -> torch.Tensor:
    from offload.models.catalog import lm_loss
    return lm_loss(engine.module, engine, batch)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _tier_line(memory: dict[str, dict[str, int]]) -> str:
    parts = []
    for tier in ("device", "host", "nvme"):
        m = memory.get(tier, {})
        used = m.get("total", m.get("shards", 0) + m.get("gathered_now", 0))
        if used or m.get("budget"):
            parts.append(f"{tier} {_mib(used)}" + (f"/{_mib(m['budget'])}" if m.get("budget") else "") + " MiB")
    return " ".join(parts)


def run(args: TrainArgs, out: TextIO | None = None, quiet: bool = False) -> TrainRecord:
    """Train as ``args`` say; progress and summary go to ``out`` (default stdout) unless ``quiet``."""
    import offload
    from offload.zero import Init

    # Everything that can be known before the first step is checked before it.
    out_dir = Path(args.out)
    save_dir = Path(args.save_dir) if args.save_dir else out_dir / "checkpoints"
    if args.resume and not (save_dir / "latest").is_file() and args.tag is None:
        raise TrainError(f"--resume: {save_dir} holds no checkpoint (no 'latest'); train with --save-every first")
    if args.tag is not None and not args.resume:
        raise TrainError("--tag names the checkpoint --resume loads; add --resume")
    _check_writable(out_dir, "--out")  # a run must not train and then lose its record
    if args.save_every:
        _check_writable(save_dir, "--save-dir")
    tokens, vocab = load_tokens(args)
    if tokens.numel() < args.seq + 2:
        raise TrainError(f"the data has {tokens.numel()} tokens; --seq {args.seq} needs at least {args.seq + 2}")
    config = build_config(args)
    _check_fits(args, vocab, config)
    torch.manual_seed(args.seed)
    checkpoint = pretrained_dir(args)
    if args.init_empty and checkpoint is None:
        with Init():
            model = build_model(args, vocab)
    else:
        model = build_model(args, vocab)
    if args.compile:  # before initialize, so that each block is one unit (see offload/zero/compiled.py)
        compile_blocks(model, args.compile, {})
    try:
        engine, *_ = offload.initialize(model=model, config=config, weights=checkpoint)
    except ConfigError as e:
        raise TrainError(f"the config cannot run here: {e}") from e
    rank0 = engine.group.rank == 0

    def say(msg: str) -> None:
        if not quiet and rank0:
            print(msg, file=out or sys.stdout, flush=True)

    bar = ProgressBar(args.steps, (out or sys.stdout) if rank0 and not quiet else None)
    first_step = 0
    history: list[float] = []
    if args.resume:
        path, client = engine.load_checkpoint(save_dir, tag=args.tag)
        if path is None or client is None:  # checked before the engine was built; gone since
            raise TrainError(f"--resume: {save_dir} holds no checkpoint (no 'latest')")
        first_step = int(client.get("step", engine.global_steps))
        say(f"resumed from {path} at step {first_step}")
        if isinstance(client.get("losses"), list):  # the checkpoint holds the run's history up to it
            history = [float(x) for x in client["losses"]]
        else:  # written before it did: the record's, where it still has them
            history = _earlier_losses(out_dir / "record.json", first_step)
        if first_step >= args.steps:
            say(f"nothing left to do: the checkpoint is at step {first_step} and --steps is {args.steps}")
    params = sum(u.numel for u in engine.units)
    cfg = engine.config
    micro, accum = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    assert isinstance(micro, int) and isinstance(accum, int)  # the engine's config is resolved: numbers
    say(f"model {args.model}: {params:,} parameters in {len(engine.units)} units on {engine.accel.device}, "
        f"world {engine.group.world}")
    say(f"ZeRO stage {cfg.zero_optimization.stage}: {cfg.zero_optimization.placement_words()}")
    if args.verbose:
        say(f"step: {engine.step_mode}")
    else:  # why each 'auto' choice was made: --verbose, and record.json's step_mode
        say(f"step: {engine.step_brief} (--verbose says why)")
    record = TrainRecord(args=asdict(args), params=params, world=engine.group.world, device=str(engine.accel.device),
                         step_mode=engine.step_mode, first_step=first_step - len(history), losses=list(history))
    gen = torch.Generator()
    every = args.print_every or cfg.progress_every
    tokens_per_step = micro * accum * args.seq * engine.group.world
    engine.telemetry.start_trace()
    engine.accel.reset_peak()
    start = time.perf_counter()
    signals = engine.stop_on_signals().install()
    try:
        for step in range(first_step, args.steps):
            total = 0.0
            # Each step's batches depend only on (seed, rank, step), so a resumed run sees what the
            # uninterrupted one would have.
            gen.manual_seed((args.seed * 1_000_003 + engine.group.rank) * 1_000_003 + step)
            for _ in range(accum):
                loss = _loss(engine, _windows(tokens, args.seq, micro, gen))
                engine.backward(loss)
                engine.step()
                total += loss.item() / accum
            if not math.isfinite(total):
                raise TrainError(f"step {step + 1}: the loss is {total}; lower --lr or enable gradient clipping")
            record.losses.append(total)
            done = step + 1
            elapsed = time.perf_counter() - start
            rate = (done - first_step) * tokens_per_step / elapsed
            line = f"step {done:5d}/{args.steps}  loss {total:7.4f}  {rate:9,.0f} tok/s  " \
                   f"{_tier_line(engine.memory_summary())}"
            bar.update(done, line, keep=done == first_step + 1 or done % every == 0 or done == args.steps)
            saved = None
            if (args.save_every and done % args.save_every == 0) or (engine.should_stop and args.save_on_stop):
                # The losses so far go into the checkpoint and the record, so that a killed run loses none of them.
                saved = engine.save_checkpoint(save_dir, client_state={"step": done, "losses": list(record.losses),
                                                                       "first_step": record.first_step})
                if rank0:
                    _write_record(record, out_dir)
            if engine.should_stop:
                record.stopped = {"reason": engine.stop.reason, "step": done, "checkpoint": saved,
                                  "exit_status": engine.stop.exit_status}
                break
    finally:
        signals.uninstall()
        elapsed = time.perf_counter() - start
        ran = len(record.losses) - len(history)  # steps of this run (a resumed record keeps the earlier ones)
        steps_run = max(1, ran)
        snap = engine.telemetry.snapshot()
        record.tokens_per_s = ran * tokens_per_step / elapsed if ran else 0.0
        record.seconds_per_step = {k: v / steps_run for k, v in sorted(snap.seconds.items())}
        record.bytes_per_step = {k: v / steps_run for k, v in sorted(snap.bytes.items())}
        record.overlap_share = engine.telemetry.overlap_share()
        record.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        record.peak_device_bytes = engine.accel.memory_stats().peak_allocated
        record.memory = engine.memory_summary()
        if args.compile:
            record.compile = engine.compile_report().as_dict()
        try:
            if rank0:
                out_dir.mkdir(parents=True, exist_ok=True)
                record.files = {"trace": str(engine.telemetry.export_chrome_trace(out_dir / "trace.json", 0)),
                                "record": str(out_dir / "record.json")}
                if record.losses:
                    record.files["loss_plot"] = str(_plot(record, out_dir / "loss.png"))
                _write_record(record, out_dir)
        except OSError as e:  # a full disk under --out too: the run's own error (if any) is the one to see
            say(f"could not write the run's record under {out_dir}: {e}")
        engine.close()
    _summary(record, say)
    if record.stopped is not None:
        say(_stopped_line(record.stopped, args, save_dir))
    return record


def _stopped_line(stopped: dict[str, Any], args: TrainArgs, save_dir: Path) -> str:
    """One line: why and where the run stopped, its checkpoint, and the command that resumes it."""
    argv = sys.argv[1:]
    command = (shlex.join(["offload", *argv, *([] if "--resume" in argv else ["--resume"])])
               if argv[:1] == ["train"] else "the same offload train command with --resume")
    if stopped["checkpoint"] is not None:
        saved = f"saved checkpoint {stopped['checkpoint']}"
    else:
        last = latest_tag(save_dir)
        saved = ("no checkpoint saved (--no-save-on-stop); " if not args.save_on_stop else "") + (
            f"the last one is {save_dir / last}" if last else "no checkpoint to resume from")
    return f"offload train: stopped by {stopped['reason']} after step {stopped['step']}; {saved}; resume: {command}"


class ProgressBar:
    """On a terminal, one line redrawn in place every step (a bar, then the step's figures); lines that are
    kept (every steps_per_print) stay on screen above it. Anywhere else (a log file) only the kept lines."""

    WIDTH = 24

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream is not None and stream.isatty()
        self._drawn = 0

    def update(self, done: int, line: str, keep: bool) -> None:
        if self.stream is None:
            return
        if self.tty:
            filled = self.WIDTH * done // max(1, self.total)
            text = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {line}"
            self.stream.write("\r" + text + " " * max(0, self._drawn - len(text)) + ("\n" if keep else ""))
            self._drawn = 0 if keep else len(text)
        elif keep:
            self.stream.write(line + "\n")
        self.stream.flush()


def _plot(record: TrainRecord, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(record.first_step + 1, record.first_step + len(record.losses) + 1)
    ax.plot(list(steps), record.losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{record.args['model']}: {record.params:,} parameters, W={record.world}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _summary(record: TrainRecord, say: Any) -> None:
    if record.losses:
        say(f"loss {record.losses[0]:.3f} -> {record.losses[-1]:.3f} over {len(record.losses)} steps, "
            f"{record.tokens_per_s:,.0f} tokens/s")
    say("per step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in record.seconds_per_step.items()))
    moved = {k: v for k, v in record.bytes_per_step.items() if v}
    if moved:
        say("bytes per step: " + ", ".join(f"{k} {_mib(v)} MiB" for k, v in moved.items()))
    if record.overlap_share is not None:
        say(f"{record.overlap_share:.0%} of the background copies ran during forward/backward")
    say(f"peak RSS {_mib(record.peak_rss_bytes)} MiB" + (f", peak GPU memory {_mib(record.peak_device_bytes)} MiB"
                                                         if record.peak_device_bytes else ""))
    say("memory: " + _tier_line(record.memory))
    if record.compile is not None:
        say(CompileReport.from_dict(record.compile).summary())
    if record.files:
        say("wrote " + ", ".join(record.files.values()))


def main_args(ns: Any) -> TrainArgs:
    """TrainArgs from the command line's namespace (only the fields it has)."""
    fields = TrainArgs.__dataclass_fields__
    return TrainArgs(**{k: v for k, v in vars(ns).items() if k in fields})
