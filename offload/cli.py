"""`offload` command line: info, config check/docs, demo."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

import offload
from offload import native
from offload.config import Config, ConfigError


def _cmd_info(args: argparse.Namespace) -> int:
    mem = psutil.virtual_memory()
    print(f"offload {offload.__version__}  (python {platform.python_version()}, torch {torch.__version__})")
    print(f"cpu: {psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores, "
          f"{mem.total / 2**30:.1f} GiB RAM ({mem.available / 2**30:.1f} GiB available)")
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
    print(f"  zero stage {zero.stage}: params on {zero.offload_param.device}, optimizer on "
          f"{zero.offload_optimizer.device}")
    if resolved.optimizer:
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
    from offload.demo import run_demo
    try:
        result = run_demo(args.config, steps=args.steps, out=sys.stdout, trace=args.trace)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0 if result.last_loss < result.first_loss else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from offload.bench import adam, nvme, pcie, step
    if args.what == "all":
        from offload.bench.suite import run_all
        print("offload bench all: every benchmark this machine supports, each beside its baseline", flush=True)
        run_all(Path(args.path), Path(args.out) if args.out else Path("bench-results"), args.quick, sys.stdout)
        return 0
    if args.what == "pcie" and not torch.cuda.is_available():
        print("offload bench pcie: needs a GPU (torch.cuda.is_available() is False on this machine)", file=sys.stderr)
        return 2
    if args.what == "pcie":
        out = Path(args.out) if args.out else Path("bench-results") / "pcie.json"
        print("offload bench pcie: pinned vs pageable host<->GPU copies", flush=True)
        pcie.run(size=adam.parse_size(args.pcie_size), repeats=args.repeats, out=out, stream=sys.stdout)
        print(f"wrote {out}")
    if args.what == "adam":
        sizes = [adam.parse_size(s) for s in args.sizes.split(",")]
        out = Path(args.out) if args.out else Path("bench-results") / "adam.json"
        adam.run(sizes, repeats=args.repeats, threads=args.threads, out=out, stream=sys.stdout)
    if args.what == "nvme":
        out = Path(args.out) if args.out else Path("bench-results") / "nvme.json"
        nvme.run(Path(args.path), size=adam.parse_size(args.file_size), rounds=args.rounds or 3,
                 blocks=tuple(adam.parse_size(b) for b in args.blocks.split(",")),
                 depths=tuple(int(d) for d in args.depths.split(",")), out=out, stream=sys.stdout)
    if args.what == "step":
        out = Path(args.out) if args.out else Path("bench-results") / "step.json"
        try:
            bench = _step_bench(args, step, out)
        except ValueError as e:
            print(f"offload bench step: {e}", file=sys.stderr)
            return 2
        print(f"offload bench step: ZeRO stage {args.stage} beside plain PyTorch, alternating rounds", flush=True)
        step.print_table(step.run(bench, out, log=sys.stdout), sys.stdout)
        print(f"wrote {out}")
    return 0


def _step_bench(args: argparse.Namespace, step: Any, out: Path) -> Any:
    """The step benchmark the command line asks for (ValueError: what is wrong with it)."""
    return step.StepBench(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 64), vocab=args.vocab,
                          seq=args.seq, micro=args.micro, world=args.world, steps=args.steps,
                          repeats=args.rounds or 2, dtype=args.dtype, offload=args.offload, nvme_path=args.path,
                          sub_group_size=args.sub_group_size, trace_dir=str(out.parent), device=args.device,
                          stages=_stages(args.stage), checkpointing=args.checkpointing)


def _cmd_tune_nvme(args: argparse.Namespace) -> int:
    from pathlib import Path

    from offload.aio import tune
    from offload.bench.adam import parse_size
    out = Path(args.out) if args.out else Path("offload-tune-nvme")
    tune.run(Path(args.path), out, quick=args.quick, size=parse_size(args.file_size) if args.file_size else None,
             with_fio=not args.no_fio, stream=sys.stdout)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from offload.train import TrainError, main_args, run
    try:
        record = run(main_args(args))
    except TrainError as e:
        print(f"offload train: {e}", file=sys.stderr)
        return 2
    return 0 if len(record.losses) < 2 or record.losses[-1] < record.losses[0] else 1


def _stages(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--stage {text!r}: give ZeRO stages 0-3, comma-separated (e.g. 0,1,2,3)") from None


def _cmd_estimate(args: argparse.Namespace) -> int:
    from offload.estimate import run_cli
    return run_cli(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from offload.checkpoint import CheckpointError
    from offload.export import describe
    try:
        print(describe(args.checkpoint, args.tag))
    except CheckpointError as e:
        print(f"offload inspect: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_export_weights(args: argparse.Namespace) -> int:
    from offload.bench.adam import parse_size
    from offload.checkpoint import CheckpointError
    from offload.export import export_weights
    try:
        result = export_weights(args.checkpoint, args.out, dtype=args.dtype,
                                max_shard_bytes=parse_size(args.max_shard_size), tag=args.tag)
    except CheckpointError as e:
        print(f"offload export-weights: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.tensors} tensors, {result.total_bytes / 2**20:,.1f} MiB, to {args.out}: "
          + ", ".join(result.files))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload", description=offload.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="what this machine and build offer (kernels, cores, memory, accelerator)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("config", help="check a DeepSpeed-format config, or print the config reference")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("check", help="load and resolve a config; exit 2 with the key path if it is wrong")
    c.add_argument("config", help="path to a JSON config")
    c.add_argument("--world-size", type=int, default=1, help="ranks to resolve the batch rule for (default 1)")
    c.add_argument("--hidden-size", type=int, default=None, help="model width, for \"auto\" bucket sizes")
    c.add_argument("--print-resolved", action="store_true", help="print the resolved config as JSON")
    c.set_defaults(func=_cmd_config_check)
    c = csub.add_parser("docs", help="print the config reference (docs/CONFIG.md)")
    c.set_defaults(func=_cmd_config_docs)

    p = sub.add_parser("demo", help="train a small model on the embedded default config (the README's first command)")
    p.add_argument("--config", default=None, help="a JSON config instead of the embedded default")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--trace", default=None, help="write a Chrome-trace timeline of the run to this path")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("tune-nvme", help="sweep the NVMe swap path; write the best aio settings as a config fragment")
    p.add_argument("--path", required=True, help="a directory on the drive that will hold the swap files")
    p.add_argument("--quick", action="store_true", help="a small grid on a 256 MiB file (under a minute)")
    p.add_argument("--file-size", default=None, help="bytes per transfer (default: 1Gi, quick 256Mi)")
    p.add_argument("--no-fio", action="store_true", help="skip fio even if it is installed")
    p.add_argument("--out", default=None, help="output directory (default ./offload-tune-nvme)")
    p.set_defaults(func=_cmd_tune_nvme)

    from offload.train import MODELS, TrainArgs
    d = TrainArgs()
    p = sub.add_parser("train", help="train a causal LM through the runtime (the main job; embedded defaults)")
    p.add_argument("--model", default=d.model, help=f"{', '.join(MODELS)} (default {d.model})")
    p.add_argument("--layers", type=int, default=None, help="override the model's depth")
    p.add_argument("--hidden", type=int, default=None, help="override the model's width")
    p.add_argument("--heads", type=int, default=None, help="override the model's attention heads")
    p.add_argument("--seq", type=int, default=d.seq, help=f"tokens per sample (default {d.seq})")
    p.add_argument("--data", default=None, help="text file (bytes are tokens), or tokens as .npy / uint16 .bin "
                                                "(default: embedded text)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary of pre-tokenized data (default max id + 1)")
    p.add_argument("--config", default=None, help="a DeepSpeed-style JSON config (default: the embedded one)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--micro-batch", type=int, default=None, help="override train_micro_batch_size_per_gpu")
    p.add_argument("--lr", type=float, default=None, help="override the optimizer's lr")
    p.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None,
                   help="override zero_optimization.offload_optimizer.device")
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None,
                   help="override zero_optimization.offload_param.device (needs the optimizer offloaded)")
    p.add_argument("--max-in-cpu", type=int, default=None,
                   help="with --offload-param nvme: parameter elements kept on the host (DeepSpeed's max_in_cpu, "
                        "default 1e9; 0 puts every shard on NVMe)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage (stage 0 keeps the optimizer on the device)")
    p.add_argument("--checkpointing", choices=["none", "device", "cpu"], default=None,
                   help="activation checkpointing of every block: saved inputs on the device, or in host memory")
    p.add_argument("--nvme-path", default=d.nvme_path, help=f"swap directory for nvme (default ./{d.nvme_path})")
    p.add_argument("--init-empty", action="store_true", help="build the model under offload.zero.Init")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help=f"record.json, trace.json and loss.png go here (default ./{d.out})")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (default <out>/checkpoints)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--print-every", type=int, default=None, help="steps between progress lines")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("estimate", help="bytes per tier per rank for a model under a config, and the largest model "
                                        "each offload choice trains on this machine")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--model", default=None, help="a model name as in `offload train` (default gpt2), built on "
                                                   "the meta device")
    size.add_argument("--params", default=None, help="a parameter count instead (e.g. 2e9)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None, help="default: 50304 (gpt2), 32000 (llama), 256 (built-in)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--config", default=None, help="a DeepSpeed-style config (default: bf16, optimizer on the host)")
    p.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default=None)
    p.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default=None)
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage (default: the config's, "
                                                                                "or 3); a table compares all four")
    p.add_argument("--micro", type=int, default=None, help="--model: samples per rank per micro-batch, for the "
                                                          "activations (default: the config's, or 1)")
    p.add_argument("--checkpointing", choices=["none", "device", "cpu"], default=None,
                   help="--model: activation checkpointing of every block, inputs kept on the device or in host "
                        "memory (default: the config's)")
    p.add_argument("--nvme-path", default="offload-swap", help="where NVMe swap would go (its free space counts)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("inspect", help="what a checkpoint holds: step, world size, sizes per state, config")
    p.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding `latest`")
    p.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("export-weights", help="a checkpoint's model weights as safetensors (sharded like Hugging "
                                              "Face's), streamed unit by unit")
    p.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding `latest`")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    p.add_argument("--max-shard-size", default="5Gi", help="bytes per file at most (default 5Gi)")
    p.add_argument("--tag", default=None, help="a tag inside save_dir instead of `latest`")
    p.set_defaults(func=_cmd_export_weights)

    p = sub.add_parser("bench", help="benchmarks beside their baselines, in one run; writes JSON")
    p.add_argument("what", choices=["adam", "all", "pcie", "nvme", "step"], help="which benchmark")
    p.add_argument("--sizes", default="10M,100M", help="parameter counts, comma-separated (default 10M,100M)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is reported")
    p.add_argument("--threads", type=int, default=None, help="threads (default: physical cores)")
    p.add_argument("--out", default=None, help="JSON path (default bench-results/<what>.json; all: a directory, "
                                               "default bench-results/)")
    p.add_argument("--quick", action="store_true", help="all: small sizes, one round, headline variants only (under a minute here)")
    p.add_argument("--path", default="/tmp/offload-bench", help="nvme, step: directory on the drive to use")
    p.add_argument("--file-size", default="1Gi", help="nvme: bytes per transfer (default 1Gi)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (nvme: per grid point, default 3; "
                                                               "step: default 2)")
    p.add_argument("--blocks", default="1Mi,8Mi", help="nvme: block sizes (default 1Mi,8Mi)")
    p.add_argument("--depths", default="8,32", help="nvme: queue depths (default 8,32)")
    p.add_argument("--hidden", type=int, default=256, help="step: GPT width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="step: GPT blocks (default 4)")
    p.add_argument("--seq", type=int, default=128, help="step: tokens per sample (default 128)")
    p.add_argument("--vocab", type=int, default=4096, help="step: vocabulary (default 4096; GPT-2: 50304)")
    p.add_argument("--micro", type=int, default=4, help="step: samples per rank per step (default 4)")
    p.add_argument("--world", type=int, default=2, help="step: ranks (gloo processes, default 2)")
    p.add_argument("--steps", type=int, default=5, help="step: timed steps per round (default 5)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="step: compute dtype (default fp32)")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"], default="cpu",
                   help="step: optimizer state on the host, or on NVMe under --path (then host, pipelined and "
                        "serial NVMe variants are compared); none: on the device (with --stage)")
    p.add_argument("--stage", default="3", help="step: ZeRO stage(s), e.g. 0,1,2,3 to compare them side by side "
                                                "(default 3: the offload variants)")
    p.add_argument("--checkpointing", choices=["none", "device", "cpu"], default="none",
                   help="step: checkpoint every block in the offload variants (the cost of the recompute against "
                        "torch without it)")
    p.add_argument("--sub-group-size", type=int, default=1_000_000, help="step: optimizer sub-group elements")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="step: where both sides compute (cuda: torch on the GPU beside offload with W=1)")
    p.add_argument("--pcie-size", default="256Mi", help="pcie: bytes per copy (default 256Mi)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
