"""`offload estimate` agrees with the engine's own accounting (part for part; the bar is 10%), and says what fits
here."""

import json

import pytest
import torch
from engine_cases import base_config, describe_engine, make_model

from offload.commands.cli import main
from offload.commands.estimate import Machine, estimate, largest_trainable, model_state_formula, model_units
from offload.config import Config
from offload.machine.launch import run_ranks
from offload.store.tier import Tier


def placement(tmp_path, params, optimizer, host=None, world=1):
    config = base_config(2, 1, world, sub_group_size=3000)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": optimizer, "nvme_path": str(tmp_path / "opt"), "buffer_count": 2}
    zero["offload_param"] = {"device": params}
    if params == "nvme":
        zero["offload_param"].update(nvme_path=str(tmp_path / "par"), max_in_cpu=3000, buffer_count=3)
    if host is not None:
        config["offload"]["budgets"] = {"host": host}
    return config


def _describe(world, config, discrete=False):
    """The engine's own account; ``discrete``: on a device with memory of its own, as a GPU run's plan is."""
    if world == 1 and not discrete:  # in this process: cheaper than spawning a rank; on the CPU, also where a GPU is
        return describe_engine(0, 1, config, device="cpu")
    env = {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"} if discrete else None
    return run_ranks(describe_engine, world, env=env, config=config)[0]


@pytest.mark.parametrize("params,optimizer,host,world", [
    ("none", "none", None, 1), ("none", "cpu", None, 1), ("cpu", "cpu", None, 1), ("none", "nvme", None, 1),
    ("none", "nvme", 60_000, 1), ("nvme", "nvme", None, 1), ("nvme", "cpu", None, 1),
    ("none", "nvme", 30_000, 2), ("nvme", "nvme", None, 2), ("none", "cpu", None, 4)])
def test_the_estimate_matches_the_engines_accounting(tmp_path, world, params, optimizer, host):
    raw = placement(tmp_path, params, optimizer, host, world)
    discrete = world > 1  # as on a GPU (landing buffers, host copies); at W = 1 as on this CPU (read in place)
    if host is not None:  # a budget that splits the optimizer state: what the rest needs, plus some state
        plan = _describe(world, placement(tmp_path, params, optimizer, None, world), discrete)
        raw["offload"]["budgets"]["host"] = plan["memory"]["host"]["total"] - plan["memory"]["host"].get(
            "optimizer state", 0) + host
    measured = _describe(world, raw, discrete)["memory"]
    config = Config.load(raw).resolve(world_size=world)
    est = estimate(model_units(make_model("gpt"), config), config, world, discrete=discrete)
    for tier in ("host", "nvme"):  # the same planning functions: part for part, byte for byte (10% is the bar)
        parts = {k: v for k, v in measured[tier].items() if k not in ("total", "peak", "budget")}
        assert est.tiers[tier] == parts, f"{tier}: estimate {est.tiers[tier]} vs engine {measured[tier]}"
        assert est.total(tier) == measured[tier]["total"]
    assert est.tiers["device"].get("shards", 0) == measured["device"]["shards"]
    if optimizer == "none":
        assert est.tiers["device"]["optimizer state"] == measured["device"]["optimizer state"]
    if host is not None:
        assert "optimizer state" in est.tiers["host"] and est.tiers["nvme"], "the budget splits host and NVMe"


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_each_stage_holds_what_the_zero_formula_says(stage, world, accum):
    """Model states per rank: 16N, 4N + 12N/W, 2N + 14N/W, 16N/W (bf16 Adam), plus what offload keeps in another
    form: with gradient accumulation fp32 gradient accumulators where the formula counts 16-bit gradients; with one
    micro-batch the 16-bit gradients themselves (see [Note: a device gradient kept as it landed]), so stages 2-3 hold
    the formula's bytes. The estimate names the same parts with the same bytes."""
    raw = {**base_config(2, accum, world, stage=stage, offload_optimizer={"device": "none"}),
           "bf16": {"enabled": True}}
    measured = run_ranks(describe_engine, world, config=raw)[0]["memory"]["device"]
    config = Config.load(raw).resolve(world_size=world)
    est = estimate(model_units(make_model("gpt"), config), config, world)
    n, parts = est.params, world if stage else 1
    grad = 4 if accum > 1 else 2  # an fp32 accumulator, or the one 16-bit gradient kept
    extra = grad * n // parts if stage < 2 else (grad - 2) * n // world  # stages 0-1 keep the whole .grad too
    ours = {k: v for k, v in measured.items() if not k.startswith("gathered")}
    padding = 4096 + 20 * world * est.units  # sub-groups round to 4 KiB; units pad to a multiple of W
    assert 0 <= sum(ours.values()) - model_state_formula(stage, n, world) - extra < padding, ours
    assert sum(ours.values()) == est.model_states
    assert {k: v for k, v in est.tiers["device"].items() if not k.startswith("gathered")} == ours


def test_larger_offload_choices_train_larger_models_and_the_limit_is_named(tmp_path):
    machine = Machine(device_bytes=16 << 30, host_bytes=64 << 30, nvme_bytes=2 << 40, nvme_path=str(tmp_path))
    largest = largest_trainable({"bf16": {"enabled": True}}, machine)
    sizes = [n for n, _ in largest.values()]
    assert sizes == sorted(sizes), largest  # each choice moves more off the scarcer tiers
    assert largest["no offload"][1] == "device"
    assert largest["params + optimizer on cpu"][1] == "host"
    # 64 GiB of RAM at ~16 bytes per parameter (fp32 master, moments and gradients; bf16 copies): about 4B
    assert 3.0e9 < largest["params + optimizer on cpu"][0] < 4.6e9
    assert largest["params + optimizer on nvme"][0] > largest["params + optimizer on cpu"][0]
    muon = largest_trainable({"bf16": {"enabled": True}, "optimizer": {"type": "Muon"}}, machine)
    assert list(muon) == ["no offload", "optimizer on cpu", "params + optimizer on cpu"]  # its state is never on NVMe


def test_cli_prints_tiers_and_the_largest_models_and_writes_json(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    assert main(["estimate", "--model", "gpt2-tiny", "--world", "2", "--nvme-path", str(tmp_path),
                 "--offload-optimizer", "nvme", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "optimizer state (two slots per sub-group)" in text and "largest model per choice" in text
    if not torch.cuda.is_available():  # which machine the parts are for, and which the table is
        assert text.startswith("(this machine has no GPU: the parts below are a GPU machine's, with the h100 ")
    report = json.loads(out.read_text())
    assert report["estimate"]["world"] == 2 and report["estimate"]["tiers"]["nvme"]
    assert set(report["largest"]) >= {"no offload", "params + optimizer on nvme"}
    assert "per rank by ZeRO stage" in text and set(report["stages"]) == {"0", "1", "2", "3"}
    stage0, stage3 = report["stages"]["0"], report["stages"]["3"]
    assert stage0["model_states"] > stage3["model_states"]
    assert stage0["zero_formula"] == 2 * stage3["zero_formula"]  # 16N against 16N/W, W=2
    assert main(["estimate", "--params", "2e9", "--offload-optimizer", "cpu"]) == 0
    assert "2.00B parameters" in capsys.readouterr().out
    assert main(["estimate", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt2-tiny", "--micro", "2", "--checkpointing", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "activation checkpoints" in text and "checkpointed blocks (block inputs in host memory)" in text


def test_the_estimate_prices_each_tiers_share_of_the_step(tmp_path, capsys):
    """#22: the split and what each tier's Adam costs a step: bytes over the tier's bandwidth (a machine preset's,
    or the ones given); an NVMe tier costs the longer of its disk and host-memory time; without the disk's rate,
    bytes only."""
    out = tmp_path / "estimate.json"
    config = tmp_path / "split.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "offload": {"stream_state": 0}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    assert main(["estimate", "--params", "1e9", "--config", str(config), "--host-gbps", "100", "--json",
                 str(out)]) == 0
    traffic = next(line for line in capsys.readouterr().out.splitlines() if "optimizer step traffic" in line)
    ms = json.loads(out.read_text())["estimate"]["step_ms"]
    assert set(ms) == {"device", "host"}
    # 30 bytes an element (Adam's 28 and the 16-bit copy written back), half the elements on each side.
    assert ms["host"] == pytest.approx(0.5e9 * 30 / 100e9 * 1e3, rel=0.02)
    assert ms["device"] == pytest.approx(0.5e9 * 30 / 2500e9 * 1e3, rel=0.02)  # the h100 preset's HBM
    assert "device 2500 GB/s from the h100 preset, host 100 GB/s as given" in traffic
    assert f"the host's {ms['host']:,.0f} ms is the step's" in traffic
    assert main(["estimate", "--params", "1e9", "--offload-optimizer", "nvme", "--nvme-path", str(tmp_path),
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["estimate"]["step_ms"] == {}  # the disk's rate unknown: bytes only
    assert main(["estimate", "--params", "1e9", "--offload-optimizer", "nvme", "--nvme-path", str(tmp_path),
                 "--host-gbps", "100", "--nvme-gbps", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["estimate"]["step_ms"]["nvme"] == pytest.approx(1e9 * 24 / 2e9 * 1e3,
                                                                                        rel=0.02)  # the disk's
    with pytest.raises(SystemExit) as refused:
        main(["estimate", "--params", "1e9", "--host-gbps", "-1"])
    assert refused.value.code == 2 and "'-1' is not a finite number > 0" in capsys.readouterr().err


def test_nvme_placement_is_said_and_the_nvme_budget_checked(tmp_path, caplog):
    """max_in_cpu holding every parameter shard in host memory is said with the numbers, by the estimate and by
    initialize; a plan over offload.budgets.nvme is named, as initialize refuses it."""
    import logging

    import offload
    raw = placement(tmp_path, "nvme", "nvme")
    raw["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**9
    config = Config.load(raw).resolve(world_size=1)
    units = model_units(make_model("gpt"), config)
    est = estimate(units, config, 1)
    assert any("max_in_cpu (1,000,000,000 elements) holds every parameter shard" in n for n in est.notes)
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        offload.initialize(model=make_model("gpt"), config=raw)[0].close()
    assert any("nothing goes to NVMe" in r.getMessage() for r in caplog.records)

    raw = placement(tmp_path, "nvme", "nvme")  # max_in_cpu 3000: the rest on NVMe
    est = estimate(units, Config.load(raw).resolve(world_size=1), 1)
    assert any("elements) on NVMe" in n for n in est.notes)
    raw["offload"]["budgets"] = {"nvme": est.total("nvme") - 1}
    est = estimate(units, Config.load(raw).resolve(world_size=1), 1)
    assert any(n.startswith("over offload.budgets.nvme") for n in est.notes)
    with pytest.raises(offload.ConfigError, match="offload.budgets.nvme: .* bytes cannot hold"):
        offload.initialize(model=make_model("gpt"), config=raw)


def test_optimizer_state_on_nvme_in_one_large_sub_group_is_said_with_the_size_that_pipelines(tmp_path, caplog,
                                                                                              monkeypatch):
    """DeepSpeed's default sub_group_size (1e9) puts a model's whole NVMe state in one sub-group: nothing of its step
    pipelines. The estimate and initialize say so, with a size that would; several sub-groups draw no such note."""
    import logging

    import offload
    from offload.store import sub_groups
    monkeypatch.setattr(sub_groups, "PIPELINE_WORTH", 1000)  # the test model's state counts as large
    raw = placement(tmp_path, "none", "nvme")
    raw["zero_optimization"]["sub_group_size"] = 10**9
    units = model_units(make_model("gpt"), Config.load(raw).resolve(world_size=1))
    notes = estimate(units, Config.load(raw).resolve(world_size=1), 1).notes
    said = [n for n in notes if "is one sub-group of" in n]
    assert len(said) == 1 and "(sub_group_size 1,000,000,000)" in said[0]
    suggested = int(said[0].split("zero_optimization.sub_group_size ")[1].split(" ")[0].replace(",", ""))
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        offload.initialize(model=make_model("gpt"), config=raw)[0].close()
    assert sum("is one sub-group of" in r.getMessage() for r in caplog.records) == 1

    raw["zero_optimization"]["sub_group_size"] = suggested  # the suggestion: several sub-groups, no note
    caplog.clear()
    notes = estimate(units, Config.load(raw).resolve(world_size=1), 1).notes
    assert not any("is one sub-group of" in n for n in notes)
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        engine = offload.initialize(model=make_model("gpt"), config=raw)[0]
    assert len([g for g in engine.optimizer.store.groups if g.tier is Tier.NVME]) > 1
    engine.close()
    assert not any("is one sub-group of" in r.getMessage() for r in caplog.records)


def test_with_gradient_accumulation_on_a_gpu_the_estimate_puts_the_sums_on_the_device_as_the_engine_does():
    raw = base_config(2, 2, 2, offload_param={"device": "cpu"})
    raw["offload"]["speculative_step"] = "off"  # 'auto' is off on a GPU, on for the CPU's emulated one
    measured = _describe(2, raw, discrete=True)["memory"]
    config = Config.load(raw).resolve(world_size=2)
    est = estimate(model_units(make_model("gpt"), config), config, 2, discrete=True)
    assert est.tiers["device"]["gradient accumulators"] == measured["device"]["gradient accumulators"] > 0
    parts = {k: v for k, v in measured["host"].items() if k not in ("total", "peak", "budget")}
    assert est.tiers["host"] == parts and "gradient accumulators" not in parts  # fp32 landing buffers instead
    assert parts["gradient landing"] == measured["device"]["gradient accumulators"]


def test_one_ranks_device_homes_on_a_gpu_need_no_gather_room():
    """[Note: reading the home]: at W = 1 on a GPU a device-homed unit is never gathered, so the plan reserves no
    gather room for it (the estimate shows none, and a device budget of the shards alone is enough); host homes
    and two ranks still gather."""
    model = make_model("gpt")
    for world, params, gathers in ((1, "none", False), (1, "cpu", True), (2, "none", True)):
        config = Config.load(base_config(2, 1, world, offload_param={"device": params})).resolve(world_size=world)
        est = estimate(model_units(model, config), config, world)
        assert ("gathered (at most)" in est.tiers["device"]) == gathers, (world, params)
    config = Config.load(base_config(2, 1, 1)).resolve(world_size=1)
    shards = estimate(model_units(model, config), config, 1).tiers["device"]["shards"]
    tight = base_config(2, 1, 1)
    tight["offload"]["budgets"] = {"device": shards}
    config = Config.load(tight).resolve(world_size=1)
    assert not any(n.startswith("over offload.budgets.device") for n in estimate(model_units(model, config), config,
                                                                                  1).notes)


def test_the_split_note_names_ratio_auto_as_the_config_says_it(tmp_path, capsys):
    """The note once printed the sentinel's repr ("ratio AUTO"), a value no config file can hold."""
    config = tmp_path / "auto.json"
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": zero,
                                  "offload": {"budgets": {"device": "4Gi"}, "stream_state": 0}}))
    assert main(["estimate", "--params", "1e9", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "offload_optimizer.ratio auto: the optimizer state of" in out and "AUTO" not in out


@pytest.mark.parametrize("ratio", [1.0, "auto"])
def test_the_estimate_predicts_the_step_term_by_term_and_as_the_max_of_its_terms(ratio):
    """#44: compute (6 FLOPs a parameter a token), each tier's Adam, the parameters brought up for the forward's and
    the backward's gathers (and once, the new shard of a device home stepped on the host) and the host-stepped
    gradients sent down, at the rates given; a step that overlaps is its longest lane (the GPU's compute and device
    Adam together, each other term alone), one whose stages run one after another their sum. auto under a device
    budget moves both the state and the parameters of the first units to the device: less host Adam, fewer bytes
    over PCIe."""
    from offload.commands.estimate import ActivationShape, StepRates
    raw = base_config(4, 1, 1)
    raw["bf16"] = {"enabled": True}
    raw["zero_optimization"].update(offload_param={"device": "cpu"},
                                    offload_optimizer={"device": "cpu", "ratio": ratio})
    raw["offload"]["budgets"] = {"device": 600_000}  # about half the state
    raw["offload"]["stream_state"] = 0  # two lanes: the three are priced below
    config = Config.load(raw).resolve(world_size=1)
    units = model_units(make_model("gpt"), config)
    rates = StepRates(device_gbps=2000.0, host_gbps=100.0, device_tflops=100.0, h2d_gbps=50.0, d2h_gbps=40.0)
    est = estimate(units, config, 1, ActivationShape(2, 32, 4, 16, 4, 64), rates=rates)
    terms, params = est.prediction.terms, est.params
    assert terms["compute"] == pytest.approx(6 * params * 16 * 4 / 100e12 * 1e3)
    assert terms["host Adam"] == pytest.approx(est.step_ms["host"])
    if ratio == 1.0:
        assert terms["device Adam"] == 0.0
        assert terms["parameters up"] == pytest.approx(2 * 2 * params / 50e9 * 1e3)
        assert terms["gradients down"] == pytest.approx(2 * params / 40e9 * 1e3)
    else:
        on_host = sum(n for n in units) - est.tiers["device"]["shards"] // 2
        assert 0 < on_host < params and terms["device Adam"] == pytest.approx(est.step_ms["device"])
        assert terms["device Adam"] > 0
        # the gradients of the units stepped on the host: fewer than those of the units homed there (auto homes
        # more shards on the device than it keeps state for, with the room its state left)
        traffic = next(n for n in est.notes if n.startswith("optimizer step traffic"))
        stepped_on_host = int(traffic.split("host: ")[1].split(" elements")[0].replace(",", ""))
        assert terms["gradients down"] == pytest.approx(2 * stepped_on_host / 40e9 * 1e3)
        assert on_host < stepped_on_host
        # gathered in forward and backward, and the new shard of each unit homed on the device but stepped on
        # the host copied up once
        assert terms["parameters up"] == pytest.approx(2 * (2 * on_host + stepped_on_host - on_host) / 50e9 * 1e3)
    gpu = terms["compute"] + terms["device Adam"]
    assert est.prediction.overlapped_ms == pytest.approx(max(gpu, *(v for k, v in terms.items()
                                                                  if k not in ("compute", "device Adam"))))
    assert est.prediction.serial_ms == pytest.approx(sum(terms.values()))
    note = next(n for n in est.notes if n.startswith("the step predicted"))
    assert f"overlapped {est.prediction.overlapped_ms:,.0f} ms" in note


def test_without_the_models_shape_the_compute_term_is_unknown_and_no_step_is_predicted():
    from offload.commands.estimate import StepRates
    raw = base_config(4, 1, 1)
    raw["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config = Config.load(raw).resolve(world_size=1)
    est = estimate(model_units(make_model("gpt"), config), config, 1,
                   rates=StepRates(device_gbps=2000.0, host_gbps=100.0, device_tflops=100.0, h2d_gbps=50.0,
                                   d2h_gbps=40.0))
    assert est.prediction.terms["compute"] is None and est.prediction.overlapped_ms is None
    assert any(n.startswith("the step's terms: compute ?") for n in est.notes)


def test_a_blocks_activations_count_the_attention_scores_only_where_attention_keeps_them():
    """Korthikanti et al.'s s*b*h*(34 + 5*a*s/h): the second term is the attention's scores, softmax and mask, which
    SDPA's fused kernels (the default of the built-in GPT and of Hugging Face's models) never keep."""
    from offload.commands.estimate import ActivationShape
    s, b, h, a = 1024, 4, 512, 8
    fused = ActivationShape(layers=2, hidden=h, heads=a, seq=s, micro=b, vocab=100)
    eager = ActivationShape(layers=2, hidden=h, heads=a, seq=s, micro=b, vocab=100, scores_kept=True)
    assert fused.per_layer(2) == 34 * s * b * h
    assert eager.per_layer(2) - fused.per_layer(2) == 5 * a * s * s * b
    assert fused.per_layer(4) == 2 * fused.per_layer(2)


def test_nvme_state_buffers_under_the_default_sub_group_size_do_not_grow_with_the_model(tmp_path):
    """sub_group_size auto (the default) with the state on NVMe cuts a sub-group per unit ([Note: the sub-group's
    default size] in offload/store/sub_groups.py): the step's host buffers are buffer_count units' state at 1B
    parameters as at 8B, where DeepSpeed's 1e9 (set in the config, it still acts) makes them four times 1e9
    elements' state. With the state on the host, auto is DeepSpeed's 1e9."""
    from offload.commands.estimate import choice_config, synthetic_units
    base = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    raw = choice_config(base, {"offload_param": "nvme", "offload_optimizer": "nvme"}, str(tmp_path))
    config = Config.load(raw).resolve(world_size=1)
    buffers = {n: estimate(synthetic_units(n, config), config, 1, discrete=True, device_free=0).tiers["host"]
               ["optimizer NVMe buffers"] for n in (10**9, 8 * 10**9)}
    # four units' fp32 state (the largest unit's size moves a little with the model's cut)
    assert max(buffers.values()) < 4 * 12 * 40_000_000
    assert abs(buffers[10**9] - buffers[8 * 10**9]) < 0.01 * buffers[10**9]
    raw["zero_optimization"]["sub_group_size"] = 10**9
    config = Config.load(raw).resolve(world_size=1)
    big = estimate(synthetic_units(8 * 10**9, config), config, 1, discrete=True, device_free=0)
    assert big.tiers["host"]["optimizer NVMe buffers"] >= 4 * 12 * 9 * 10**8  # whole units up to 1e9 elements
    on_host = Config.load(choice_config(base, {"offload_param": "cpu", "offload_optimizer": "cpu"}, str(tmp_path)))
    from offload.store.sub_groups import sub_group_elements
    assert sub_group_elements(on_host.resolve(world_size=1).zero_optimization) == 10**9
