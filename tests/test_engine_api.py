"""The DeepSpeed-shaped surface: client optimizers and param groups, schedulers, accumulation, close()."""

import math

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.machine.launch import run_ranks


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def client_optimizer_run(rank, world, steps=6):
    """A torch AdamW with two param groups and a LambdaLR, given to initialize; and the same in plain torch."""
    config = base_config(2, 1, world)
    del config["optimizer"]
    model = make_model("gpt")
    opt = torch.optim.AdamW(_groups(model), lr=2e-3, betas=(0.9, 0.95))
    warm = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))  # noqa: E731
    engine, optimizer, _, sched = offload.initialize(model=model, config=config, optimizer=opt, lr_scheduler=warm)
    lrs = []
    for tokens in batches(steps, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        engine.step()
        lrs.append(engine.get_lr())
    state = engine.full_state_dict()
    engine.close()
    if rank:
        return state, lrs
    ref = make_model("gpt")
    ref_opt = torch.optim.AdamW(_groups(ref), lr=2e-3, betas=(0.9, 0.95))
    _reference_steps(ref, ref_opt, warm(ref_opt), steps, world)
    return state, lrs, ref.state_dict(), [g["lr"] for g in ref_opt.param_groups]


def _reference_steps(ref, opt, sched, steps, world):
    """Plain PyTorch on the whole global batches, clipped at 1, the scheduler stepped after each step; the first
    group's rate after each."""
    lrs = []
    for tokens in batches(steps, 2 * world):
        loss_of(ref, "gpt", tokens).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_client_optimizer_with_param_groups_and_scheduler_matches_torch():
    results = run_ranks(client_optimizer_run, 2)
    state, lrs, ref_state, ref_lrs = results[0]
    assert lrs[-1] == pytest.approx(ref_lrs)
    assert lrs[0] == pytest.approx([2e-3 * 2 / 3] * 2)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value)
        torch.testing.assert_close(results[1][0][key], value)


def script_scheduler_run(rank, world, steps=5):
    """#70: the script builds a torch LambdaLR on the optimizer initialize returned (as transformers.get_scheduler is
    called) and steps it after engine.step(); the same schedule in plain torch. DeepSpeed 0.19.8 refuses this (its
    optimizer is not a torch Optimizer); offload's is one by its face."""
    import warnings
    config = base_config(2, 1, world)
    model = make_model("gpt")
    engine, optimizer, _, _ = offload.initialize(model=model, config=config)
    fn = lambda s: 0.5 ** s  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in batches(steps, 2 * world):
            engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
            engine.step()
            sched.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    state = engine.full_state_dict()
    engine.close()
    ref = make_model("gpt")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=config["optimizer"]["params"]["lr"], betas=(0.9, 0.95),
                                weight_decay=0.1)
    ref_lrs = _reference_steps(ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, fn), steps, world)
    return state, lrs, ref.state_dict(), ref_lrs, [str(w.message) for w in caught]


@pytest.mark.parametrize("world", [1, 2])
def test_a_torch_scheduler_the_script_builds_on_the_returned_optimizer_drives_the_rate(world):
    for state, lrs, ref_state, ref_lrs, warned in run_ranks(script_scheduler_run, world):
        assert lrs == pytest.approx(ref_lrs) and lrs[0] == pytest.approx(ref_lrs[0])
        assert not [w for w in warned if "lr_scheduler.step()" in w]  # engine.step() counts as the optimizer's
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value)


def _cpu_adam_client_run(rank, world, client_mode):
    """Three steps with offload's own CPUAdam given to initialize (``client_mode``: its adamw_mode), or (None) with
    the config's Adam section; the losses."""
    from offload.optim import CPUAdam
    config = base_config(2, 1, world)
    model = make_model("gpt")
    if client_mode is None:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 2e-3, "weight_decay": 0.1, "adam_w_mode": False}}
        engine = offload.initialize(model=model, config=config)[0]
    else:
        del config["optimizer"]
        opt = CPUAdam(model.parameters(), lr=2e-3, weight_decay=0.1, adamw_mode=client_mode)
        engine = offload.initialize(model=model, config=config, optimizer=opt)[0]
    losses = []
    for tokens in batches(3, 2):
        losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
        engine.step()
    engine.close()
    return losses


def test_offloads_own_cpu_adam_as_the_client_optimizer_keeps_its_mode():
    """A CPUAdam keeps adamw_mode and bias_correction in its param groups (it failed with AttributeError here):
    adamw_mode False is the config's Adam with adam_w_mode false, step for step; True is not."""
    runs = {mode: run_ranks(_cpu_adam_client_run, 1, client_mode=mode)[0] for mode in (None, False, True)}
    assert runs[False] == runs[None]
    assert runs[True][1:] != runs[None][1:]


def test_a_cpu_adam_whose_groups_differ_in_mode_is_refused():
    from offload.optim import CPUAdam
    model = make_model("gpt")
    decay, no_decay = _groups(model)
    opt = CPUAdam([decay, {**no_decay, "adamw_mode": False}], lr=1e-3)
    config = base_config(2, 1, 1)
    del config["optimizer"]
    with pytest.raises(offload.EngineError, match="differ in adamw_mode or bias_correction"):
        offload.initialize(model=model, config=config, optimizer=opt, device="cpu")


def test_config_scheduler_follows_deepspeed_warmup():
    config = {**base_config(2, 1, 1), "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "log"}}}
    engine, _, _, sched = offload.initialize(model=make_model("gpt"), config=config)
    assert engine.get_lr() == [0.0]  # iteration -1: the first step runs at warmup_min_lr, as DeepSpeed's does
    seen = []
    for tokens in batches(12, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
        seen.append(engine.get_lr()[0])
    expected = [1e-3 * math.log(i + 1) / math.log(10) if i < 10 else 1e-3 for i in range(12)]
    assert seen == pytest.approx(expected)
    assert sched.state_dict() == {"last_batch_iteration": 11}
    engine.close()


def test_step_applies_only_at_the_accumulation_boundary():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 3, 1))
    # DeepSpeed's engine answers its batch with methods
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.gradient_clipping()) == (6, 2, 3, 1.0)
    assert (engine.zero_optimization_stage(), engine.bf16_enabled(), engine.fp16_enabled(), engine.global_rank,
            engine.world_size, engine.device.type) == (3, False, False, 0, 1, "cpu")
    assert engine.get_global_grad_norm() is None  # no step yet
    before = engine.full_state_dict()
    for i, tokens in enumerate(batches(3, 2)):
        # DeepSpeed's meaning: the current micro-batch ends the accumulation (before its forward too)
        assert engine.is_gradient_accumulation_boundary() == (i == 2)
        engine.backward(loss_of(engine, "gpt", tokens))
        assert engine.is_gradient_accumulation_boundary() == (i == 2)
        engine.step()
        assert engine.is_gradient_accumulation_boundary() == (i == 1)  # the coming one: the last
        changed = any(not torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
        assert changed == (i == 2)
        assert engine.global_steps == (1 if i == 2 else 0)
    assert engine.get_global_grad_norm() == engine.last_grad_norm > 0
    engine.close()


def test_a_scheduler_built_on_the_scripts_optimizer_and_its_lr_reach_the_step():
    """DeepSpeed steps the client's optimizer itself: a schedule object built on it, or an lr set in its groups,
    changes the step. Here that optimizer becomes a view of the engine's groups, to the same effect."""
    model = make_model("gpt")
    config = base_config(2, 2, 1)
    del config["optimizer"]
    opt = torch.optim.AdamW(_groups(model), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    engine, optimizer, _, returned = offload.initialize(model=model, config=config, optimizer=opt, lr_scheduler=sched)
    assert returned is sched and opt.param_groups is optimizer.param_groups
    tokens = batches(1, 2)[0]
    for _ in range(3):
        for _ in range(2):
            engine.backward(loss_of(engine, "gpt", tokens))
            engine.step()
    assert engine.get_lr() == pytest.approx([1e-3 * 0.5 ** 3] * 2) == sched.get_last_lr()
    opt.param_groups[0]["lr"] = 0.0
    assert engine.get_lr()[0] == 0.0
    with pytest.raises(RuntimeError, match="save and load it with engine.save_checkpoint"):
        optimizer.state_dict()
    with pytest.raises(RuntimeError, match="loaded by engine.load_checkpoint"):
        optimizer.load_state_dict({})
    engine.close()


def test_checkpoint_arguments_in_deepspeeds_order_and_numeric_tags(tmp_path):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    path = engine.save_checkpoint(tmp_path, tag=7, client_state={"epoch": 3})
    assert path.endswith("7")
    with pytest.raises(offload.EngineError, match=r"load_module_strict=False\) is not supported"):
        engine.load_checkpoint(tmp_path, 7, False)  # DeepSpeed's third argument is load_module_strict
    loaded, client = engine.load_checkpoint(tmp_path, 7, True, False)  # ... and its fourth the optimizer's states
    assert loaded == path and client["epoch"] == 3
    engine.close()


def test_close_removes_every_hook():
    model = make_model("gpt")
    engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1))
    assert any(m._forward_pre_hooks for m in model.modules())
    engine.close()
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    assert engine.runtime.live == 0


def test_training_data_gives_a_loader_of_micro_batches():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    engine, _, loader, _ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1), training_data=data)
    assert [len(b[0]) for b in loader] == [2] * 5
    engine.close()


def test_the_loader_orders_batches_as_deepspeeds_does_whatever_the_global_rng():
    """DeepSpeed's loader draws its order from a DistributedSampler (seed 0), not torch's global RNG: the same
    order on every run of the script, and the order a DeepSpeed run of it had."""
    data = torch.utils.data.TensorDataset(torch.arange(10))
    expected = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0))
    orders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        engine, _, loader, _ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1),
                                                  training_data=data)
        torch.manual_seed(seed + 100)  # the script draws from the global RNG before it iterates
        orders.append([int(x) for b in loader for x in b[0]])
        engine.close()
    assert orders[0] == orders[1] == expected and expected != list(range(10))


def _zero_grad_between_micro_batches(stage: int, how: str):
    """Two steps of two micro-batches; ``how``: "zero_grad" before every micro-batch (DeepSpeed's loop), "plain"
    without, "first_zeroed": the first micro-batch's loss times 0 (what DeepSpeed's stages 0-1 leave of it)."""
    config = base_config(2, 2, 1, stage=stage)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    for tokens in batches(2, 4):
        for a in range(2):
            if how == "zero_grad":
                engine.zero_grad()
            loss = loss_of(engine, "gpt", tokens[a * 2:(a + 1) * 2])
            engine.backward(loss * 0 if how == "first_zeroed" and a == 0 else loss)
            engine.step()
    out = (engine.global_steps, engine.full_state_dict())
    engine.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_between_micro_batches_keeps_the_accumulation_at_stages_2_and_3(stage, caplog):
    with caplog.at_level("WARNING", logger="offload.engine"):
        steps, zeroed = _zero_grad_between_micro_batches(stage, "zero_grad")
    assert steps == 2 and "zero_grad" not in caplog.text
    _, plain = _zero_grad_between_micro_batches(stage, "plain")
    for key, value in plain.items():
        assert torch.equal(zeroed[key], value), key


def test_zero_grad_between_micro_batches_at_stage_1_drops_the_earlier_ones_as_deepspeed_and_says_so(caplog):
    with caplog.at_level("WARNING", logger="offload.engine"):
        steps, zeroed = _zero_grad_between_micro_batches(1, "zero_grad")
    assert steps == 2
    assert caplog.text.count("between micro-batches at ZeRO stage 1 dropped the gradients of the 1 earlier") == 1
    _, first_zeroed = _zero_grad_between_micro_batches(1, "first_zeroed")
    _, plain = _zero_grad_between_micro_batches(1, "plain")
    assert any(not torch.equal(first_zeroed[k], v) for k, v in plain.items())
    for key, value in first_zeroed.items():
        assert torch.equal(zeroed[key], value), key


def test_gathered_parameters_and_discard_gradients():
    model = make_model("gpt")
    engine, *_ = offload.initialize(model=model, config=base_config(2, 2, 1))
    tokens = batches(1, 2)[0]
    engine.backward(loss_of(engine, "gpt", tokens))
    engine.discard_gradients()  # drops the half-accumulated gradient: the next two micro-batches make the step
    assert not engine.is_gradient_accumulation_boundary()
    for _ in range(2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
    assert engine.global_steps == 1
    state = engine.full_state_dict()
    with engine.gathered_parameters() as module:
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.detach().cpu(), state[name])  # the state dict is on the host
    assert engine.runtime.live == 0 and all(u.state.value == "sharded" for u in engine.units if not u.in_place)
    engine.close()


@pytest.mark.parametrize("name", ["zero3_bf16", "zero3_cpu_offload", "zero3_fp16", "zero3_nvme_offload",
                                  "zero3_nvme_larger_than_ram"])
def test_shipped_configs_train(name, repo, tmp_path):
    import json
    model = make_model("gpt")
    config = json.loads((repo / "configs" / f"{name}.json").read_text())
    for section in config["zero_optimization"].values():
        if isinstance(section, dict) and "nvme_path" in section:
            section["nvme_path"] = str(tmp_path)  # as shipped, but on the test's own directory
    engine, *_ = offload.initialize(model=model, config=config)
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
        engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_inputs_on_another_device_are_moved_keeping_their_structure():
    from collections import namedtuple

    from offload.machine.accelerator import to_device
    Pair = namedtuple("Pair", "a b")
    batch = {"ids": torch.ones(2, dtype=torch.long), "more": [Pair(torch.zeros(1), 3), (torch.ones(1), "x")]}
    moved = to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["ids"].dtype == torch.long
    assert isinstance(moved["more"][0], Pair) and moved["more"][0].a.is_meta and moved["more"][0].b == 3
    assert isinstance(moved["more"][1], tuple) and moved["more"][1][0].is_meta and moved["more"][1][1] == "x"
    here = torch.ones(1)
    assert to_device(here, here.device) is here  # already there: not copied
