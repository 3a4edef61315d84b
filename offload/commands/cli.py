"""`offload` command line. One rule for every command: a user's mistake (a bad argument, config, file or
checkpoint) is a one-paragraph message and exit code 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch

import offload
from offload.commands.cli_types import (
    directory_problem,
    non_negative_float,
    non_negative_int,
    output_file_problem,
    positive_float,
    positive_int,
    positive_ints,
    positive_size,
    positive_sizes,
)
from offload.config import Config, ConfigError
from offload.engine import EngineError
from offload.files.training_checkpoint import CheckpointDiskFull, CheckpointError
from offload.machine import cpus, native
from offload.machine.launch import RankError


class UsageError(ValueError):
    """A command-line request that cannot be honoured; the message says what would be right."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user's input causes: said in one paragraph, exit 2 (see the module docstring)."""
    from offload.aio.base import SwapIOError
    from offload.commands.train import TrainError
    from offload.files.pretrained import PretrainedError
    return (UsageError, ConfigError, TrainError, CheckpointError, PretrainedError, EngineError, SwapIOError,
            PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def _cmd_launch(args: argparse.Namespace) -> int:
    from offload.stand_in.launch import LaunchError, exec_command
    try:
        exec_command(args.launched)
    except LaunchError as e:
        raise UsageError(str(e)) from None
    return 0  # not reached: the command replaced this process


def _cmd_info(args: argparse.Namespace) -> int:
    mem = psutil.virtual_memory()
    print(f"offload {offload.__version__}  (python {platform.python_version()}, torch {torch.__version__})")
    print(f"cpu: {psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores, of which this "
          f"process may use {cpus.physical_cores()} / {cpus.usable_cpus()} (host kernels run "
          f"{native.default_threads()} threads); {mem.total / 2**30:.1f} GiB RAM ({mem.available / 2**30:.1f} GiB "
          "available)")
    print(f"accelerator: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (CPU-only run)'}")
    print(f"native kernels: active {native.active_variant()}; compiled {', '.join(native.compiled_variants())}; "
          f"runnable here {', '.join(native.supported_variants())}")
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    try:
        cfg = Config.load(args.config)
        resolved = cfg.resolve(args.world_size, hidden_size=args.hidden_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    zero = resolved.zero_optimization
    precision = "fp16" if resolved.fp16.enabled else "bf16" if resolved.bf16.enabled else "fp32"
    print(f"{args.config}: valid")
    print(f"  batch: {resolved.train_batch_size} = micro {resolved.train_micro_batch_size_per_gpu} x accumulation "
          f"{resolved.gradient_accumulation_steps} x world {args.world_size}")
    print(f"  precision: {precision}; gradient clipping: {resolved.gradient_clipping or 'off'}")
    print(f"  zero stage {zero.stage}: {zero.placement_words()}")
    budgets = resolved.offload.budgets
    bounded = [f"{tier} {value / 2**30:,.2f} GiB" for tier, value in
               (("device", budgets.device), ("host", budgets.host), ("nvme", budgets.nvme)) if value is not None]
    print(f"  budgets: {', '.join(bounded) if bounded else 'none set (what is free at start)'}")
    if zero.offload_param.device == "nvme":
        print(f"  parameter shards kept in host memory (offload_param.max_in_cpu): "
              f"{int(zero.offload_param.max_in_cpu):,} elements")
    if resolved.scheduler:
        print(f"  scheduler: {resolved.scheduler.type}")
    if resolved.offload.checkpoint_blocks:
        where = "host" if resolved.activation_checkpointing.cpu_checkpointing else "device"
        print(f"  activation checkpointing: every block, inputs kept on the {where}")
    if resolved.optimizer and isinstance(resolved.optimizer.params, dict):  # a torch.optim type's own arguments
        print(f"  optimizer: torch.optim.{resolved.optimizer.type} {resolved.optimizer.params}")
    elif resolved.optimizer:
        p = resolved.optimizer.params
        print(f"  optimizer: {resolved.optimizer.type} lr {p.lr} betas {p.betas} eps {p.eps} "
              f"weight_decay {p.weight_decay}")
    if cfg.auto_paths():
        print(f"  auto keys resolved: {', '.join(cfg.auto_paths())}")
    for note in resolved.notes:
        print(f"  note: {note}")
    if args.print_resolved:
        print(resolved.to_json())
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from offload.config.docs import render_markdown
    sys.stdout.write(render_markdown())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from offload.commands.demo import run_demo
    run_demo(args.config, steps=args.steps, out=sys.stdout, trace=args.trace)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from offload.bench import adam, hooks, nvme, pcie, step
    what = args.what
    if what == "all":
        from offload.bench.suite import run_all
        print("offload bench all: every benchmark this machine supports, each beside its baseline", flush=True)
        run_all(_directory(args.path, "--path"), _output(args), args.quick, sys.stdout)
        return 0
    out = _output(args)
    if what == "pcie":
        if not torch.cuda.is_available():
            raise UsageError("needs a GPU (torch.cuda.is_available() is False on this machine)")
        print("offload bench pcie: pinned vs pageable host<->GPU copies", flush=True)
        pcie.run(size=args.pcie_size, repeats=args.repeats, out=out, stream=sys.stdout)
        print(f"wrote {out}")
    elif what == "hooks":
        try:
            bench_hooks = hooks.HookBench(layers=args.layers, rounds=args.rounds, iterations=args.iterations)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(f"offload bench hooks: host time per hook call on {args.layers} tiny units beside plain PyTorch, "
              "alternating rounds", flush=True)
        hooks.print_header(sys.stdout)
        hooks.run(bench_hooks, out=out, stream=sys.stdout)
        print(f"wrote {out}")
    elif what == "lend":
        from offload.bench import lend
        try:
            bench_lend = step.StepBench(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 64),
                                        vocab=args.vocab, seq=128, micro=2, world=1, dtype=args.dtype,
                                        device=args.device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        lend.run(bench_lend, args.placement, args.rounds, out, sys.stdout)
        print(f"wrote {out}")
    elif what in ("schedule", "replay"):
        return _cmd_schedule(args, out)
    elif what == "adam":
        adam.run(args.sizes, repeats=args.repeats, threads=args.threads, out=out, stream=sys.stdout)
    elif what == "formats":
        from offload.bench import formats
        unknown = [f for f in args.formats if f not in formats.FORMATS]
        if unknown:
            raise UsageError(f"--formats: {', '.join(unknown)} is not one of {', '.join(formats.FORMATS)}")
        bench = formats.FormatsBench(steps=args.steps, seeds=args.seeds, hidden=args.hidden, layers=args.layers,
                                     seq=args.seq, micro=args.micro, lr=args.lr, warmup=min(args.warmup, args.steps),
                                     eval_every=args.eval_every, formats=args.formats)
        formats.run(bench, out, sys.stdout)
    elif what == "nvme":
        nvme.run(_directory(args.path, "--path"), size=args.file_size, rounds=args.rounds or 3,
                 blocks=tuple(args.blocks), depths=tuple(args.depths), out=out, stream=sys.stdout)
    elif what == "step":
        try:
            bench = _step_bench(args, step, out)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.baseline == "deepspeed":
            from offload.bench import versus
            chosen: dict[str, versus.Placement] | dict[str, dict[str, Any]]  # the variants: this baseline's or floor's
            result: versus.VersusResult | step.StepResult  # this baseline's, else the plain bench's
            if args.accum != 1:
                raise UsageError("--baseline deepspeed times one micro-batch a step (its phases are forward, backward "
                                 "and step): leave --accum at 1")
            if args.device_budget is not None:
                raise UsageError("--device-budget bounds offload's device memory only (DeepSpeed has no such budget, "
                                 "and both sides read one config): drop it, or run without --baseline deepspeed")
            try:
                chosen = versus.variants(bench, _names(args.variants))
            except ValueError as e:
                raise UsageError(str(e)) from None
            if versus.deepspeed_version() is None:
                raise UsageError(versus.INSTALL)
            print(f"offload bench step --baseline deepspeed: {', '.join(chosen)} beside DeepSpeed "
                  "and plain PyTorch, alternating rounds", flush=True)
            result = versus.run(bench, out, log=sys.stdout, names=tuple(chosen))
            versus.print_table(result, sys.stdout)
            print(f"wrote {out} (the configs both sides read beside it)")
            return 0
        if args.baseline == "floor":
            from offload.bench import pace
            if args.accum != 1:
                raise UsageError("--baseline floor times one micro-batch a step (forward, backward and step): leave "
                                 "--accum at 1")
            try:
                chosen = pace.variants(_names(args.variants))
            except ValueError as e:
                raise UsageError(str(e)) from None
            print(f"offload bench step --baseline floor: {', '.join(chosen)} beside plain PyTorch and the floor, "
                  "one rank, alternating rounds", flush=True)
            floor = pace.run(replace(bench, world=1), out, args.clip, log=sys.stdout, names=tuple(chosen))
            pace.print_table(floor, sys.stdout)
            print(f"wrote {out} (each variant's config beside it)")
            return 0
        if args.compile:
            if args.baseline != "torch":
                raise UsageError("--compile compares compiled and eager offload beside plain PyTorch both ways: drop "
                                 "--baseline")
            from offload.bench import compiled
            print(f"offload bench step --compile {args.compile}: plain PyTorch and offload, eager and with every "
                  "block compiled, alternating rounds", flush=True)
            gains = compiled.run(bench, args.compile, out, log=sys.stdout)
            compiled.print_table(gains, sys.stdout)
            print(f"wrote {out}")
            return 0
        print(f"offload bench step: ZeRO stage {args.stage} beside plain PyTorch, alternating rounds", flush=True)
        try:
            result = step.run(bench, out, log=sys.stdout)
        except RankError as e:
            if isinstance(e.cause, ConfigError):  # a variant's config the engine refused (e.g. --device-budget)
                raise e.cause from None
            raise
        step.print_table(result, sys.stdout)
        print(f"wrote {out}")
    return 0


def _cmd_schedule(args: argparse.Namespace, out: Path) -> int:
    """Record a step's schedule on this CPU, or replay one on a described machine."""
    from offload.bench import replay
    rates = {k: v for k, v in vars(args).items() if k in replay.RATES and v is not None}
    try:
        machine = replay.machine_from(args.machine, rates)
        if args.what == "schedule":
            bench = replay.ScheduleBench(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 64),
                                         vocab=args.vocab, seq=args.seq, micro=args.micro, dtype=args.dtype,
                                         params=args.params, early=args.early, speculative=args.speculative,
                                         clip=args.clip, overlap=args.overlap, ratio=args.ratio,
                                         stream=args.stream, device_budget=args.device_budget,
                                         unit_bytes=args.unit_bytes, steps=args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.what == "schedule":
        path = out
        print(f"offload bench schedule: recording {args.steps} step(s) of a {args.layers} x {args.hidden} GPT on this "
              "CPU as a discrete device", flush=True)
        data = replay.record(bench, path, log=sys.stdout, machine=machine)
        print(f"wrote {path}: {replay.summary(data)}")
        result = replay.replay(data, machine, args.tokens)
        replay.print_replay(result, sys.stdout, label="replayed ")
        return 0
    if not Path(args.schedule).is_file():
        raise UsageError(f"{args.schedule}: no such file; record one with `offload bench schedule`")
    try:
        replay.run_replay(Path(args.schedule), machine, args.tokens, out, sys.stdout, frozenset(args.free))
    except ValueError as e:  # not a schedule (or not JSON), or one that cannot finish
        raise UsageError(str(e)) from None
    print(f"wrote {out}")
    return 0


def _step_bench(args: argparse.Namespace, step: Any, out: Path) -> Any:
    """The step benchmark the command line asks for (ValueError: what is wrong with it)."""
    # A catalog model keeps its own size where no flag overrides it (0); the built-in GPT has the bench's defaults.
    hidden = args.hidden or (0 if args.model else 256)
    return step.StepBench(model=args.model or "", hidden=hidden, layers=args.layers or (0 if args.model else 4),
                          heads=max(1, hidden // 64) if hidden else 0, vocab=args.vocab,
                          seq=args.seq, micro=args.micro, accum=args.accum, unit_bytes=args.unit_bytes,
                          world=args.world, steps=args.steps, warmup=args.warmup,
                          repeats=args.rounds or 2, dtype=args.dtype, offload=args.offload, nvme_path=args.path,
                          sub_group_size=args.sub_group_size, trace_dir=str(out.parent), device=args.device,
                          stages=_stages(args.stage), checkpointing=args.checkpointing, profile=args.profile,
                          headline_only=args.headline_only, device_budget=args.device_budget,
                          state=step.STATE_FORMATS[args.state_format], optimizer=args.optimizer,
                          only=() if args.baseline != "torch" else _names(args.variants))


def ratio_value(text: str) -> float | str:
    """offload_optimizer.ratio on a command line: auto, or a number in [0, 1]."""
    if text == "auto":
        return text
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a ratio is auto or a number from 0 to 1")
    return value


def _names(listed: str | None) -> tuple[str, ...]:
    return tuple(v for v in (listed or "").split(",") if v)


def _directory(path: str, flag: str) -> Path:
    """A directory to write into: it exists as one, or can be created."""
    problem = directory_problem(path)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {problem}; give a directory on the drive to use (it is created if missing)")
    return Path(path)


def _cmd_tune_nvme(args: argparse.Namespace) -> int:
    from offload.bench import tune
    out = _output(args)
    try:
        tune.run(_directory(args.path, "--path"), out, quick=args.quick, size=args.file_size,
                 with_fio=not args.no_fio, stream=sys.stdout)
    except ValueError as e:  # a file too small for the grid
        raise UsageError(str(e)) from None
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from offload.commands.train import main_args, run
    try:
        record = run(main_args(args))
    except CheckpointDiskFull as e:  # said in one paragraph; status 1, as any run that failed
        print(f"offload train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once (see [Note: stopping at an agreed step])
        print("offload train: interrupted at once by a second SIGINT; the last complete checkpoint, if any, is what "
              "'latest' in the checkpoint directory names", file=sys.stderr)
        return 130
    if record.stopped is not None:
        return int(record.stopped["exit_status"])
    if args.expect_loss_drop and len(record.losses) >= 2 and not record.losses[-1] < record.losses[0]:
        print(f"offload train: --expect-loss-drop: the last step's loss ({record.losses[-1]:.4f}) is not below the "
              f"first's ({record.losses[0]:.4f})", file=sys.stderr)
        return 1
    return 0


def _stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f"--stage {text!r}: give ZeRO stages 0-3, comma-separated (e.g. 0,1,2,3)")
    return stages


def _cmd_estimate(args: argparse.Namespace) -> int:
    from offload.bench.replay import MACHINES
    from offload.commands.estimate import run_cli
    return run_cli(args, MACHINES[args.machine or "h100"])


def _cmd_inspect(args: argparse.Namespace) -> int:
    from offload.files.export import checkpoint_dir, describe
    from offload.files.small_state import unsafe_content
    from offload.files.training_checkpoint import read_meta
    path = checkpoint_dir(args.checkpoint, args.tag)  # no checkpoint there: the handler's exit 2
    try:
        print(describe(path))
    except CheckpointError as e:  # there, but a file is missing or does not match its checksum
        print(f"offload inspect: damaged: {e}", file=sys.stderr)
        return 1
    unsafe = unsafe_content(path, read_meta(path))
    for line in unsafe:  # intact, but loading it as it is could run code (see [Note: checkpoints run no code])
        print(f"offload inspect: unsafe: {line}", file=sys.stderr)
    return 1 if unsafe else 0


def _cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from offload.files.export import checkpoint_dir
    from offload.files.small_state import convert
    path = checkpoint_dir(args.checkpoint, args.tag)
    for line in convert(path):
        print(f"{path}: {line}")
    return 0


def _cmd_export_weights(args: argparse.Namespace) -> int:
    from offload.files.export import export_weights
    result = export_weights(args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                            tag=args.tag, replace=args.replace)
    print(f"wrote {result.tensors} tensors, {result.total_bytes / 2**20:,.1f} MiB, to {args.out}: "
          + ", ".join(result.files))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload", description=offload.__doc__)
    parser.add_argument("--version", action="version", version=f"offload {offload.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="what this machine and build offer (kernels, cores, memory, accelerator)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("launch", help="run a command (accelerate launch, torchrun, python) with offload standing in "
                                       "for DeepSpeed in every process it starts: TRL, transformers' and "
                                       "accelerate's DeepSpeed paths run on offload's engine (docs/trl.md)")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="command ...", help="the command and its arguments")
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("config", help="check a DeepSpeed-format config, or print the config reference")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("check", help="load and resolve a config; exit 2 with the key path if it is wrong")
    c.add_argument("config", help="path to a JSON config")
    c.add_argument("--world-size", type=positive_int, default=1, help="ranks to resolve the batch rule for (default 1)")
    c.add_argument("--hidden-size", type=positive_int, default=None, help="model width, for \"auto\" bucket sizes")
    c.add_argument("--print-resolved", action="store_true", help="print the resolved config as JSON")
    c.set_defaults(func=_cmd_config_check)
    c = csub.add_parser("docs", help="print the config reference (docs/CONFIG.md)")
    c.set_defaults(func=_cmd_config_docs)

    p = sub.add_parser("demo", help="a walk-through of the engine's own loop (initialize, forward, backward, step) "
                                     "on the embedded default config; the main job is `offload train`")
    p.add_argument("--config", default=None, help="a JSON config instead of the embedded default")
    p.add_argument("--steps", type=positive_int, default=150)
    p.add_argument("--trace", default=None, help="write a Chrome-trace timeline of the run to this path")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("tune-nvme", help="sweep the NVMe swap path; write the best aio settings as a config fragment")
    p.add_argument("--path", required=True, help="a directory on the drive that will hold the swap files")
    p.add_argument("--quick", action="store_true", help="a small grid on a 256 MiB file (under a minute)")
    p.add_argument("--file-size", type=positive_size, default=None, help="bytes per transfer (default: 1Gi, quick "
                                                                         "256Mi)")
    p.add_argument("--no-fio", action="store_true", help="skip fio even if it is installed")
    p.add_argument("--out", default=None, help="output directory (default ./offload-tune-nvme)")
    p.set_defaults(func=_cmd_tune_nvme)

    from offload.commands.train import TrainArgs
    from offload.models.catalog import MODELS
    d = TrainArgs()
    p = sub.add_parser("train", help="train a causal LM through the runtime (the main job; embedded defaults)")
    p.add_argument("--model", default=d.model, help=f"{', '.join(MODELS)}, or a local Hugging Face checkpoint "
                                                    f"directory to fine-tune (default {d.model})")
    p.add_argument("--layers", type=positive_int, default=None, help="override the model's depth")
    p.add_argument("--hidden", type=positive_int, default=None, help="override the model's width")
    p.add_argument("--heads", type=positive_int, default=None, help="override the model's attention heads")
    p.add_argument("--seq", type=positive_int, default=d.seq, help=f"tokens per sample (default {d.seq})")
    p.add_argument("--data", default=None, help="text file (bytes are tokens), or tokens as .npy / uint16 .bin "
                                                "(default: embedded text)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary of pre-tokenized data (default max "
                                                                    "id + 1)")
    p.add_argument("--config", default=None, help="a DeepSpeed-style JSON config (default: the embedded one)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--micro-batch", type=positive_int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--lr", type=non_negative_float, default=None, help="override the optimizer's lr")
    p.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None,
                   help="override zero_optimization.offload_optimizer.device")
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None,
                   help="override zero_optimization.offload_param.device (needs the optimizer offloaded)")
    p.add_argument("--max-in-cpu", type=non_negative_int, default=None,
                   help="with --offload-param nvme: parameter elements kept on the host (DeepSpeed's max_in_cpu, "
                        "default 1e9; 0 puts every shard on NVMe)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage (stage 0 keeps the optimizer on the device)")
    p.add_argument("--checkpointing", choices=["none", "device", "cpu"], default=None,
                   help="activation checkpointing of every block: saved inputs on the device, or in host memory")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="compile each block with torch.compile (engine.compile(); default backend inductor) and "
                        "print its graphs, graph breaks and recompiles")
    p.add_argument("--nvme-path", default=d.nvme_path, help=f"swap directory for nvme (default ./{d.nvme_path})")
    p.add_argument("--init-empty", action="store_true", help="build the model under offload.zero.Init")
    p.add_argument("--seed", type=non_negative_int, default=d.seed)
    p.add_argument("--out", default=d.out, help=f"record.json, trace.json and loss.png go here (default ./{d.out})")
    p.add_argument("--save-every", type=non_negative_int, default=0, help="save a checkpoint every N steps")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (default <out>/checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--keep-last", type=positive_int, default=None,
                   help="keep only the newest N checkpoints in --save-dir (offload.checkpoints.keep_last; default: "
                        "every one)")
    p.add_argument("--no-save-on-stop", dest="save_on_stop", action="store_false",
                   help="on SIGTERM or SIGINT, stop after the step under way without saving a checkpoint of it "
                        "(default: save one, then exit 143 / 130)")
    p.add_argument("--tag", default=None, help="with --resume: this checkpoint tag instead of the latest (to step "
                                               "around a damaged one)")
    p.add_argument("--print-every", type=positive_int, default=None, help="steps between progress lines")
    p.add_argument("--expect-loss-drop", action="store_true",
                   help="exit 1 (saying so) unless the last step's loss is below the first's")
    p.add_argument("--verbose", action="store_true",
                   help="say why the step runs as it does (each 'auto' choice's reason; record.json has it too)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("estimate", help="bytes per tier per rank for a model under a config, and the largest model "
                                        "each offload choice trains on this machine")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--model", default=None, help="a model name as in `offload train` (default gpt2), built on "
                                                   "the meta device")
    size.add_argument("--params", type=positive_size, default=None, help="a parameter count instead (e.g. 2e9, 7G)")
    p.add_argument("--layers", type=positive_int, default=None)
    p.add_argument("--hidden", type=positive_int, default=None)
    p.add_argument("--vocab", type=positive_int, default=None, help="default: 50304 (gpt2), 32000 (llama), 256 "
                                                                    "(built-in)")
    p.add_argument("--seq", type=positive_int, default=1024)
    p.add_argument("--world", type=positive_int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--config", default=None, help="a DeepSpeed-style config (default: bf16, optimizer on the host)")
    p.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None)
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None)
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage (default: the config's, "
                                                                                "or 3); a table compares all four")
    p.add_argument("--micro", type=positive_int, default=None, help="--model: samples per rank per micro-batch, for "
                                                                    "the activations (default: the config's, or 1)")
    p.add_argument("--checkpointing", choices=["none", "device", "cpu"], default=None,
                   help="--model: activation checkpointing of every block, inputs kept on the device or in host "
                        "memory (default: the config's)")
    p.add_argument("--nvme-path", default="offload-swap", help="where NVMe swap would go (its free space counts)")
    from offload.bench.replay import MACHINES
    p.add_argument("--machine", default=None, choices=sorted(MACHINES), help="the rates the step is estimated at: "
                   "a preset of `offload bench replay` (default: on a GPU machine, the rates start-up measures "
                   "there, with the h100 preset's compute; elsewhere h100)")
    p.add_argument("--device-gbps", type=positive_float, default=None, help="device memory GB/s instead of the "
                                                                            "preset's")
    p.add_argument("--host-gbps", type=positive_float, default=None, help="host memory GB/s as Adam streams it "
                                                                          "(`offload bench adam` measures it)")
    p.add_argument("--nvme-gbps", type=positive_float, default=None, help="the swap path's GB/s, reads and writes "
                                                                          "together (`offload tune-nvme`); without "
                                                                          "it an NVMe tier's cost is not estimated")
    p.add_argument("--device-tflops", type=positive_float, default=None, help="the model's compute in TFLOP/s as "
                                                                              "plain PyTorch runs it, instead of the "
                                                                              "preset's (the step's compute term)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("inspect", help="what a checkpoint holds: step, world size, sizes per state, config")
    p.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding `latest`")
    p.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("convert-checkpoint", help="rewrite a checkpoint from an older offload so that loading it "
                                                  "runs no code; run it only on a checkpoint you trust (it "
                                                  "unpickles the files as they are)")
    p.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding `latest`")
    p.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    p.set_defaults(func=_cmd_convert_checkpoint)

    p = sub.add_parser("export-weights", help="a checkpoint's model weights as safetensors (sharded like Hugging "
                                              "Face's), streamed unit by unit")
    p.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding `latest`")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    p.add_argument("--max-shard-size", type=positive_size, default="5Gi", help="bytes per file at most (default 5Gi)")
    p.add_argument("--replace", action="store_true", help="replace the weights OUT already holds (old shards and "
                                                          "index go together; never a mix of two exports)")
    p.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    p.set_defaults(func=_cmd_export_weights)

    _bench_parsers(sub.add_parser("bench", help="benchmarks beside their baselines, in one run; writes JSON"))
    return parser


def _bench_parsers(p: argparse.ArgumentParser) -> None:
    """Each benchmark its own flags (a flag of another benchmark is an error, not silently ignored)."""
    from offload.models.catalog import MODELS
    bsub = p.add_subparsers(dest="what", required=True,
                            metavar="{adam,all,formats,hooks,lend,nvme,pcie,replay,schedule,step}")

    def bench(name: str, help: str, out: str = "JSON path (default bench-results/<benchmark>.json)"
              ) -> argparse.ArgumentParser:
        b = bsub.add_parser(name, help=help)
        b.add_argument("--out", default=None, help=out)
        b.set_defaults(func=_cmd_bench)
        return b

    b = bench("adam", "CPU Adam beside torch's AdamW and the measured DRAM ceiling")
    b.add_argument("--sizes", type=positive_sizes, default="10M,100M",
                   help="parameter counts, comma-separated (default 10M,100M)")
    b.add_argument("--repeats", type=positive_int, default=5, help="timed runs per size; the median is reported")
    b.add_argument("--threads", type=positive_int, default=None, help="threads (default: physical cores)")

    b = bench("formats", "the optimizer state's formats trained to the end beside fp32's seeds (the convergence "
                         "A/B); a plot beside the JSON")
    b.add_argument("--steps", type=positive_int, default=2000, help="steps a run (default 2000)")
    b.add_argument("--seeds", type=positive_int, default=3, help="fp32 runs that make the band (default 3)")
    b.add_argument("--hidden", type=positive_int, default=96, help="model width (default 96)")
    b.add_argument("--layers", type=positive_int, default=3, help="blocks (default 3)")
    b.add_argument("--seq", type=positive_int, default=64, help="bytes a sequence (default 64)")
    b.add_argument("--micro", type=positive_int, default=16, help="sequences a step (default 16)")
    b.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    b.add_argument("--warmup", type=positive_int, default=100, help="warmup steps (default 100)")
    b.add_argument("--eval-every", type=positive_int, default=100, help="held-out loss every this many steps")
    b.add_argument("--formats", type=lambda text: [f.strip() for f in text.split(",") if f.strip()],
                   default="fp32,bf16 moments,16+16 master,bf16 master stochastic,bf16 master nearest",
                   help="formats, comma-separated (default all: fp32, bf16 moments, 16+16 master, bf16 master "
                        "stochastic, bf16 master nearest)")

    b = bench("all", "every benchmark this machine supports; one all.json and a summary plot",
              out="output directory (default bench-results/)")
    b.add_argument("--quick", action="store_true", help="small sizes, one round, headline variants only (under a "
                                                        "minute here): a smoke run, not figures to quote")
    b.add_argument("--path", default="/tmp/offload-bench", help="directory on the drive to use for NVMe")

    b = bench("hooks", "host time each module hook adds per call, on a model too small to compute")
    b.add_argument("--layers", type=positive_int, default=64, help="tiny layers, one unit each (default 64)")
    b.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds; the median (default 5)")
    b.add_argument("--iterations", type=positive_int, default=20, help="passes per round and side (default 20)")

    b = bench("lend", "engine.offload_states()/reload_states(): the device bytes freed and the round trip, beside "
                      "the bus and DeepSpeed's")
    b.add_argument("--hidden", type=positive_int, default=1024, help="GPT width (default 1024)")
    b.add_argument("--layers", type=positive_int, default=8, help="blocks (default 8)")
    b.add_argument("--vocab", type=positive_int, default=50304, help="vocabulary (default 50304)")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="compute dtype (default bf16)")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default where there is one), or cpu: the emulated discrete device")
    b.add_argument("--placement", choices=["device", "ratio-half", "optimizer-host"], default="device",
                   help="where both engines keep the state (default device: an RLHF actor's, nothing offloaded)")
    b.add_argument("--rounds", type=positive_int, default=5, help="round trips a side; the median (default 5)")

    b = bench("pcie", "on a GPU: pinned vs pageable H2D/D2H GB/s, and both directions at once")
    b.add_argument("--pcie-size", type=positive_size, default="256Mi", help="bytes per copy (default 256Mi)")
    b.add_argument("--repeats", type=positive_int, default=5, help="timed copies per measurement; the median")

    b = bench("nvme", "read/write GB/s and CPU s/GB of each engine, with and without checksums, and fio's")
    b.add_argument("--path", default="/tmp/offload-bench", help="directory on the drive to use")
    b.add_argument("--file-size", type=positive_size, default="1Gi", help="bytes per transfer (default 1Gi)")
    b.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds per grid point (default 3)")
    b.add_argument("--blocks", type=positive_sizes, default="1Mi,8Mi", help="block sizes (default 1Mi,8Mi)")
    b.add_argument("--depths", type=positive_ints, default="8,32", help="queue depths (default 8,32)")

    def machine(b: argparse.ArgumentParser) -> None:
        b.add_argument("--machine", default="h100", help="the described machine's preset (default h100)")
        b.add_argument("--tokens", type=positive_int, default=None,
                       help="tokens per step to replay at (default: as recorded); compute scales with them")
        from offload.bench.replay import RATES
        for rate in RATES:
            b.add_argument("--" + rate.replace("_", "-"), dest=rate, type=float, default=None,
                           help=f"override the preset's {rate.replace('_', ' ')}")

    b = bench("schedule", "record a step's schedule (streams, copies, waits) on this CPU as a discrete device",
              out="schedule JSON path (default bench-results/schedule.json)")
    b.add_argument("--hidden", type=positive_int, default=1024, help="GPT width (default 1024)")
    b.add_argument("--layers", type=positive_int, default=12, help="GPT blocks (default 12)")
    b.add_argument("--seq", type=positive_int, default=512, help="tokens per sample (default 512)")
    b.add_argument("--vocab", type=positive_int, default=4096, help="vocabulary (default 4096: with the defaults, the "
                   "156M GPT the H100 step ran)")
    b.add_argument("--micro", type=positive_int, default=1, help="samples recorded per step (default 1; replay "
                                                                  "scales compute with --tokens)")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="compute dtype (default bf16)")
    b.add_argument("--params", choices=["none", "cpu"], default="none",
                   help="offload_param.device: none (device-homed shards) or cpu (host-homed)")
    b.add_argument("--early", choices=["off", "on"], default="off", help="the early-returning step (on a GPU "
                                                                          "the default with the state on the host)")
    b.add_argument("--speculative", choices=["off", "on"], default="off",
                   help="host shards' Adam speculated during backward (offload.speculative_step; with --clip large "
                        "enough not to fire, every speculation is kept)")
    b.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (default 1.0)")
    b.add_argument("--overlap", choices=["off", "on"], default="off",
                   help="offload.overlap_step: the host Adam during the last backward (needs --clip 0; default off)")
    b.add_argument("--ratio", type=ratio_value, default=1.0,
                   help="offload_optimizer.ratio: a number or auto (default 1: all of the state on the host)")
    b.add_argument("--stream", type=ratio_value, default=0.0,
                   help="offload.stream_state: the share of the host-homed state the device steps over the bus, or "
                        "auto (chosen at the --machine preset's rates, within --device-budget or half the preset's "
                        "device memory; default 0: the host steps it all)")
    b.add_argument("--device-budget", type=positive_size, default=None, metavar="SIZE",
                   help="offload.budgets.device, which auto fills (this CPU has no device memory to measure)")
    b.add_argument("--unit-bytes", type=positive_size, default="4Mi", help="offload.unit_bytes (default 4Mi)")
    b.add_argument("--steps", type=positive_int, default=2, help="steps recorded after one warm-up (default 2)")
    machine(b)

    b = bench("replay", "time a recorded schedule on a described machine; its critical path by lane and kind",
              out="JSON path (default bench-results/replay.json)")
    b.add_argument("schedule", help="a schedule JSON written by `offload bench schedule`")
    b.add_argument("--free", action="append", default=[], metavar="KIND",
                   help="charge nothing for this kind of work (repeatable), e.g. accumulate: what removing it from "
                        "the step would give")
    machine(b)

    b = bench("step", "a ZeRO training step on W gloo ranks beside plain PyTorch, split into its phases")
    b.add_argument("--path", default="/tmp/offload-bench", help="directory on the drive to use for NVMe")
    b.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds (default 2)")
    b.add_argument("--model", default=None, choices=list(MODELS), metavar="NAME",
                   help=f"a model as in `offload train` ({', '.join(MODELS)}) at its own size, which --hidden and "
                        "--layers override; every side trains it (default: the built-in GPT at --hidden x --layers)")
    b.add_argument("--hidden", type=positive_int, default=None, help="width (default 256, or --model's)")
    b.add_argument("--layers", type=positive_int, default=None, help="blocks (default 4, or --model's)")
    b.add_argument("--seq", type=positive_int, default=128, help="tokens per sample (default 128)")
    b.add_argument("--vocab", type=positive_int, default=4096, help="vocabulary (default 4096; GPT-2: 50304)")
    b.add_argument("--micro", type=positive_int, default=4, help="samples per rank per step (default 4)")
    b.add_argument("--accum", type=positive_int, default=1, help="micro-batches per step, gradient accumulation "
                                                                 "on both sides (default 1)")
    b.add_argument("--unit-bytes", type=positive_size, default="4Mi", help="offload.unit_bytes of offload's variants "
                                                                           "(default 4Mi; the engine's own default "
                                                                           "is 64Mi)")
    b.add_argument("--world", type=positive_int, default=2, help="ranks (gloo processes, default 2)")
    b.add_argument("--steps", type=positive_int, default=5, help="timed steps per round (default 5)")
    b.add_argument("--warmup", type=positive_int, default=3,
                   help="untimed steps first in each round (default 3: the first steps differ, and bytes are counted "
                        "from the last of them on)")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default fp32)")
    b.add_argument("--offload", choices=["none", "cpu", "nvme"], default="cpu",
                   help="optimizer state on the host, or on NVMe under --path (then host, pipelined and serial NVMe "
                        "variants are compared); none: on the device (with --stage)")
    b.add_argument("--stage", default="3", help="ZeRO stage(s), e.g. 0,1,2,3 to compare them side by side (default "
                                                "3: the offload variants)")
    b.add_argument("--checkpointing", choices=["none", "device", "cpu"], default="none",
                   help="checkpoint every block in the offload variants (the cost of the recompute against torch "
                        "without it)")
    b.add_argument("--sub-group-size", type=positive_int, default=1_000_000, help="optimizer sub-group elements")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides compute (cuda: torch on the GPU beside offload with W=1)")
    b.add_argument("--headline-only", action="store_true", help="only the headline variant (and, for nvme, the host "
                                                                 "one beside it)")
    b.add_argument("--variants", default=None, help="only these variants, comma-separated (the first is the "
                                                    "headline), e.g. clip-after,clip-speculative-kept; with "
                                                    "--baseline deepspeed: host, nvme, optimizer-host, "
                                                    "optimizer-host-torch-adam, ratio-half, device")
    b.add_argument("--profile", action="store_true", help="rank 0 of the headline variant's timed steps under torch's "
                                                           "profiler: profile-<variant>.json beside --out (Chrome "
                                                           "trace: kernels per stream on a GPU, offload's phases)")
    b.add_argument("--device-budget", type=positive_size, default=None, metavar="SIZE",
                   help="offload.budgets.device of offload's variants, e.g. 12Gi (default: what is free at start); "
                        "below the optimizer state's size, ratio-auto splits the state as on a smaller GPU (plain "
                        "PyTorch is not bounded)")
    b.add_argument("--baseline", choices=["torch", "deepspeed", "floor"], default="torch",
                   help="deepspeed: the same model, batch and config (written once, read by both) through "
                        "DeepSpeed's ZeRO-3 with params and optimizer on the host (and on NVMe with --offload nvme), "
                        "beside offload and plain PyTorch, in alternating rounds; floor: one rank of offload's "
                        "placements (full, auto, auto-params-device, nvme) beside plain PyTorch and each one's floor, "
                        "max(compute, the host's Adam share at the rate measured in the run)")
    b.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="plain PyTorch and offload's headline variant, each eager and with every block compiled "
                        "(torch.compile, default backend inductor): how much of compile's gain offload keeps")
    b.add_argument("--clip", type=float, default=1.0, help="gradient_clipping with --baseline floor (0: off; "
                                                            "default 1.0)")
    b.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="every side's optimizer: AdamW (default), or torch.optim.Muon on the hidden matrices beside "
                        "AdamW on the rest (offload: the config's type Muon; its variants: host, clip-after, "
                        "noclip-after, params-host)")
    b.add_argument("--state-format", choices=["fp32", "bf16-moments", "16+16", "bf16-master", "bf16-master-nearest"],
                   default="fp32", help="offload.optimizer_state of offload's variants that name none: fp32 (default), "
                                        "bf16 moments, a 16+16 master with bf16 moments, a bf16 master rounded "
                                        "stochastically or to nearest (the last three need --dtype bf16); --baseline "
                                        "floor prices the host Adam at that format's rate")


def _output(args: argparse.Namespace) -> Path:
    """Where a bench or tune-nvme command writes: --out, or its default (a file per benchmark, a directory for
    bench all and tune-nvme)."""
    if args.out:
        return Path(args.out)
    if args.command == "tune-nvme":
        return Path("offload-tune-nvme")
    if args.what == "step" and getattr(args, "compile", None):
        return Path("bench-results") / "step-compile.json"
    if args.what == "step" and args.baseline != "torch":
        return Path("bench-results") / f"step-vs-{args.baseline}.json"
    return Path("bench-results") if args.what == "all" else Path("bench-results") / f"{args.what}.json"


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file or directory the command will write can be written, before any work starts: a long run must not
    end by failing to save what it measured."""
    files: list[tuple[str, str | Path]] = []
    directories: list[tuple[str, str | Path]] = []
    if args.command == "bench":
        (directories if args.what == "all" else files).append(("--out", _output(args)))
    elif args.command == "estimate" and args.json:
        files.append(("--json", args.json))
    elif args.command == "demo" and args.trace:
        files.append(("--trace", args.trace))
    elif args.command == "tune-nvme":
        directories.append(("--out", _output(args)))
    elif args.command == "export-weights":
        directories.append(("the output directory", args.out))
    for flag, path in files:
        problem = output_file_problem(path)
        if problem is not None:
            raise UsageError(f"{flag} {path}: {problem}; choose another path")
    for flag, path in directories:
        problem = directory_problem(path)
        if problem is not None:
            raise UsageError(f"{flag} {path}: {problem}; choose another directory")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_outputs(args)
        return args.func(args)
    except BrokenPipeError:  # `offload inspect ... | head`: the reader has gone, which is no error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except _user_errors() as e:
        name = args.command + (f" {args.what}" if getattr(args, "what", None) else "")
        print(f"offload {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
