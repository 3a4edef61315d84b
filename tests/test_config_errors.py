"""Bad configs are ConfigErrors that name the key path and say what would be right."""

import copy
import json
import os
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_config_load import HF_STYLE, SHIPPED

from offload.config import Config, ConfigError, config_fields
from offload.config.fields import _strip_optional

NVME = {"stage": 3, "offload_optimizer": {"device": "nvme"}}


@pytest.mark.parametrize("raw, path, message", [
    ({"zero_optimization": {"stag": 3}}, "zero_optimization.stag", "did you mean 'stage'"),
    ({"zero_optimizaton": {}}, "zero_optimizaton", "did you mean 'zero_optimization'"),
    ({"aio": {"queue_dept": 8}}, "aio.queue_dept", "did you mean 'queue_depth'"),
    ({"aio": {"thread_cnt": 2}}, "aio.thread_cnt", "did you mean"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer", "belongs under zero_optimization"),
    ({"zero_optimization": {"block_size": 4096}}, "zero_optimization.block_size", "belongs under aio"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "must be <= 3"),
    ({"zero_optimization": {"stage": "three"}}, "zero_optimization.stage", "expected a number"),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage", "expected a whole number"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage", "expected a number"),
    ({"zero_optimization": {"stage": None}}, "zero_optimization.stage", "must not be null"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "expected true or false"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "parameter offload needs stage 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device", "needs stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device", "'gpu' is not one of 'none', 'cpu', 'nvme'"),
    ({"zero_optimization": NVME}, "zero_optimization.offload_optimizer.nvme_path", "is required with device 'nvme'"),
    ({"zero_optimization": {"sub_group_size": 0}}, "zero_optimization.sub_group_size", "must be >= 1"),
    ({"aio": {"block_size": 1000}}, "aio.block_size", "must be >= 4096"),
    ({"aio": {"block_size": 6000}}, "aio.block_size", "not a multiple of 4096"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth", "must be >= 1"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "both enabled"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", "must be > 0"),
    ({"optimizer": {"type": "Sophia"}}, "optimizer.type", "'Sophia' is not one of 'Adam', 'AdamW'"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode",
     "use type 'Adam' for L2"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "optimizer.params.betas", "expected a list of 2 numbers"),
    ({"optimizer": {"params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas[1]", "must be < 1"),
    ({"optimizer": {"params": {"lr": "fast"}}}, "optimizer.params.lr", 'a string such as "5e8" is fine'),
    ({"optimizer": {"params": {"lr": float("nan")}}}, "optimizer.params.lr", "expected a finite number, got nan"),
    ({"optimizer": {"params": {"lr": float("inf")}}}, "optimizer.params.lr", "expected a finite number, got inf"),
    ({"gradient_clipping": float("-inf")}, "gradient_clipping", "expected a finite number, got -inf"),
    ({"optimizer": {"params": {"amsgrad": True}}}, "optimizer.params.amsgrad", "is not supported"),
    ({"scheduler": {"type": "OneCycl"}}, "scheduler.type", "is not one of 'WarmupLR'"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}},
     "scheduler.params.total_num_steps", "is required"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}},
     "scheduler.params.cycle_max_lr", "is required by OneCycle"),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}},
     "scheduler.params.total_num_steps", "unknown key"),
    ({"amp": {"enabled": True}}, "amp", "Use the fp16 or bf16 section instead"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 100}}, "elasticity", "would change what is trained"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights",
     "is not supported"),
    ({"zero_optimization": {"cpu_offload": "yes"}}, "zero_optimization.cpu_offload", "expected true or false"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.cpu_offload", "contradicts"),
    ({"offload": {"budgets": {"host": "lots"}}}, "offload.budgets.host", 'a size such as "8GiB"'),
    ({"offload": {"aio_engine": "io-uring"}}, "offload.aio_engine", "did you mean 'io_uring'"),
    ({"train_batch_size": 0}, "train_batch_size", "must be >= 1"),
    ({"gradient_clipping": -1}, "gradient_clipping", "must be >= 0"),
    ({"zero_optimization": []}, "zero_optimization", "expected an object"),
    ({1: 2}, "", "keys must be strings"),
])
def test_bad_value_names_the_key_path(raw, path, message):
    with pytest.raises(ConfigError) as err:
        Config.load(raw)
    assert err.value.path == path
    assert message in str(err.value)
    if path:
        assert str(err.value).startswith(f"{path}: ")


def test_nvme_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        Config.load({"zero_optimization": {**NVME, "offload_optimizer": {"device": "nvme", "nvme_path": str(f)}}})
    with pytest.raises(ConfigError, match="is not a directory"):
        Config.load({"zero_optimization": {**NVME, "offload_optimizer": {"device": "nvme",
                                                                          "nvme_path": str(f / "below")}}})


def test_nvme_path_that_is_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        # Root ignores permission bits; a read-only bind is not available here, so use a path in /proc.
        target = str(ro) if os.geteuid() != 0 else "/proc/offload-swap"
        with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.nvme_path: .* is not writable"):
            Config.load({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": target}}})
    finally:
        os.chmod(ro, 0o700)


def test_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="is not a file"):
        Config.load(tmp_path)
    with pytest.raises(ConfigError, match="a config is a dict, a JSON string or a path"):
        Config.load(42)


@pytest.mark.parametrize("text, message", [
    ('{"train_batch_size": 8,\n "zero_optimization": {stage: 3}}', "is not valid JSON: .* at line 2 column"),
    ('{"aio": {"block_size": 4096, "block_size": 8192}}', "block_size: given twice"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_bad_json_files(tmp_path, text, message):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        Config.load(path)


# ------------------------------------------------------------------ property-based corruption

FIELDS = {}
for _info in config_fields():
    FIELDS.setdefault(_info.path, _info)
# DeepSpeed's deprecated booleans are rewritten before parsing; corrupt them as the bools they are.
for _legacy in ("cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory"):
    FIELDS[f"zero_optimization.{_legacy}"] = FIELDS["zero_optimization.contiguous_gradients"]


def _valid_bases() -> list[dict]:
    bases = [json.loads(p.read_text()) for p in SHIPPED] + [HF_STYLE]
    bases.append({"train_batch_size": 16, "fp16": {"enabled": True}, "aio": {"thread_count": 2},
                  "zero_optimization": {"stage": 2, "cpu_offload": True}, "tensorboard": {"enabled": False},
                  "checkpoint": {"tag_validation": "Fail"}, "data_types": {"grad_accum_dtype": "fp32"},
                  "comms_logger": {"enabled": False, "prof_ops": ["all_reduce"]}, "pipeline": {"stages": 1},
                  "activation_checkpointing": {"number_checkpoints": 4},
                  "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
                                                                     "warmup_num_steps": 10}}})
    for b in bases:
        Config.load(b)  # each base is valid
    return bases


BASES = _valid_bases()


def _schema_path(path: list[str]) -> str:
    """Map raw keys (maybe aliases) to the schema's dotted path."""
    out, cls_path = [], ""
    for key in path:
        here = f"{cls_path}.{key}" if cls_path else key
        if here not in FIELDS:
            for info_path, info in FIELDS.items():
                if info_path.rsplit(".", 1)[0] == (cls_path or info_path.rsplit(".", 1)[0]) and \
                        key in info.spec.aliases and info_path.count(".") == here.count("."):
                    here = info_path
                    break
        out.append(here.rsplit(".", 1)[-1])
        cls_path = here
    return cls_path


def _positions(raw: dict, prefix: list[str]) -> list[tuple[list[str], bool]]:
    """Every key path in a raw config, and whether its value is a typed section (not a free-form dict)."""
    found = []
    for k, v in raw.items():
        path = prefix + [k]
        info = FIELDS.get(_schema_path(path))
        is_section = isinstance(v, dict) and info is not None and typing.get_origin(_strip_optional(info.hint)[0]) \
            is not dict
        found.append((path, is_section))
        if is_section:
            found.extend(_positions(v, path))
    return found


def _invalid_values(info) -> list:
    core, nullable = _strip_optional(info.hint)
    origin = typing.get_origin(core)
    spec = info.spec
    wrong_everywhere = [[["nested"]]]
    if hasattr(core, "__dataclass_fields__"):
        return [7, "text", [1, 2], *wrong_everywhere]
    if origin is dict:
        return [7, "text", [1, 2]]
    values: list = list(wrong_everywhere) + ([] if nullable else [None])
    if core is bool:
        values += ["yes", 1, 0.0, {"a": 1}]
    elif core in (int, float):
        values += ["not-a-number", True, {"a": 1}, [3]]
        if core is int:
            values.append(2.5)
        if spec.ge is not None:
            values.append(spec.ge - 1)
        if spec.gt is not None:
            values.append(spec.gt)
        if spec.le is not None:
            values.append(spec.le + 1)
        if spec.lt is not None:
            values.append(spec.lt)
    elif core is str:
        values += [5, ["a"], {"a": 1}] + (["definitely-not-a-choice"] if spec.choices else [])
    elif origin is tuple:
        values += ["0.9", [0.9], [0.9, 0.9, 0.9], ["x", 0.9], [-0.5, 0.9]]
    elif origin is list:
        values += [5, "text", [5]]
    return values


def _set(raw: dict, path: list[str], value) -> None:
    node = raw
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


@st.composite
def corrupted(draw):
    base = copy.deepcopy(draw(st.sampled_from(BASES)))
    positions = _positions(base, [])
    kind = draw(st.sampled_from(["unknown_key", "bad_value", "bad_value"]))
    if kind == "unknown_key":
        sections = [[]] + [p for p, is_section in positions if is_section]
        where = draw(st.sampled_from(sections))
        key = "zz_" + draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8))
        node = base
        for k in where:
            node = node[k]
        node[key] = draw(st.sampled_from([1, "x", True, None, {}]))
        return base, ".".join(where + [key])
    path, _ = draw(st.sampled_from([p for p in positions]))
    info = FIELDS[_schema_path(path)]
    value = draw(st.sampled_from(_invalid_values(info)))
    _set(base, path, value)
    return base, ".".join(path)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted())
def test_any_corruption_is_a_config_error_naming_its_key(case):
    raw, path = case
    try:
        Config.load(raw).resolve(world_size=1)
    except ConfigError as e:
        assert path in str(e), f"{path!r} not in {str(e)!r}"
        return
    pytest.fail(f"corrupting {path!r} was accepted: {json.dumps(raw, default=str)[:500]}")
