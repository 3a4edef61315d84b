"""Every config key acts, says it has no effect, or is refused; the honoured ones have a reader in the code."""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from conftest import REPO
from engine_cases import base_config, batches, loss_of, make_model
from test_config_load import HF_STYLE

import offload
from offload.config import Config, ConfigError, NoEffect, Support, config_fields
from offload.config.fields import _strip_optional, public_fields, spec_of
from offload.config.sections import SCHEDULER_PARAMS

PACKAGE = REPO / "offload"


# --------------------------------------------------------------------------- readers, found in the source


def _owners() -> dict[str, set[str]]:
    """Dotted key path -> the names of the section classes that declare it."""
    owners: dict[str, set[str]] = collections.defaultdict(set)

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in public_fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            owners[path].add(cls.__name__)
            core, _ = _strip_optional(hints[f.name])
            if spec_of(f).hint_from is not None:
                for variant in SCHEDULER_PARAMS.values():
                    walk(variant, path)
            elif dataclasses.is_dataclass(core):
                walk(core, path)
    walk(Config, "")
    return owners


@dataclasses.dataclass
class Reads:
    """What a set of source files reads by attribute: names, (object, name) pairs, and names per file."""

    names: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    pairs: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    files: list[tuple[str, set[str]]] = dataclasses.field(default_factory=list)  # (source text, names read)


def read_attributes(paths: list[Path]) -> Reads:
    reads = Reads()
    for path in paths:
        text = path.read_text()
        here: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                here.add(node.attr)
                if isinstance(node.value, ast.Attribute):
                    reads.pairs.add((node.value.attr, node.attr))
                elif isinstance(node.value, ast.Name):
                    reads.pairs.add((node.value.id, node.attr))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                here.add(str(node.args[1].value))
        reads.names.update(here)
        reads.files.append((text, here))
    return reads


def unread_keys(reads: Reads) -> list[str]:
    """Honoured keys nothing reads. A key counts as read by ``<section>.<key>``; by ``.<key>`` where no other
    section has a key of that name; or by ``.<key>`` in a file that names the class declaring it."""
    owners = _owners()
    leaf_paths: dict[str, set[str]] = collections.defaultdict(set)
    for info in config_fields():
        leaf_paths[info.path.rsplit(".", 1)[-1]].add(info.path)
    missing = []
    for info in config_fields():
        if info.spec.support is not Support.HONOURED or dataclasses.is_dataclass(info.hint) or info.path in missing:
            continue
        *parents, key = info.path.split(".")
        found = (parents and (parents[-1], key) in reads.pairs) \
            or (len(leaf_paths[key]) == 1 and reads.names[key] > 0) \
            or any(key in names and any(owner in text for owner in owners[info.path]) for text, names in reads.files)
        if not found:
            missing.append(info.path)
    return missing


def _sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "config"]


def test_every_honoured_key_has_a_reader_outside_the_config_package():
    missing = unread_keys(read_attributes(_sources()))
    assert not missing, (f"keys marked honoured that no code outside offload/config reads: {', '.join(missing)}; "
                         "make the runtime act on them, or declare them support=NO_EFFECT (with the reason) or "
                         "REFUSED")


def test_the_reader_check_fails_when_a_reader_goes():
    """Mutation check: without the engine package (and so its checkpoint glue), their keys have no reader."""
    sources = [p for p in _sources() if p.relative_to(PACKAGE).parts[0] != "engine"]
    missing = unread_keys(read_attributes(sources))
    for key in ("offload.overlap_step", "zero_optimization.ignore_unused_parameters", "wall_clock_breakdown",
                "zero_optimization.load_from_fp32_weights", "checkpoint.tag_validation"):
        assert key in missing


def test_every_key_without_effect_or_refused_says_why():
    for info in config_fields():
        if info.spec.support is not Support.HONOURED:
            assert info.spec.note.strip(), f"{info.path} is {info.spec.support.value} but gives no reason"


# --------------------------------------------------------------------------- reporting


def _set_value(info) -> object:
    """A value for ``info``'s key other than its default, of its type."""
    core, _ = _strip_optional(info.hint)
    default = info.default
    if core is bool:
        return not default
    if core is int:
        return (default or 0) + 1 if (info.spec.le is None or (default or 0) + 1 <= info.spec.le) else default - 1
    if core is float:
        return (default or 0.0) / 2 if default else 0.5
    if core is str:
        return next(c for c in info.spec.choices if c != default) if info.spec.choices else "x"
    if typing.get_origin(core) is list:
        return ["x"]
    if typing.get_origin(core) is dict:
        return {"x": 1}
    raise AssertionError(f"no test value for {info.path} ({info.hint})")


def _nest(path: str, value: object) -> dict:
    *parents, key = path.split(".")
    raw: dict = {key: value}
    for p in reversed(parents):
        raw = {p: raw}
    return raw


def _no_effect_leaves():
    seen = set()
    for info in config_fields():
        if (info.spec.support is Support.NO_EFFECT and not dataclasses.is_dataclass(info.hint)
                and info.path not in seen and not info.path.startswith("scheduler.")):
            seen.add(info.path)
            yield info


@pytest.mark.parametrize("info", list(_no_effect_leaves()), ids=lambda i: i.path)
def test_each_key_without_effect_is_reported_by_name(info):
    raw = _nest(info.path, _set_value(info))
    if info.path.split(".")[0] in ("tensorboard", "csv_monitor", "wandb", "flops_profiler", "comms_logger"):
        raw[info.path.split(".")[0]]["enabled"] = True
    cfg = Config.load(raw)
    section = info.path.rsplit(".", 1)[0]
    named = [n for n in cfg.no_effect if n.path in (info.path, section)]
    assert named, f"setting {info.path} was not reported: {cfg.notes}"
    assert "has no effect in offload: " + info.spec.note in named[0]


def test_keys_at_their_default_or_in_a_disabled_section_say_nothing():
    assert Config.load({"tensorboard": {"enabled": False}, "wall_clock_breakdown": False,
                        "zero_optimization": {"contiguous_gradients": True}}).notes == ()


# The new user's config from the issue.
NEW_USER = {
    "train_micro_batch_size_per_gpu": 2,
    "fp16": {"enabled": True, "auto_cast": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": False,
                          "reduce_bucket_size": 1000, "stage3_max_reuse_distance": 5,
                          "ignore_unused_parameters": False},
    "aio": {"single_submit": True},
}
# Hugging Face's ZeRO-3 offload config, with the WarmupLR schedule of transformers' own ds_config_zero3.json
# (WarmupDecayLR's "auto" total_num_steps is known only to the Trainer).
HF_ZERO3_OFFLOAD = {**HF_STYLE, "scheduler": {"type": "WarmupLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}


def _check(tmp_path: Path, raw: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    return subprocess.run([sys.executable, "-m", "offload", "config", "check", str(path), "--hidden-size", "64"],
                          capture_output=True, text=True, timeout=120)


def test_config_check_prints_every_key_without_effect(tmp_path):
    out = _check(tmp_path, NEW_USER)
    assert out.returncode == 0, out.stderr
    for key in ("zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_max_reuse_distance", "aio.single_submit"):
        assert f"{key} has no effect in offload" in out.stdout
    # honoured now: no note for them
    assert "auto_cast" not in out.stdout and "ignore_unused_parameters" not in out.stdout

    out = _check(tmp_path, HF_ZERO3_OFFLOAD)
    assert out.returncode == 0, out.stderr
    assert "zero_optimization.reduce_bucket_size has no effect in offload" in out.stdout
    # the rest are honoured or at their defaults (pin_memory: true is DeepSpeed's default, and offload always pins)
    assert out.stdout.count("has no effect") == 1 and "pin_memory" not in out.stdout


def test_a_partial_optimizer_offload_is_honoured_and_out_of_range_is_refused(tmp_path):
    out = _check(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert out.returncode == 0, out.stderr
    assert not any("ratio" in line for line in out.stdout.splitlines() if "note" in line)  # honoured: no note
    assert "optimizer state on the host (0.7 of it stays on the device: offload_optimizer.ratio 0.3)" in out.stdout
    out = _check(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})
    assert out.returncode == 2 and "zero_optimization.offload_optimizer.ratio" in out.stderr


def test_keys_made_pointless_by_their_siblings_are_reported():
    cfg = Config.load({"fp16": {"loss_scale": 128}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "buffer_count": 8},
        "offload_param": {"device": "cpu", "max_in_cpu": 10}}})
    assert {n.path for n in cfg.no_effect} == {"fp16.loss_scale", "zero_optimization.offload_optimizer.buffer_count",
                                               "zero_optimization.offload_param.max_in_cpu"}
    assert "fp16 is not enabled" in cfg.no_effect[0]
    # with fp16 on, its settings act
    assert Config.load({"fp16": {"enabled": True, "loss_scale": 128}}).no_effect == ()


def test_initialize_lists_the_keys_without_effect_in_one_line(caplog):
    raw = base_config(2, 1, 1, clip=0.0)
    raw["zero_optimization"].update(contiguous_gradients=False, reduce_bucket_size=1000)
    raw["aio"] = {"single_submit": True}
    with caplog.at_level(logging.INFO, logger="offload"):
        engine, *_ = offload.initialize(model=make_model("gpt"), config=raw)
        engine.close()
    lines = [r.getMessage() for r in caplog.records if "have no effect" in r.getMessage()]
    assert len(lines) == 1
    assert "3 key(s)" in lines[0]
    for key in ("contiguous_gradients", "reduce_bucket_size", "aio.single_submit"):
        assert key in lines[0]
    # and Config.load itself did not log them one by one
    assert not any(isinstance(r.msg, NoEffect) or "single_submit has no effect" in r.getMessage()
                   for r in caplog.records if r.getMessage() != lines[0])


# --------------------------------------------------------------------------- keys honoured here


def _train(config: dict, steps: int = 4, model=None):
    engine, *_ = offload.initialize(model=model or make_model("gpt"), config=config)
    for tokens in batches(steps, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
    return engine


def test_wall_clock_breakdown_logs_phase_times_every_steps_per_print(caplog):
    raw = base_config(2, 1, 1, clip=0.0)
    raw.update(wall_clock_breakdown=True, steps_per_print=2)
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        _train(raw, steps=4).close()
    lines = [r.getMessage() for r in caplog.records if "time per step" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == ["step 2", "step 4"]
    assert "forward" in lines[0] and "backward" in lines[0] and "optimizer" in lines[0]
    raw["wall_clock_breakdown"] = False
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        _train(raw, steps=2).close()
    assert not any("time per step" in r.getMessage() for r in caplog.records)


def test_memory_breakdown_and_dump_state_log(caplog):
    raw = base_config(2, 1, 1, clip=0.0)
    raw.update(memory_breakdown=True, dump_state=True, steps_per_print=2)
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        _train(raw, steps=2).close()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("engine state at start (dump_state)") and '"stage": 3' in m for m in messages)
    assert any(m.startswith("step 2: memory on rank 0") for m in messages)


class UsesHalf(torch.nn.Module):
    """Records the dtype its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.seen += [x.dtype, ids.dtype]
        return self.lin(x.to(self.lin.weight.dtype)).float().pow(2).mean()


@pytest.mark.parametrize("auto_cast", [False, True])
def test_fp16_auto_cast_casts_floating_inputs(auto_cast):
    raw = base_config(2, 1, 1, clip=0.0)
    raw["fp16"] = {"enabled": True, "auto_cast": auto_cast}
    model = UsesHalf()
    engine, *_ = offload.initialize(model=model, config=raw)
    engine(torch.randn(2, 8), torch.arange(2))
    engine.close()
    assert model.seen == [torch.float16 if auto_cast else torch.float32, torch.int64]


class HalfUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).pow(2).mean()


@pytest.mark.parametrize("ignore", [True, False])
def test_ignore_unused_parameters(ignore):
    raw = base_config(2, 1, 1, clip=0.0, unit_bytes=4096)
    raw["zero_optimization"]["ignore_unused_parameters"] = ignore
    torch.manual_seed(0)
    model = HalfUsed()
    before = model.unused.weight.detach().clone()
    engine, *_ = offload.initialize(model=model, config=raw)
    engine.backward(engine(torch.randn(2, 4)))
    if ignore:
        engine.step()
        assert engine.global_steps == 1
    else:
        with pytest.raises(offload.EngineError, match=r"unused\.weight.*ignore_unused_parameters is false"):
            engine.step()
        assert engine.global_steps == 0
    after = engine.full_state_dict()
    engine.close()
    # AdamW's weight decay moves even a gradient-free parameter only when a step ran
    assert torch.equal(after["unused.weight"], before) != ignore


def test_load_from_fp32_weights_false_rounds_the_master_weights(tmp_path):
    raw = base_config(2, 1, 1, clip=0.0)
    raw["bf16"] = {"enabled": True}
    _train(raw, steps=2).save_checkpoint(tmp_path)
    results = {}
    for exact in (True, False):
        raw["zero_optimization"]["load_from_fp32_weights"] = exact
        engine, *_ = offload.initialize(model=make_model("gpt"), config=raw)
        engine.load_checkpoint(tmp_path)
        results[exact] = engine.full_state_dict()
        engine.close()
    key = "blocks.0.attn.qkv.weight" if "blocks.0.attn.qkv.weight" in results[True] else next(
        k for k, v in results[True].items() if v.dim() == 2)
    exact, rounded = results[True][key], results[False][key]
    assert not torch.equal(exact, rounded)
    assert torch.equal(rounded, exact.to(torch.bfloat16).float())


def test_config_error_for_refused_keys_names_them():
    with pytest.raises(ConfigError, match="zero_optimization.zero_quantized_weights: is not supported"):
        Config.load({"zero_optimization": {"zero_quantized_weights": True}})
