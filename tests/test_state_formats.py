"""The optimizer state in fewer bytes through the engine (offload/store/state_format.py): each format trains as a
plain PyTorch loop whose optimizer steps the same format, at every tier, W = 1 and 2; the host holds the bytes the
format says; checkpoints hold the state as it is held, resume bitwise and load into another format with a note;
the config's keys, DeepSpeed's among them, choose it and refuse what cannot work."""

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.config import Config, ConfigError
from offload.files.export import export_weights, load_exported
from offload.machine.launch import run_ranks
from offload.machine.native import Stochastic
from offload.optim import AdamHyper, adam_step
from offload.store.state_format import FORMATS, Master, StateFormat, from_config, join_master, split_master

STEPS, MICRO = 4, 2
HYPER = AdamHyper(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def fmt_config(world: int, master: str = "fp32", moments: str = "fp32", device: str = "cpu", path: Path | None = None,
               bf16: bool = False, clip: float = 0.0, **zero: Any) -> dict[str, Any]:
    opt: dict[str, Any] = {"device": device}
    if device == "nvme":
        opt.update(nvme_path=str(path), buffer_count=2)
    config = base_config(MICRO, 1, world, clip=clip, offload_optimizer=opt, sub_group_size=3000, **zero)
    config["offload"]["optimizer_state"] = {"master": master, "moments": moments}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def train(rank: int, world: int, config: dict[str, Any], steps: int = STEPS, save: str | None = None,
          load: str | None = None) -> dict[str, Any]:
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for tokens in batches(steps + engine.global_steps, MICRO * world)[engine.global_steps:]:
        rows = tokens[rank * MICRO:(rank + 1) * MICRO]
        losses.append(engine.backward(loss_of(engine, "gpt", rows)).item())
        engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    out = {"losses": losses, "state": engine.full_state_dict(), "memory": engine.memory_summary(),
           "tiers": dict(engine.optimizer.store.placement.tiers), "format": engine.optimizer.store.fmt}
    engine.close()
    return out


def reference(world: int, fmt: StateFormat, steps: int = STEPS, bf16: bool = False) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the whole global batch, each parameter stepped by offload's kernel in ``fmt`` (elementwise:
    the engine's flat shards step alike); with a bf16 master the model's bf16 weights are the master."""
    model = make_model("gpt")
    if bf16:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone() if fmt.master is Master.FP32 else p.data for p in params]
    moments = [(torch.zeros(p.numel(), dtype=fmt.moments), torch.zeros(p.numel(), dtype=fmt.moments)) for p in params]
    for step, tokens in enumerate(batches(steps, MICRO * world), 1):
        model.zero_grad()
        loss_of(model, "gpt", tokens).backward()
        for p, master, (m, v) in zip(params, masters, moments):
            adam_step(master.view(-1), p.grad.reshape(-1), m, v, step, HYPER)
            if fmt.master is Master.FP32:
                p.data.copy_(master)
    return {k: v.float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme", "none"])
def test_bf16_moments_train_as_torch_stepping_bf16_moments(tmp_path, world, device):
    results = run_ranks(train, world, config=fmt_config(world, moments="bf16", device=device, path=tmp_path))
    ref = reference(world, FORMATS["bf16 moments"])
    # Two ranks sum gradients in another order than one process: a moment that then rounds to the neighbouring
    # bf16 value moves its update by 2**-8 of it (lr 3e-3: about 1e-5 a step), so W = 2 is held to that.
    tol = {} if world == 1 else dict(atol=1e-4, rtol=1e-3)
    for rank in results:
        assert rank["format"] == FORMATS["bf16 moments"]
        for key, value in ref.items():
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}", **tol)


def train_masters(rank: int, world: int, config: dict[str, Any], steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The engine's whole fp32 master of every parameter after ``steps``, and the 16-bit weights beside it."""
    from offload.utils import safe_get_full_fp32_param
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    for tokens in batches(steps, MICRO * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    out = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
    with offload.zero.GatheredParameters(list(engine.module.parameters())):  # the weights the forward reads
        out.update({f"weights:{name}": p.detach().float().cpu() for name, p in engine.module.named_parameters()})
    engine.close()
    return out


def reference_split(world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain PyTorch in bf16 whose weights are the high halves of a 16+16 master split from the fp32 init, each
    parameter stepped by the kernel in that format: what the engine's 16+16 master must equal, bit for bit."""
    model = make_model("gpt")
    halves = [split_master(p.detach().reshape(-1).clone()) for p in model.parameters()]
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    for p, (hi, _) in zip(params, halves):
        p.data.copy_(hi.view_as(p))
    moments = [(torch.zeros(p.numel(), dtype=torch.bfloat16), torch.zeros(p.numel(), dtype=torch.bfloat16))
               for p in params]
    for step, tokens in enumerate(batches(steps, MICRO * world), 1):
        model.zero_grad()
        loss_of(model, "gpt", tokens).backward()
        for p, (_, lo), (m, v) in zip(params, halves, moments):
            adam_step(p.data.view(-1), p.grad.reshape(-1), m, v, step, HYPER, master_lo=lo)
    out = {name: join_master(p.data.reshape(-1), lo).view(p.shape) for (name, p), (_, lo)
           in zip(model.named_parameters(), halves)}
    out.update({f"weights:{name}": p.detach().float() for name, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("device", ["cpu", "nvme", "none"])
def test_the_16_16_master_trains_as_torch_stepping_the_same_halves(tmp_path, device):
    """The master held as the bf16 weights and a low half is an fp32 master exactly: bitwise what plain PyTorch
    gets stepping the same halves, on every tier. The weights the forward reads are the high halves, the master
    rounded to nearest with ties away from zero (where plain mixed precision breaks ties to even)."""
    config = fmt_config(1, master="16+16", moments="bf16", device=device, path=tmp_path, bf16=True)
    result = train_masters(0, 1, config)  # in this process: both sides compute with the same threads
    for key, value in reference_split(1).items():
        assert torch.equal(result[key], value), key
    for name, master in ((k, v) for k, v in result.items() if not k.startswith("weights:")):
        high = split_master(master.reshape(-1))[0].view_as(master).float()
        assert torch.equal(result[f"weights:{name}"], high), name


@pytest.mark.parametrize("world,device", [(1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_a_step_of_the_16_16_master_is_bitwise_the_fp32_masters(tmp_path, world, device):
    """From the same weights and gradients, a step of the 16+16 master lands on the fp32 master's bits (beside
    bf16 moments both: the format changes how the master is held, not the arithmetic), each rank's shard of it."""
    masters = {m: run_ranks(train_masters, world, steps=1, config=fmt_config(
        world, master=m, moments="bf16", device=device, path=tmp_path / m.replace("+", "p"), bf16=True))
        for m in ("fp32", "16+16")}
    for rank in range(world):
        for name in (k for k in masters["fp32"][rank] if not k.startswith("weights:")):
            assert torch.equal(masters["16+16"][rank][name], masters["fp32"][rank][name]), name


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_bf16_master_rounded_to_nearest_trains_as_torch_stepping_its_bf16_weights(tmp_path, device):
    config = fmt_config(1, master="bf16", moments="bf16", device=device, path=tmp_path, bf16=True)
    result = run_ranks(train, 1, config=config)[0]
    ref = reference(1, FORMATS["bf16 master nearest"], bf16=True)
    for key, value in ref.items():
        torch.testing.assert_close(result["state"][key], value, atol=1e-2, rtol=1e-2)


def test_the_host_holds_the_bytes_each_format_says():
    sizes = {}
    for name, (master, moments) in {"fp32": ("fp32", "fp32"), "bf16 moments": ("fp32", "bf16"),
                                    "bf16 master": ("bf16-stochastic", "bf16"), "16+16": ("16+16", "bf16")}.items():
        config = fmt_config(1, master=master, moments=moments, bf16=True)
        engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
        elements = engine.optimizer.store.placement.tiers["host"]
        groups = len(engine.optimizer.store.groups)
        sizes[name] = (engine.memory_summary()["host"]["optimizer state"], elements, groups)
        engine.close()
    for name, per_element in {"fp32": 12, "bf16 moments": 8, "bf16 master": 6, "16+16": 6}.items():
        nbytes, elements, groups = sizes[name]  # each sub-group's buffer is whole pages
        assert per_element * elements <= nbytes < per_element * elements + 4096 * groups, (name, nbytes)
    assert sizes["bf16 master"][0] < sizes["bf16 moments"][0] < sizes["fp32"][0]
    # the 16+16 master's high halves are the weights the parameter store holds anyway: 6 bytes, the same values
    assert sizes["16+16"][0] < sizes["bf16 moments"][0]


def _resume(tmp_path: Path, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    whole = run_ranks(train, 1, config=config, steps=6)[0]
    run_ranks(train, 1, config=config, steps=3, save=str(tmp_path / "ckpt"))
    resumed = run_ranks(train, 1, config=config, steps=3, load=str(tmp_path / "ckpt"))[0]
    return whole, resumed


@pytest.mark.parametrize("master,moments,device", [("fp32", "bf16", "cpu"), ("16+16", "bf16", "cpu"),
                                                   ("16+16", "bf16", "nvme"), ("bf16-stochastic", "bf16", "cpu"),
                                                   ("bf16-stochastic", "bf16", "nvme"), ("bf16", "bf16", "nvme")])
def test_a_resumed_run_equals_the_run_that_never_stopped(tmp_path, master, moments, device):
    config = fmt_config(1, master=master, moments=moments, device=device, path=tmp_path / "swap", bf16=True)
    whole, resumed = _resume(tmp_path, config)
    assert resumed["losses"] == whole["losses"][3:]
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key


def test_the_checkpoint_holds_the_state_as_held_and_loads_into_another_format_with_a_note(tmp_path, caplog):
    config = fmt_config(1, master="bf16-stochastic", moments="bf16", bf16=True)
    saved = run_ranks(train, 1, config=config, steps=2, save=str(tmp_path / "ckpt"))[0]
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    meta = json.loads((tmp_path / "ckpt" / tag / "meta.json").read_text())
    assert meta["state_format"] == {"master": "bf16-stochastic", "moments": "bfloat16"}
    index = json.loads((tmp_path / "ckpt" / tag / "rank0.json").read_text())
    assert {e["dtype"] for e in index if e["kind"] in ("master", "exp_avg", "exp_avg_sq")} == {"bfloat16"}
    # into the default format: the bf16 master widened exactly, with a note
    fp32 = fmt_config(1, bf16=True)
    with caplog.at_level(logging.WARNING, logger="offload.checkpoint"):
        engine, *_ = offload.initialize(model=make_model("gpt"), config=fp32)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = engine.full_state_dict()
        master = engine.optimizer.master_of(0)
        engine.close()
    assert "held as master bf16-stochastic, moments bfloat16 and this engine holds it as master fp32" in caplog.text
    assert master.dtype == torch.float32 and torch.equal(master, master.bfloat16().float())
    for key, value in saved["state"].items():
        assert torch.equal(loaded[key], value), key
    # the weights recovered from it are the master, in fp32
    export_weights(tmp_path / "ckpt", tmp_path / "out")
    exported = load_exported(tmp_path / "out")
    for key, value in saved["state"].items():
        assert exported[key].dtype == torch.float32 and torch.equal(exported[key], value.float()), key


def test_a_16_16_checkpoint_holds_the_exact_master_and_loads_into_fp32_bit_for_bit(tmp_path, caplog):
    config = fmt_config(1, master="16+16", moments="bf16", bf16=True)
    saved = run_ranks(train, 1, config=config, steps=2, save=str(tmp_path / "ckpt"))[0]["state"]  # fp32 masters
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    meta = json.loads((tmp_path / "ckpt" / tag / "meta.json").read_text())
    assert meta["state_format"] == {"master": "16+16", "moments": "bfloat16"}
    index = json.loads((tmp_path / "ckpt" / tag / "rank0.json").read_text())
    assert {e["dtype"] for e in index if e["kind"] == "master"} == {"float32"}  # both halves, as one float
    with caplog.at_level(logging.WARNING, logger="offload.checkpoint"):
        engine, *_ = offload.initialize(model=make_model("gpt"), config=fmt_config(1, moments="bf16", bf16=True))
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = engine.full_state_dict()
        engine.close()
    assert "held as master 16+16, moments bfloat16 and this engine holds it as master fp32" in caplog.text
    for key, value in loaded.items():
        assert torch.equal(value, saved[key]), key


def test_deepspeeds_bf16_keys_choose_the_same_formats():
    raw = fmt_config(1, bf16=True)
    raw["bf16"].update(bf16_optimizer_states=True)
    assert from_config(Config.load(raw)) == StateFormat(Master.FP32, torch.bfloat16)
    raw["bf16"].update(bf16_master_weights_and_grads=True)
    assert from_config(Config.load(raw)) == StateFormat(Master.BF16, torch.bfloat16)


@pytest.mark.parametrize("change, path, message", [
    (dict(master="bf16"), "offload.optimizer_state.master", "a 16-bit master (bf16) trains bf16 weights: set "
                                                            "bf16.enabled true"),
    (dict(master="16+16"), "offload.optimizer_state.master", "a 16-bit master (16+16) trains bf16 weights"),
    (dict(master="fp16"), "offload.optimizer_state.master", "not one of 'fp32', '16+16', 'bf16', 'bf16-stochastic'"),
    (dict(moments="fp16"), "offload.optimizer_state.moments", "not one of 'fp32', 'bf16'"),
])
def test_a_format_that_cannot_work_is_refused_naming_its_key(change, path, message):
    raw = fmt_config(1)
    raw["offload"]["optimizer_state"].update(change)
    with pytest.raises(ConfigError, match=path) as err:
        from_config(Config.load(raw))
    assert message in str(err.value)


def test_deepspeeds_nearest_master_and_our_stochastic_one_together_are_refused():
    raw = fmt_config(1, master="bf16-stochastic", bf16=True)
    raw["bf16"]["bf16_master_weights_and_grads"] = True
    with pytest.raises(ConfigError, match="bf16.bf16_master_weights_and_grads.*keep one of them"):
        from_config(Config.load(raw))


def test_state_on_an_emulated_gpu_steps_the_format_in_torchs_ops(monkeypatch):
    """A partial offload keeps some units' state on the device, stepped there by torch's kernels widened to fp32
    and stored back as held: the same training as the host's kernel, to fp32 rounding."""
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    config = fmt_config(1, moments="bf16")
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    result = train(0, 1, config)
    assert result["tiers"].get("device", 0) > 0 and result["tiers"].get("host", 0) > 0
    ref = reference(1, FORMATS["bf16 moments"])
    for key, value in ref.items():
        torch.testing.assert_close(result["state"][key], value, atol=2e-5, rtol=1e-4)


def test_a_stochastic_master_keeps_small_updates_that_nearest_loses():
    """lr 1e-5 on weights near 1 (the layer norms' gains): to nearest they never move, stochastically they do."""
    moved = {}
    for master in ("bf16", "bf16-stochastic"):
        config = fmt_config(1, master=master, moments="bf16", bf16=True)
        config["optimizer"]["params"]["lr"] = 1e-5
        engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
        before = engine.full_state_dict()["blocks.0.ln1.weight"].clone()
        for tokens in batches(8, MICRO):
            engine.backward(loss_of(engine, "gpt", tokens))
            engine.step()
        moved[master] = (engine.full_state_dict()["blocks.0.ln1.weight"] != before).float().mean().item()
        engine.close()
    assert moved["bf16"] == 0.0 and moved["bf16-stochastic"] > 0.0, moved


def test_the_stochastic_streams_differ_by_rank_step_and_unit():
    from offload.store.state_format import mix_seed
    seeds = {mix_seed(mix_seed(0, rank), step, unit) for rank in range(4) for step in range(1, 50) for unit in range(8)}
    assert len(seeds) == 4 * 49 * 8
    assert Stochastic(mix_seed(1, 2, 3)).seed == mix_seed(1, 2, 3)


def test_the_convergence_ab_writes_its_curves_its_verdicts_and_a_plot(tmp_path, capsys):
    """`offload bench formats` at a smoke size: every format's curve, the band of the fp32 seeds and each verdict
    (the figures themselves come from the full run: docs/performance.md)."""
    from offload.commands.cli import main
    out = tmp_path / "formats.json"
    assert main(["bench", "formats", "--steps", "6", "--seeds", "2", "--eval-every", "3", "--warmup", "2",
                 "--hidden", "32", "--layers", "1", "--seq", "16", "--micro", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["format"], r["seed"]) for r in result["runs"]] == [
        ("fp32", 0), ("fp32", 1), ("bf16 moments", 0), ("16+16 master", 0), ("bf16 master stochastic", 0),
        ("bf16 master nearest", 0)]
    assert all(r["steps"] == [3, 6] and len(r["eval_loss"]) == 2 for r in result["runs"])
    bytes_of = {r["format"]: r["optimizer_state_bytes"] for r in result["runs"]}
    assert bytes_of["bf16 master nearest"] < bytes_of["bf16 moments"] < bytes_of["fp32"]
    band = sorted(r["eval_loss"][-1] for r in result["runs"] if r["format"] == "fp32")
    for name, verdict in result["verdicts"].items():
        assert verdict["band"] == band and verdict["inside"] == (band[0] <= verdict["final"] <= band[1]), name
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(the negative control: expected outside)" in capsys.readouterr().out
    assert main(["bench", "formats", "--formats", "fp16", "--out", str(out)]) == 2


def test_the_estimate_prices_each_format_by_its_bytes():
    """`offload estimate`: the host holds and the host Adam moves each format's bytes (2 x state + the fp32
    gradient read + the 16-bit weights written: 30, 22 and 18 an element)."""
    from offload.commands.estimate import StepRates, estimate
    units = [1_000_000] * 4
    rates = StepRates(device_gbps=2000.0, host_gbps=100.0, h2d_gbps=50.0, d2h_gbps=50.0)
    host, adam = {}, {}
    for name, (master, moments) in {"fp32": ("fp32", "fp32"), "bf16 moments": ("fp32", "bf16"),
                                    "bf16 master": ("bf16-stochastic", "bf16"), "16+16": ("16+16", "bf16")}.items():
        raw = fmt_config(1, master=master, moments=moments, bf16=True)
        config = Config.load(raw).resolve(world_size=1)
        est = estimate(units, config, 1, discrete=True, rates=rates)
        host[name] = est.tiers["host"]["optimizer state"]
        adam[name] = est.prediction.terms["host Adam"]
    for name, state in {"fp32": 12, "bf16 moments": 8, "bf16 master": 6, "16+16": 6}.items():
        assert state * 4_000_000 <= host[name] < state * 4_000_000 + 4 * 4096, name
    assert adam["bf16 moments"] / adam["fp32"] == pytest.approx(22 / 30)
    assert adam["bf16 master"] / adam["fp32"] == pytest.approx(18 / 30)
    assert adam["16+16"] / adam["fp32"] == pytest.approx(22 / 30)  # its high half stepped as the weights


def test_a_16_16_master_on_an_emulated_gpu_steps_as_on_the_host(monkeypatch):
    """Units whose state the device keeps (a partial offload) step the 16+16 master in torch's ops there, widened
    to fp32 and split back: the same training as the host's kernel, to fp32 rounding."""
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    config = fmt_config(1, master="16+16", moments="bf16", bf16=True)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    result = train_masters(0, 1, config)
    for key, value in reference_split(1).items():
        torch.testing.assert_close(result[key], value, atol=2e-5 if "weights" not in key else 8e-3, rtol=1e-4,
                                   msg=lambda m, k=key: f"{k}: {m}")


def _schedule_run(config: dict[str, Any]) -> dict[str, Any]:
    out = train_masters(0, 1, config)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    out["lent"] = [g.fmt.high_elsewhere for g in engine.optimizer.store.groups]
    engine.close()
    return out


def test_where_a_step_writes_a_second_place_first_the_16_16_master_keeps_its_high_half_and_trains_the_same():
    """The speculative step writes the other slot before its factor is known, and the delayed update a staging
    buffer: there the high half is held in the state (the weights cannot be it); the speculated run trains
    bitwise as the plain one, whose high halves are the weights."""
    plain = fmt_config(1, master="16+16", moments="bf16", bf16=True, clip=1.0)
    plain["offload"]["speculative_step"] = "off"
    speculated = fmt_config(1, master="16+16", moments="bf16", bf16=True, clip=1.0)
    speculated["offload"]["speculative_step"] = "on"
    delayed = fmt_config(1, master="16+16", moments="bf16", bf16=True)
    delayed["offload"]["delayed_update"] = {"warmup_steps": 2}
    runs = {name: _schedule_run(c) for name, c in (("plain", plain), ("speculated", speculated),
                                                   ("delayed", delayed))}
    assert all(runs["plain"]["lent"]) and not any(runs["speculated"]["lent"]) and not any(runs["delayed"]["lent"])
    for key, value in runs["plain"].items():
        if key != "lent":
            assert torch.equal(runs["speculated"][key], value), key
    for name, master in ((k, v) for k, v in runs["delayed"].items() if k != "lent" and not k.startswith("weights:")):
        assert torch.isfinite(master).all() and not torch.equal(master, runs["plain"][name]), name


def _tied_model() -> torch.nn.Module:
    """The test GPT with every weight an exact bf16 tie (low 16 bits 0x8000, odd high half): nearest-even and
    ties-away rounding disagree on each."""
    model = make_model("gpt")
    with torch.no_grad():
        for p in model.parameters():
            bits = p.detach().view(torch.int32)
            p.copy_(((bits & ~0xFFFF) | 0x18000).view(torch.float32))
    return model


def _weights_after_build(rank: int, world: int, stage: int) -> dict[str, Any]:
    from offload.utils import safe_get_full_fp32_param
    config = fmt_config(world, master="16+16", moments="bf16", bf16=True, stage=stage)
    engine, *_ = offload.initialize(model=_tied_model(), config=config)
    masters = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
    with offload.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().float().cpu() for name, p in engine.module.named_parameters()}
        for p in engine.module.parameters():  # a write no rank keeps (no modifier_rank)
            p.data.add_(1.0)
    after = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
    engine.close()
    return {"masters": masters, "weights": weights, "after": after}


@pytest.mark.parametrize("world,stage", [(1, 3), (2, 1), (2, 3)])
def test_every_copy_of_the_16_16_weights_is_the_masters_high_half_and_a_discarded_write_leaves_the_master(world,
                                                                                                          stage):
    """From the start every rank's copy of every part of the weights is the master's high half (ties away from
    zero, on weights that are all ties), and a write inside GatheredParameters without a modifier rank, which no
    rank keeps, leaves the master as it was, where the weights are its high half too."""
    # one rank in this process: its units read their home in place, so the gathered weights are the lent halves
    results = run_ranks(_weights_after_build, world, stage=stage) if world > 1 else [_weights_after_build(0, 1, stage)]
    for result in results:
        for name, master in result["masters"].items():
            high = split_master(master.reshape(-1))[0].view_as(master).float()
            assert torch.equal(result["weights"][name], high), name
            assert torch.equal(result["after"][name], master), name
