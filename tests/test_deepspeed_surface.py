"""DeepSpeed's public surface that training scripts call, under ``import offload as deepspeed`` (#45 item 1): the
module-level boilerplate, ``comm``, the engine's accessors, ``zero.register_external_parameter`` and the
``utils`` helpers, each behaving as DeepSpeed 0.19.8's does or raising an error that says what to do instead."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model
from torch import nn

import offload
import offload as deepspeed
from offload.machine.launch import run_ranks


def test_a_scripts_arguments_name_the_config_that_initialize_reads(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(base_config(2, 1, 1)))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(config)])
    assert args.deepspeed and args.deepspeed_config == str(config)
    engine, *_ = deepspeed.initialize(args=args, model=make_model("gpt"), model_parameters=None)
    assert engine.train_micro_batch_size_per_gpu() == 2
    engine.close()


def test_init_distributed_without_a_launcher_starts_a_group_of_one():
    code = ("import offload as deepspeed, torch.distributed as dist; deepspeed.init_distributed(); "
            "print(dist.get_world_size(), deepspeed.comm.get_rank(), deepspeed.comm.get_local_rank()); "
            "deepspeed.init_distributed()")  # a second call leaves the running group as it is
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "0"]


def _comm(rank, world):
    deepspeed.init_distributed()  # the launcher started the group: nothing to do
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.barrier()
    return deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), float(t)


def test_comm_answers_with_the_launchers_group():
    assert run_ranks(_comm, 2) == [(0, 2, 3.0), (1, 2, 3.0)]


def _accessors(rank, world, path):
    config = base_config(2, 2, world)
    engine, optimizer, *_ = deepspeed.initialize(model=make_model("gpt"), config=config)
    out = {"dp": engine.dp_world_size, "local_rank": engine.local_rank, "mom": engine.get_mom(),
           "zero": engine.zero_optimization(), "scale": optimizer.cur_scale, "applied": []}
    for tokens in batches(2, 2 * 2 * world):
        for a in range(2):
            rows = tokens[(a * world + rank) * 2:(a * world + rank + 1) * 2]
            engine.backward(loss_of(engine, "gpt", rows))
            engine.step()
            out["applied"].append(engine.was_step_applied())
    out["samples"] = engine.global_samples
    engine.save_checkpoint(path)
    engine.set_train_batch_size(4 * 2 * world)
    out["accumulation"] = (engine.gradient_accumulation_steps(), engine.train_batch_size())
    with pytest.raises(ValueError, match="not a multiple of the micro-batch"):
        engine.set_train_batch_size(3)
    with pytest.raises(ValueError, match="moving between one and several"):
        engine.set_train_batch_size(2 * world)
    engine.destroy()
    again, *_ = deepspeed.initialize(model=make_model("gpt"), config=config)
    again.load_checkpoint(path)
    out["samples_loaded"] = again.global_samples
    again.close()
    return out


def test_the_engines_accessors_answer_as_deepspeeds(tmp_path):
    for rank, out in enumerate(run_ranks(_accessors, 2, path=str(tmp_path))):
        assert out["dp"] == 2 and out["local_rank"] == rank and out["zero"] is True
        assert out["mom"] == [(0.9, 0.95)] and out["scale"] == 1.0
        assert out["applied"] == [False, True, False, True]  # between boundaries nothing is applied
        assert out["samples"] == 2 * 8 and out["samples_loaded"] == 16  # two steps of the global batch
        assert out["accumulation"] == (4, 16)


def test_zero_optimization_is_false_at_stage_0():
    config = base_config(2, 1, 1)
    config["zero_optimization"] = {"stage": 0}
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    assert engine.zero_optimization() is False
    engine.close()


def _full_param(rank, world):
    engine, *_ = deepspeed.initialize(model=make_model("gpt"), config=base_config(2, 1, world))
    engine.backward(loss_of(engine, "gpt", batches(1, 2 * world)[0][rank * 2:(rank + 1) * 2]))
    engine.step()
    name, param = next((n, p) for n, p in engine.module.named_parameters() if len(p.ds_shape) == 2)
    got = offload.utils.safe_get_full_fp32_param(param)  # a collective, as DeepSpeed's
    full = engine.full_state_dict()[name]
    errors = []
    for call in (lambda: offload.utils.safe_get_full_grad(param),
                 lambda: offload.utils.safe_get_full_optimizer_state(param, "exp_avg"),
                 lambda: offload.utils.safe_set_full_fp32_param(param, got)):
        with pytest.raises(offload.EngineError) as caught:
            call()
        errors.append(str(caught.value))
    engine.close()
    with pytest.raises(offload.EngineError, match="no open offload engine"):
        offload.utils.safe_get_full_fp32_param(param)
    return torch.equal(got, full), tuple(got.shape) == tuple(param.ds_shape), errors


def test_the_full_fp32_value_of_one_parameter_and_the_helpers_it_does_not_give_say_what_does():
    for same, shaped, errors in run_ranks(_full_param, 2):
        assert same and shaped
        assert "get_global_grad_norm" in errors[0] and "offload inspect" in errors[1]
        assert "gathered_parameters(modifier_rank=0)" in errors[2]


class ReadsChildWeight(nn.Module):
    """The root's forward reads its embedding's weight without calling it: a registered external parameter."""

    def __init__(self, register=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        if register:
            deepspeed.zero.register_external_parameter(self, self.emb.weight)

    def forward(self, tokens):
        h = self.body(self.emb(tokens))
        return torch.nn.functional.linear(h, self.emb.weight).logsumexp(-1).mean()


def _external(rank, world):
    config = base_config(2, 1, world)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    config["offload"]["unit_bytes"] = 4096
    engine, *_ = deepspeed.initialize(model=ReadsChildWeight(), config=config)
    tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        losses.append(engine.backward(engine(tokens)).item())
        engine.step()
    with pytest.raises(ValueError, match="after offload.initialize"):
        deepspeed.zero.register_external_parameter(engine.module, engine.module.body.weight)
    engine.close()
    return losses


def test_a_registered_external_parameter_is_gathered_around_the_reading_modules_forward():
    """Without the registration the engine refuses that forward (tests/test_engine_robustness.py); with it the
    embedding's unit is gathered around the root's forward, at two ranks and at one with the units gathered from
    the host."""
    assert len(run_ranks(_external, 2)) == 2
    assert len(run_ranks(_external, 1, env={"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"})[0]) == 2


DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "deepspeed-api.md"
# What DeepSpeed 0.19.8 scripts call (#45's list and its siblings): each must have its row in the table.
CALLED = ["deepspeed.initialize", "deepspeed.add_config_arguments", "deepspeed.init_distributed", "deepspeed.comm",
          "deepspeed.zero.Init", "deepspeed.zero.GatheredParameters", "deepspeed.zero.register_external_parameter",
          "deepspeed.utils.safe_get_full_fp32_param", "deepspeed.utils.safe_get_full_grad",
          "deepspeed.utils.safe_get_full_optimizer_state", "deepspeed.utils.safe_set_full_fp32_param",
          "engine.local_rank", "engine.was_step_applied", "engine.dp_world_size", "engine.global_samples",
          "engine.get_mom", "engine.zero_optimization", "engine.set_train_batch_size", "engine.destroy",
          "optimizer.cur_scale", "engine.backward", "engine.step", "engine.save_checkpoint", "engine.load_checkpoint"]


def _rows():
    import re
    return [name for cell in re.findall(r"^\| `([^|]+)` \|", DOC.read_text(), re.M)
            for name in re.split(r"` / `", cell)]


def test_the_docs_table_names_only_what_exists_and_everything_scripts_call():
    engine, optimizer, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    roots = {"deepspeed": offload, "engine": engine, "optimizer": optimizer}
    rows = _rows()
    for name in rows:
        root, *path = name.split(".")
        obj = roots[root]
        for part in path:
            assert hasattr(obj, part), f"docs/deepspeed-api.md lists {name}, which does not exist"
            obj = getattr(obj, part)
    engine.close()
    missing = [name for name in CALLED if name not in rows]
    assert not missing, f"docs/deepspeed-api.md has no row for {missing}"


def _gathered(rank, world):
    engine, *_ = deepspeed.initialize(model=make_model("gpt"), config=base_config(2, 1, world))
    engine.backward(loss_of(engine, "gpt", batches(1, 2 * world)[0][rank * 2:(rank + 1) * 2]))
    engine.step()
    named = dict(engine.module.named_parameters())
    wte, other = named["wte.weight"], named["blocks.1.mlp.0.weight"]
    before = engine.full_state_dict()
    with deepspeed.zero.GatheredParameters(wte, modifier_rank=0):
        inside = (tuple(wte.shape) == tuple(wte.ds_shape), other.numel())
        if rank == 0:
            with torch.no_grad():
                wte[3].fill_(0.5)  # what rank 0 writes is kept on every rank
    with deepspeed.zero.GatheredParameters([wte]):  # read-only: a write is not kept
        with torch.no_grad():
            wte[4].fill_(9.0)
    after = engine.full_state_dict()
    with deepspeed.zero.GatheredParameters(torch.nn.Parameter(torch.ones(2))):  # no engine's: nothing to do
        pass
    engine.close()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return inside, changed, after["wte.weight"][3].tolist() == [0.5] * 32, torch.equal(
        after["wte.weight"][4], before["wte.weight"][4])


def test_gathered_parameters_gathers_just_the_named_ones_and_keeps_what_the_modifier_rank_writes():
    for inside, changed, written, untouched in run_ranks(_gathered, 2):
        assert inside == (True, 0)  # the named parameter whole, another unit's still its empty partition
        assert changed == ["head.weight", "wte.weight"] and written and untouched  # the head is tied to wte


def test_zero_init_takes_deepspeeds_arguments(tmp_path):
    config = base_config(2, 1, 1)
    with offload.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=True, dtype=torch.bfloat16,
                           min_meta_numel=16):
        meta = make_model("gpt")
    with offload.zero.Init(enabled=False, min_meta_numel=16):
        real = make_model("gpt")
    assert any(p.is_meta for p in meta.parameters()) and not any(p.is_meta for p in real.parameters())
    engine, *_ = offload.initialize(model=meta, config=config)
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.close()


def test_load_checkpoint_returns_the_keys_deepspeed_adds_to_client_state(tmp_path):
    """DeepSpeed 0.19.8 hands back its checkpoint's entries it does not restore itself beside the script's."""
    from engine_cases import base_config, batches, loss_of, make_model
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.save_checkpoint(tmp_path, client_state={"step": 1, "global_samples": "mine"})
    _, client = engine.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert client["step"] == 1 and client["global_samples"] == "mine"  # the script's keys win
    assert client["ds_version"] == offload.__version__ and client["ds_config"]["train_batch_size"] == 2
    assert client["optimizer"] is None and "lr_scheduler" not in client  # the schedule was loaded
    shapes = dict(engine.module.named_parameters())
    assert {k: tuple(v) for k, v in client["param_shapes"][0].items()} == {
        k: tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape) for k, p in shapes.items()}
    assert client["frozen_param_shapes"] == {} and client["buffer_names"] == [
        n for n, _ in engine.module.named_buffers()]
    _, client = engine.load_checkpoint(tmp_path)
    assert client["global_samples"] == "mine" and engine.global_samples == 2
    engine.close()


class _HalfRate(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler class a script hands initialize() as lr_scheduler: DeepSpeed calls it with its optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, lambda step: 0.5 ** step)


@pytest.mark.parametrize("given", ["class", "factory"])
def test_lr_scheduler_may_be_a_scheduler_class_or_a_factory(given):
    """#57 item 10: a callable (a factory, or a scheduler class, whose step() made it look like a scheduler object)
    is called with the engine's optimizer, as DeepSpeed does."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    scheduler = _HalfRate if given == "class" else (lambda opt: _HalfRate(opt))
    engine, optimizer, _, scheduler = offload.initialize(model=model, config=config, lr_scheduler=scheduler)
    assert isinstance(scheduler, _HalfRate) and engine.lr_scheduler is scheduler
    rates = [engine.get_lr()[0]]
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        rates.append(engine.get_lr()[0])
    engine.close()
    assert rates == pytest.approx([1e-3, 5e-4, 2.5e-4])


def _adam_run(optimizer_of, config_optimizer: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    if config_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=None if config_optimizer else optimizer_of(model))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8, generator=gen)).square().mean())
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("name", ["DeepSpeedCPUAdam", "FusedAdam"])
def test_deepspeeds_adam_classes_train_as_the_config_optimizer(name):
    """#57 item 9: deepspeed.ops.adam's classes, handed to initialize as a script builds them, step as the config's
    AdamW (FusedAdam's default mode is AdamW: torch's decoupled weight decay)."""
    cls = getattr(deepspeed.ops.adam, name)
    ours = _adam_run(lambda m: cls(m.parameters(), lr=1e-2, weight_decay=0.1), config_optimizer=False)
    reference = _adam_run(None, config_optimizer=True)
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="amsgrad=True\\): AMSGrad is not supported"):
        cls(torch.nn.Linear(2, 2).parameters(), amsgrad=True)


def test_deepspeeds_other_engine_names_answer_as_deepspeeds():
    """#57 item 9: the names a DeepSpeed script reads off the engine and its modules."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        assert isinstance(engine, deepspeed.DeepSpeedEngine)
        # as DeepSpeed 0.19.8 answers (its grad_accum_dtype defaults to the model's); offload accumulates in fp32
        assert engine.bfloat16_enabled() and engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
        assert engine.zero_optimization_partition_gradients() and engine.zero_offload_optimizer()
        assert not engine.zero_offload_param() and engine.mp_world_size == 1
        assert engine.steps_per_print() is None and engine.wall_clock_breakdown() is False  # unset, as DeepSpeed's
        assert engine.monitor.enabled is False
        engine.monitor.write_events([("loss", 1.0, 1)])
        assert deepspeed.checkpointing.is_configured()  # the engine configured it
    finally:
        engine.close()
    assert not deepspeed.checkpointing.is_configured()


def test_checkpointing_configure_takes_deepspeeds_keywords_and_they_reach_the_store():
    """#57 item 9: DeepSpeed's checkpointing.configure(None, partition_activations=..., contiguous_checkpointing=...,
    checkpoint_in_cpu=..., synchronize=..., profile=...) before initialize overrides the config's section."""
    deepspeed.checkpointing.configure(None, partition_activations=False, contiguous_checkpointing=True,
                                      num_checkpoints=4, checkpoint_in_cpu=True, synchronize=False, profile=False)
    assert deepspeed.checkpointing.is_configured()
    engine, *_ = deepspeed.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                      config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                              "zero_optimization": {"stage": 3}})
    try:
        assert engine.activations.settings.cpu_checkpointing is True
    finally:
        engine.close()


class _Critic(torch.nn.Module):
    """DeepSpeed-Chat's critic in small: ``forward_value`` calls the submodules itself, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
        self.v_head = torch.nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward_value(ids).mean()

    def forward_value(self, ids: torch.Tensor) -> torch.Tensor:
        return self.v_head(self.body(self.embed(ids))).squeeze(-1)


def _critic_steps(rank: int, world: int, unit_bytes: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "offload": {"unit_bytes": unit_bytes}}
    engine, *_ = deepspeed.initialize(model=_Critic(), config=config)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        ids = torch.randint(0, 64, (2 * world, 5), generator=gen)[rank * 2:(rank + 1) * 2]
        engine.backward(engine.forward_value(ids).square().mean())  # DeepSpeed hands the name on to the model
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("world,unit_bytes", [(1, 64 << 20), (2, 64 << 20), (2, 4096)],
                         ids=["W1-one-unit", "W2-one-unit", "W2-units"])
def test_a_method_other_than_forward_trains_as_torch(world, unit_bytes):
    """#57 item 6: ``engine.forward_value(...)`` reaches the model's method, and at ZeRO-3 the units its submodules
    use are gathered though the root's forward never runs (a small model is one unit, anchored there)."""
    from offload.machine.launch import run_ranks
    results = run_ranks(_critic_steps, world, unit_bytes=unit_bytes)
    torch.manual_seed(0)
    model = _Critic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # the config's (DeepSpeed's) default
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        opt.zero_grad()
        model.forward_value(torch.randint(0, 64, (2 * world, 5), generator=gen)).square().mean().backward()
        opt.step()
    for state in results:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))


class _DeepCritic(torch.nn.Module):
    """A critic whose ``forward_value`` goes around its blocks' forwards too: it calls their linears itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.v_head = torch.nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.v_head(h).squeeze(-1).square().mean()

    def forward_value(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block.fc2(torch.tanh(block.fc1(h)))
        return self.v_head(h).squeeze(-1)


def _deep_critic_steps(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "offload": {"unit_bytes": 9000}}  # a block (8,448 bytes) a unit
    engine, *_ = deepspeed.initialize(model=_DeepCritic(), config=config)
    gen = torch.Generator().manual_seed(7)
    values = []
    for step in range(4):
        ids = torch.randint(0, 64, (2 * world, 5), generator=gen)[rank * 2:(rank + 1) * 2]
        if step % 2:  # the block's own forward and the direct calls, one after the other
            loss = engine(ids)
        else:
            loss = engine.forward_value(ids).square().mean()
        engine.backward(loss)
        engine.step()
    with torch.no_grad():  # a value read outside any forward, as DeepSpeed-Chat's experience maker does
        values.append(engine.module.forward_value(torch.arange(10).view(2, 5)))
    state = engine.full_state_dict()
    anchors = [u.plan.anchors for u in engine.runtime.units]
    engine.close()
    return {"state": state, "values": values, "anchors": anchors}


@pytest.mark.parametrize("world", [1, 2])
def test_a_blocks_submodule_called_directly_gathers_its_unit(world):
    """#57 item 6, the rare case: a method that calls a block's submodules itself, going around the block's
    forward (each block a unit of its own), trains as plain PyTorch and reads whole weights outside any forward."""
    from offload.machine.launch import run_ranks
    results = run_ranks(_deep_critic_steps, world)
    torch.manual_seed(0)
    model = _DeepCritic()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        ids = torch.randint(0, 64, (2 * world, 5), generator=gen)
        opt.zero_grad()
        (model(ids) if step % 2 else model.forward_value(ids).square().mean()).backward()
        opt.step()
    with torch.no_grad():
        value = model.forward_value(torch.arange(10).view(2, 5))
    for result in results:
        assert ["blocks.0"] in result["anchors"] and ["blocks.2"] in result["anchors"], result["anchors"]
        torch.testing.assert_close(result["values"][0], value)
        for key, expected in model.state_dict().items():
            torch.testing.assert_close(result["state"][key], expected, msg=lambda m, k=key: f"{k}: {m}")


def test_an_attribute_neither_has_is_an_attribute_error_naming_both():
    engine, *_ = deepspeed.initialize(model=_Critic(), config={"train_micro_batch_size_per_gpu": 1,
                                                              "optimizer": {"type": "AdamW"},
                                                              "zero_optimization": {"stage": 3}})
    try:
        with pytest.raises(AttributeError, match="'Engine' object has no attribute 'forward_valu' \\(nor has its"):
            engine.forward_valu  # noqa: B018 - reading the attribute is what raises
    finally:
        engine.close()


def test_get_data_types_names_the_configured_accumulation_dtype_as_deepspeed_does():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 7,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        assert engine.get_data_types() == (torch.bfloat16, torch.float32) and engine.steps_per_print() == 7
    finally:
        engine.close()


def _consolidated(rank, world):
    config = {**base_config(2, 1, world), "bf16": {"enabled": True}}
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = deepspeed.initialize(model=make_model("gpt"), config=config)
    rows = batches(2, 2 * world)[0][rank * 2:(rank + 1) * 2]
    engine.backward(loss_of(engine, "gpt", rows))
    engine.step()
    statuses = {p.ds_status.name for p in engine.module.parameters()}
    with engine.gathered_parameters():
        inside = {p.ds_status.name for p in engine.module.parameters()}
    gathered = engine._zero3_consolidated_16bit_state_dict()
    full = engine.full_state_dict()
    out = {"asks": engine.zero_gather_16bit_weights_on_model_save(), "statuses": (statuses, inside),
           "stage": engine.config.get("zero_optimization", {}).get("stage"), "keys": list(gathered)}
    if rank == 0:
        out["dtypes"] = {str(t.dtype) for k, t in gathered.items() if k in dict(engine.module.named_parameters())}
        out["equal"] = all(torch.equal(gathered[k], full[k].to(gathered[k].dtype)) for k in gathered)
        out["order"] = list(gathered) == list(full)
    engine.close()
    return out


def test_the_16bit_state_dict_accelerate_saves_a_zero3_model_with_is_gathered_on_rank_0():
    """accelerate's get_state_dict and the Trainer's save_model ask these of a ZeRO-3 engine; TRL reads ds_status."""
    first, second = run_ranks(_consolidated, 2)
    assert first["asks"] and first["stage"] == 3
    assert first["statuses"] == ({"NOT_AVAILABLE"}, {"AVAILABLE"}) == second["statuses"]
    assert first["dtypes"] == {"torch.bfloat16"} and first["equal"] and first["order"]
    assert first["keys"] and second["keys"] == []


@pytest.mark.parametrize("compute", [True, False])
def test_compute_grad_norm_false_reports_no_norm_as_deepspeed(compute):
    config = base_config(2, 1, 1, clip=0.0)
    config["zero_optimization"]["compute_grad_norm"] = compute
    engine, *_ = deepspeed.initialize(model=make_model("gpt"), config=config)
    engine.backward(loss_of(engine, "gpt", batches(2, 2)[0]))
    engine.step()
    norm = engine.get_global_grad_norm()
    assert (norm is None) is (not compute) and (not compute or norm > 0)
    engine.close()


def test_deepspeed_cpu_adam_is_built_over_16bit_params_and_checks_them_when_it_steps_itself():
    """accelerate's DeepSpeed path with optimizer offload builds DeepSpeedCPUAdam over the model's bf16 params and
    hands it to initialize (whose masters are fp32), as DeepSpeed's allows; stepped by itself it says what it needs."""
    from offload.ops.adam import DeepSpeedCPUAdam
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    adam = DeepSpeedCPUAdam([p], lr=0.1)
    model = make_model("gpt").to(torch.bfloat16)
    config = {**base_config(2, 1, 1), "bf16": {"enabled": True}}
    del config["optimizer"]
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=0.1),
                                                 config=config)
    engine.backward(loss_of(engine, "gpt", batches(2, 2)[0]))
    engine.step()
    assert engine.was_step_applied() and optimizer.param_groups[0]["lr"] == 0.1
    engine.close()
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="needs float32 params"):
        adam.step()
