"""Configs as users write them load, with DeepSpeed's meaning and defaults."""

import dataclasses
import json
import logging

import pytest
from conftest import REPO

from offload.config import AUTO, Config, ConfigError, load_config
from offload.store.sub_groups import sub_group_elements

SHIPPED = sorted((REPO / "configs").glob("*.json")) + [REPO / "offload" / "defaults" / "demo.json"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_resolves(path):
    cfg = Config.load(path)
    assert cfg.notes == ()  # shipped configs use no deprecated or ignored keys
    resolved = cfg.resolve(world_size=2, hidden_size=768)
    assert resolved.auto_paths() == []
    assert resolved.train_batch_size == (resolved.train_micro_batch_size_per_gpu
                                         * resolved.gradient_accumulation_steps * 2)


def test_shipped_configs_mean_what_their_names_say():
    cpu = Config.load(REPO / "configs/zero3_cpu_offload.json").zero_optimization
    assert (cpu.stage, cpu.offload_param.device, cpu.offload_optimizer.device) == (3, "cpu", "cpu")
    nvme = Config.load(REPO / "configs/zero3_nvme_offload.json")
    zero = nvme.zero_optimization
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("nvme", "nvme")
    assert nvme.aio.block_size == 8 * 2**20 and nvme.offload.budgets.host == 16 * 2**30
    assert Config.load(REPO / "configs/zero3_bf16.json").bf16.enabled is True
    fp16 = Config.load(REPO / "configs/zero3_fp16.json").fp16
    assert fp16.enabled is True and fp16.loss_scale == 0


def test_three_ways_to_give_a_config_agree(tmp_path):
    raw = json.loads((REPO / "configs/zero3_fp16.json").read_text())
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    by_dict, by_path, by_text = Config.load(raw), Config.load(path), Config.load(json.dumps(raw))
    assert by_dict == by_path == by_text == load_config(str(path))
    assert Config.load(by_dict) is by_dict


def test_defaults_are_deepspeeds():
    cfg = Config.load({})
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000 and zero.sub_group_size is AUTO
    assert sub_group_elements(zero) == 10**9  # DeepSpeed's, where the state is not on NVMe
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 10**9 and zero.stage3_max_reuse_distance == 10**9
    assert zero.offload_param.buffer_count == 5 and zero.offload_optimizer.buffer_count == 4
    assert cfg.aio.intra_op_parallelism == 1
    # aio block size and depth are offload's measured defaults, not DeepSpeed's 1 MiB / 8.
    assert cfg.aio.block_size == 8 << 20 and cfg.aio.queue_depth == 16
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2
    assert cfg.steps_per_print is None  # DeepSpeed 0.19.8: no progress reports unless asked
    assert Config.load({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm_effective is True
    assert Config.load({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm_effective is False


# DeepSpeed 0.19.8's defaults of the keys a config most often leaves out, where they decide the training (the
# constant each comes from in deepspeed/runtime/constants.py): compared with DeepSpeed's own constants where it is
# installed (./dev.sh deepspeed), with this table where it is not.
DEEPSPEED_DEFAULTS = {"gradient_clipping": (1.0, "GRADIENT_CLIPPING_DEFAULT"),
                      "steps_per_print": (None, "STEPS_PER_PRINT_DEFAULT"),
                      "prescale_gradients": (False, "PRESCALE_GRADIENTS_DEFAULT"),
                      "gradient_predivide_factor": (1.0, "GRADIENT_PREDIVIDE_FACTOR_DEFAULT"),
                      "wall_clock_breakdown": (False, "WALL_CLOCK_BREAKDOWN_DEFAULT")}
# Without DeepSpeed: its ZeRO models' defaults that differ from what one might guess (the test below reads them all).
DEEPSPEED_ZERO_DEFAULTS = {("offload_optimizer", "pin_memory"): True, ("offload_param", "pin_memory"): True}


@pytest.mark.parametrize("key", list(DEEPSPEED_DEFAULTS))
def test_a_config_that_leaves_a_key_out_trains_as_deepspeed_would(key):
    """A config without gradient_clipping clips at 1.0, as DeepSpeed 0.19.8 does (#45: one that did not clip drifted
    2% from DeepSpeed's losses in five steps)."""
    value, constant = DEEPSPEED_DEFAULTS[key]
    try:
        from deepspeed.runtime import constants
    except ImportError:
        constants = None
    if constants is not None:
        assert getattr(constants, constant) == value, f"DeepSpeed's {constant} is {getattr(constants, constant)}"
    assert getattr(Config.load({}), key) == value


@pytest.mark.parametrize("section,key", list(DEEPSPEED_ZERO_DEFAULTS))
def test_offload_sections_default_as_deepspeeds(section, key):
    assert getattr(getattr(Config.load({}).zero_optimization, section), key) == DEEPSPEED_ZERO_DEFAULTS[section, key]


# Defaults that differ from DeepSpeed 0.19.8's on purpose, each said in the key's help (offload/config/sections.py)
ON_PURPOSE = {"cpuadam_cores_perc": "null: offload.cpu_threads decides the host step's threads",
              "parameter_alignment": "refused: null is the key left out"}


def test_zero_section_defaults_equal_deepspeeds_where_it_is_installed():
    """Every key of DeepSpeed 0.19.8's ZeRO, offload_optimizer and offload_param models that offload's schema has too
    defaults to the same value (its pydantic models hold the defaults)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    zero = Config.load({}).zero_optimization
    compared, differ = 0, []
    for ours, theirs, where in ((zero, DeepSpeedZeroConfig, "zero_optimization"),
                                (zero.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig, "offload_optimizer"),
                                (zero.offload_param, DeepSpeedZeroOffloadParamConfig, "offload_param")):
        for name, field in theirs.model_fields.items():
            key = next((k for k in (name, field.alias) if k and hasattr(ours, k)), None)
            value = getattr(field.default, "value", field.default)
            if key is None or hasattr(value, "model_fields") or dataclasses.is_dataclass(getattr(ours, key)):
                continue
            if key in ON_PURPOSE:
                continue
            compared += 1
            # sub_group_size's default is auto: DeepSpeed's 1e9 except with the state on NVMe (not here)
            mine = sub_group_elements(zero) if key == "sub_group_size" else getattr(ours, key)
            if mine != value:
                differ.append(f"{where}.{key}: offload {mine!r}, DeepSpeed {value!r}")
    assert compared > 20 and not differ, differ


def test_numbers_as_real_configs_write_them():
    cfg = Config.load({
        "train_batch_size": "32", "gradient_accumulation_steps": 2.0,
        "zero_optimization": {"stage": "3", "reduce_bucket_size": 5e8, "sub_group_size": "1e9",
                              "stage3_prefetch_bucket_size": "5e7", "stage3_max_live_parameters": 1_000_000_000.0},
        "optimizer": {"type": "adam", "params": {"lr": "3e-4", "betas": ["0.9", 0.95], "eps": 1e-8,
                                                 "weight_decay": 0}},
        "offload": {"budgets": {"host": "24GiB", "nvme": "1.5TB", "device": 1024}, "unit_bytes": "32MiB"},
    })
    assert cfg.train_batch_size == 32 and isinstance(cfg.train_batch_size, int)
    assert cfg.gradient_accumulation_steps == 2 and isinstance(cfg.gradient_accumulation_steps, int)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.sub_group_size) == (3, 500_000_000, 10**9)
    assert isinstance(zero.stage3_max_live_parameters, int)
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params.lr == 3e-4
    assert cfg.optimizer.params.betas == (0.9, 0.95)
    assert cfg.offload.budgets.host == 24 * 2**30 and cfg.offload.budgets.nvme == 1_500_000_000_000
    assert cfg.offload.unit_bytes == 32 * 2**20
    # The command line's spelling (--device-budget 12Gi) means the same in a config file.
    assert Config.load({"offload": {"budgets": {"device": "12Gi"}, "unit_bytes": "64Mi"}}).offload.budgets.device \
        == 12 * 2**30


HF_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hugging_face_auto_config_resolves_like_the_trainer_would():
    cfg = Config.load(HF_STYLE)
    assert cfg.optimizer.params.lr is AUTO and cfg.zero_optimization.reduce_bucket_size is AUTO
    assert len(cfg.auto_paths()) == 17
    resolved = cfg.resolve(world_size=4, hidden_size=1024, values={
        "optimizer.params.lr": 2e-5, "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_max_lr": 2e-5, "scheduler.params.warmup_num_steps": 50,
        "scheduler.params.total_num_steps": 1000, "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "bf16.enabled": True})
    assert resolved.auto_paths() == []
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
            resolved.gradient_accumulation_steps) == (64, 8, 2)
    zero = resolved.zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert zero.stage3_param_persistence_threshold == 10 * 1024
    assert resolved.bf16.enabled is True and resolved.fp16.enabled is False
    assert resolved.optimizer.params.lr == 2e-5 and resolved.optimizer.params.betas == (0.9, 0.999)
    assert resolved.scheduler.params.total_num_steps == 1000
    assert resolved.gradient_clipping == 1.0
    assert any("fp16.enabled is auto" in n for n in resolved.notes)


def test_resolve_without_hidden_size_uses_documented_defaults():
    resolved = Config.load(HF_STYLE).resolve(1, values={"scheduler.params.total_num_steps": 5000})
    assert resolved.zero_optimization.reduce_bucket_size == 500_000_000
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu) == (1, 1)


def test_resolve_checks_values_it_is_given():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr: must be >= 0"):
        Config.load(HF_STYLE).resolve(1, values={"optimizer.params.lr": -1, "scheduler.params.total_num_steps": 9})
    with pytest.raises(ConfigError, match="optimizer.params.learning_rate: is not a config key"):
        Config.load(HF_STYLE).resolve(1, values={"optimizer.params.learning_rate": 1})
    with pytest.raises(ConfigError, match="world size must be a positive whole number"):
        Config.load({}).resolve(0)


@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
])
def test_deepspeed_batch_rule_derives_the_missing_size(given, world, expected):
    r = Config.load(given).resolve(world)
    assert (r.train_batch_size, r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("given, world, message", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     r"32 != 4 x 2 x 2 = 16"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 1, "not divisible by micro batch 4"),
    ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 1, "not divisible by accumulation steps 4"),
    ({"train_batch_size": 33}, 2, "not divisible by world size 2"),
    ({"gradient_accumulation_steps": 4}, 1, "alone does not fix the batch"),
])
def test_contradictory_batch_sizes_are_errors(given, world, message):
    with pytest.raises(ConfigError, match=message) as err:
        Config.load(given).resolve(world)
    assert err.value.path == "train_batch_size"


def test_batch_contradiction_independent_of_world_fails_at_load():
    with pytest.raises(ConfigError, match="train_batch_size: 30 is not train_micro_batch_size_per_gpu"):
        Config.load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})


def test_deprecated_aliases_are_read_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = Config.load({
            "bfloat16": {"enabled": True},
            "aio": {"thread_count": 4},
            "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                                  "cpu_offload_use_pin_memory": True,
                                  "stage3_gather_fp16_weights_on_model_save": True,
                                  "prefetch_bucket_size": 1000, "param_persistence_threshold": 10,
                                  "max_live_parameters": 99, "max_reuse_distance": 7},
        })
    zero = cfg.zero_optimization
    assert cfg.bf16.enabled and cfg.aio.intra_op_parallelism == 4
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory and zero.offload_param.pin_memory
    assert zero.stage3_gather_16bit_weights_on_model_save
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance) == (1000, 10, 99, 7)
    assert any("aio.thread_count is an older name of 'intra_op_parallelism'" in n for n in cfg.notes)
    assert any("cpu_offload is deprecated" in n for n in cfg.notes)
    assert "aio.thread_count" in caplog.text


def test_a_key_and_its_alias_together_is_an_error():
    with pytest.raises(ConfigError, match="aio.thread_count: given twice"):
        Config.load({"aio": {"intra_op_parallelism": 2, "thread_count": 4}})


def test_keys_without_effect_are_reported_not_silently_dropped():
    cfg = Config.load({"tensorboard": {"enabled": True, "output_path": "/tmp/tb"}, "wall_clock_breakdown": True,
                       "aio": {"use_gds": True}, "pipeline": {"stages": 2}})
    assert [n.path for n in cfg.no_effect] == ["aio.use_gds", "tensorboard", "pipeline"]  # wall_clock_breakdown acts
    for note in cfg.no_effect:
        assert note.startswith(f"{note.path} has no effect in offload: ")
    # Writing such a key at its default (or a disabled section) changes nothing, so says nothing.
    assert Config.load({"tensorboard": {"enabled": False}, "aio": {"use_gds": False}}).notes == ()


def test_nvme_path_that_does_not_exist_yet_is_fine_if_it_can_be_created(tmp_path):
    cfg = Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "swap" / "rank0")}}})
    assert cfg.zero_optimization.offload_optimizer.nvme_path.endswith("rank0")
    assert not (tmp_path / "swap").exists()  # loading a config creates nothing


def test_round_trip_through_to_dict():
    for raw in [HF_STYLE] + [json.loads(p.read_text()) for p in SHIPPED]:
        cfg = Config.load(raw)
        assert Config.load(cfg.to_dict()) == cfg
        assert Config.load(cfg.to_json()) == cfg


@pytest.mark.parametrize("name,says", [("Lamb", "trust ratio.*use Lion or AdamW"),
                                       ("onebitadam", "1 bit.*type \"Adam\" takes the same params"),
                                       ("OneBitLamb", "1 bit.*trust ratio"), ("ZeroOneAdam", "0/1 Adam"),
                                       ("MuAdamW", "mup.MuAdamW.*initialize\\(optimizer=...\\).*torch.optim.AdamW")])
def test_deepspeeds_other_optimizer_types_are_refused_with_what_to_use(name, says):
    """DeepSpeed's LAMB, 1-bit and mup types: each named, with why and what instead, not a bare list of choices."""
    with pytest.raises(ConfigError, match=f"optimizer.type: '{name}': .*{says}"):
        Config.load({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    with pytest.raises(ConfigError, match="'Lamb2' is not one of 'Adam'"):
        Config.load({"optimizer": {"type": "Lamb2"}})


def test_dotted_top_level_keys_are_the_nested_keys_they_name():
    """TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" and friends at the top level (DeepSpeed
    itself ignores them silently); here they act, and a fractional element count is read down to a whole one."""
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "zero_optimization.stage3_param_persistence_threshold": 320,
           "zero_optimization.stage3_prefetch_bucket_size": 921.6}
    config = Config.load(raw)
    assert config.zero_optimization.stage == 3
    assert config.zero_optimization.stage3_param_persistence_threshold == 320
    assert config.zero_optimization.stage3_prefetch_bucket_size == 921
    assert any("dotted keys read as nested ones" in str(n) for n in config.notes)
    assert config.get("zero_optimization")["stage"] == 3 and config.get("no_such_section", {}) == {}
    with pytest.raises(ConfigError, match="not a section"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "gradient_clipping.x": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization.no_such_key": 1})


# DeepSpeed 0.19.8's zero_optimization keys (runtime/zero/config.py), each by the name and alias it takes
DEEPSPEED_ZERO_KEYS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module", "compute_grad_norm", "parameter_alignment")
DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                    "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
DEEPSPEED_OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")


def test_every_key_of_deepspeed_0_19_8s_zero_section_is_known():
    from offload.config.fields import _field_names
    from offload.config.sections import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
    legacy = {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}  # rewritten before parsing
    for keys, section in ((DEEPSPEED_ZERO_KEYS, ZeroConfig), (DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS, OffloadOptimizerConfig),
                          (DEEPSPEED_OFFLOAD_PARAM_KEYS, OffloadParamConfig)):
        unknown = [k for k in keys if k not in _field_names(section) and k not in legacy]
        assert unknown == [], f"{section.__name__} lacks {unknown}"


@pytest.mark.parametrize("key, value, says", [
    ("zenflow", {"topk_ratio": 0.1, "update_interval": 4}, "offload.delayed_update"),
    ("parameter_alignment", 16, "end to end"),
    ("zeropp_loco_param", {"err_beta": 0.8}, "ZeRO++"),
])
def test_deepspeed_zero_keys_that_would_change_training_are_refused_by_name(key, value, says):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}.*{says}"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: value}})


@pytest.mark.parametrize("key, value", [
    ("stage3_allgather_sequential", True), ("allgather_sequential", True), ("use_all_reduce_for_fetch_params", True),
    ("enable_sanity_checks", True), ("save_muon_momentum_buffer_in_memory", True),
    ("module_granularity_threshold", 4096),
])
def test_deepspeed_zero_keys_without_effect_here_are_named(key, value):
    config = Config.load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: value}})
    assert [str(n) for n in config.no_effect if "zero_optimization." in str(n)], config.notes


def test_super_offload_has_no_effect_and_cpuadam_cores_perc_is_the_host_steps_threads():
    from offload.machine.cpus import host_threads
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    cfg = Config.load({**base, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.5}}})
    assert any("super_offload" in str(n) for n in cfg.no_effect)
    assert (host_threads(cfg, 16), host_threads(cfg, 3), host_threads(cfg, 1)) == (8, 1, 1)
    assert host_threads(Config.load(base), 16) is None  # the kernels' default: every core
    assert host_threads(Config.load({**base, "offload": {"cpu_threads": 3}}), 16) == 3
    with pytest.raises(ConfigError, match="cpuadam_cores_perc.*keep one"):
        Config.load({**base, "offload": {"cpu_threads": 3}, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}}})
    with pytest.raises(ConfigError, match="cpuadam_cores_perc"):
        Config.load({**base, "zero_optimization": {"stage": 3, "offload_optimizer": {"cpuadam_cores_perc": 1.5}}})


def test_compute_grad_norm_false_is_refused_beside_clipping():
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="compute_grad_norm.*gradient_clipping 1 needs the norm"):
        Config.load({**base, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    config = Config.load({**base, "gradient_clipping": 0,
                          "zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    assert config.zero_optimization.compute_grad_norm is False
