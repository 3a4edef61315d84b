"""Activation checkpointing: training with checkpointed blocks equals torch without them; cpu_checkpointing moves
the saved inputs from the device tier to the host tier; partition_activations keeps 1/W per rank of a
model-parallel group; misuse is a clear error."""

import pytest
import torch
import torch.distributed as dist
from engine_cases import base_config, batches, check_parity, loss_of, train_engine, train_reference

import offload
from offload import checkpointing
from offload.checkpointing import ActivationStore, CheckpointingError, CheckpointSettings, checkpoint
from offload.commands.estimate import ActivationShape, estimate, model_units
from offload.config import Config
from offload.machine.accelerator import Accelerator
from offload.machine.launch import run_ranks
from offload.models import GPT, GPTConfig

STEPS, MICRO, ACCUM = 6, 2, 2


def ac_config(world, stage, cpu, **extra):
    optimizer = {"offload_optimizer": {"device": "none"}} if stage == 0 else {}
    config = base_config(MICRO, ACCUM, world, stage=stage, **optimizer)
    config["offload"]["checkpoint_blocks"] = True
    config["activation_checkpointing"] = {"cpu_checkpointing": cpu, **extra}
    return config


@pytest.mark.parametrize("name,world,stage,cpu", [("gpt", 1, 3, True), ("gpt", 2, 2, True), ("gpt", 2, 0, False),
                                                  ("llama", 2, 3, True)])
def test_checkpointed_blocks_train_exactly_like_torch_without_them(name, world, stage, cpu):
    pytest.importorskip("transformers") if name == "llama" else None
    results = run_ranks(train_engine, world, name=name, config=ac_config(world, stage, cpu), steps=STEPS,
                        micro=MICRO, accum=ACCUM)
    check_parity(results, train_reference(name, STEPS, MICRO * ACCUM * world, MICRO, world=world))
    blocks = 3 if name == "gpt" else 2
    assert results[0]["counts"]["recompute"] == blocks * STEPS * ACCUM  # every block recomputed in every backward


def _gpt(layers):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=96, context=16, hidden_size=32, layers=layers, heads=2))


def _one_forward(cpu, layers=4, host_budget=None):
    """An engine on a GPT with checkpointed blocks after one forward (the saved inputs held) and its backward."""
    config = ac_config(1, 3, cpu)
    if host_budget is not None:
        config["offload"]["budgets"] = {"host": host_budget}
    engine, *_ = offload.initialize(model=_gpt(layers), config=config)
    try:
        loss = loss_of(engine, "gpt", batches(1, MICRO)[0])
        store = engine.activations
        held = {"device": store.device_bytes, "host": store.host_bytes,
                "host_budget": engine.memory_summary()["host"].get(checkpointing.HOST_PART, 0)}
        engine.backward(loss)
        engine.step()
        peaks = {"device": store.peak_device_bytes, "host": store.peak_host_bytes, "saves": store.saves,
                 "prefetched": store.prefetched, "left": store.device_bytes + store.host_bytes}
    finally:
        engine.close()
    return held, peaks


def test_cpu_checkpointing_moves_the_saved_inputs_from_the_device_to_the_host():
    layers = 4
    one_input = MICRO * 16 * 32 * 4  # rows x seq x hidden, fp32
    saved = layers * one_input
    on_device, device_peaks = _one_forward(cpu=False, layers=layers)
    on_host, host_peaks = _one_forward(cpu=True, layers=layers)
    assert on_device == {"device": saved, "host": 0, "host_budget": 0}
    assert on_host["device"] <= one_input  # at most the newest input, its copy out in flight
    assert on_host["host"] == on_host["host_budget"] == saved  # and host use rises by what the device gave up
    config = Config.load(ac_config(1, 3, True)).resolve(world_size=1)
    shape = ActivationShape(layers=layers, hidden=32, heads=2, seq=16, micro=MICRO, vocab=96)
    est = estimate(model_units(_gpt(layers), config), config, 1, shape)
    assert est.tiers["host"]["activation checkpoints"] == saved  # offload estimate --checkpointing cpu agrees
    assert device_peaks["device"] == saved
    # Backward holds the block recomputing and the one brought back ahead of it: the high-water mark drops by all
    # but those two.
    assert host_peaks["device"] <= 2 * one_input <= device_peaks["device"] - (saved - 2 * one_input)
    assert host_peaks["prefetched"] == layers - 1  # every input but the last block's came back ahead of use
    assert device_peaks["left"] == host_peaks["left"] == 0


def test_cpu_checkpointing_over_the_host_budget_is_a_clear_error():
    held, _ = _one_forward(cpu=True)
    probe, *_ = offload.initialize(model=_gpt(4), config=ac_config(1, 3, True))
    start_up = probe.memory_summary()["host"]["total"]  # what the engine takes before any activation
    probe.close()
    with pytest.raises(CheckpointingError, match="cpu_checkpointing needs .* over offload.budgets.host"):
        _one_forward(cpu=True, host_budget=start_up + held["host"] // 2)


def _partitioned(rank, world, partition):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))
    x = torch.randn(5, 8, requires_grad=True)  # the same on every rank: a model-parallel group's replicas
    store = ActivationStore(Accelerator("cpu"), CheckpointSettings(partition_activations=partition))
    checkpointing.configure(store=store, group=dist.group.WORLD)
    h = x
    for block in blocks:
        h = checkpoint(block, h)
    h.square().sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    checkpointing.reset()
    h = x.detach().requires_grad_()
    out = h
    for block in blocks:
        block.zero_grad()
        out = block(out)
    out.square().sum().backward()
    plain = [p.grad for p in blocks.parameters()] + [h.grad]
    return {"peak": store.peak_device_bytes, "equal": all(torch.equal(a, b) for a, b in zip(grads, plain))}


def test_partition_activations_keeps_half_of_each_saved_input_per_rank():
    whole = run_ranks(_partitioned, 2, partition=False)
    halves = run_ranks(_partitioned, 2, partition=True)
    for w, h in zip(whole, halves):
        assert w["equal"] and h["equal"]  # gradients identical to the model without checkpointing
        assert w["peak"] == 3 * 5 * 8 * 4 and h["peak"] == w["peak"] // 2  # 40 elements split evenly over 2


def test_misuse_is_a_clear_error():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(CheckpointingError, match="must return a tensor or a tuple"):
        checkpoint(lambda t: {"out": linear(t)}, x)
    with pytest.raises(CheckpointingError, match="keyword arguments \\['bias'\\] need gradients"):
        checkpoint(lambda t, bias: linear(t) + bias, x, bias=torch.ones(4, requires_grad=True))
    with pytest.raises(CheckpointingError, match="at least one tensor argument"):
        checkpoint(lambda: linear(torch.ones(1, 4)))
    y = checkpoint(linear, x).sum()
    y.backward(retain_graph=True)
    with pytest.raises(CheckpointingError, match="backward ran twice through the same checkpoint"):
        y.backward()
    checkpointing.reset()
    with pytest.raises(CheckpointingError, match="found no transformer blocks"):
        checkpointing.wrap_blocks(torch.nn.Linear(2, 2))


def test_two_engines_keep_their_saved_inputs_apart():
    first, *_ = offload.initialize(model=_gpt(2), config=ac_config(1, 3, False))
    second, *_ = offload.initialize(model=_gpt(3), config=ac_config(1, 3, True))
    tokens = batches(1, MICRO)[0]
    losses = [loss_of(engine, "gpt", tokens) for engine in (first, second)]  # both forwards before any backward
    assert (first.activations.saves, second.activations.saves) == (2, 3)
    assert first.activations.host_bytes == 0 < second.activations.host_bytes
    for engine, loss in zip((first, second), losses):
        engine.backward(loss)
        engine.step()
    assert first.activations.device_bytes == second.activations.host_bytes == 0
    first.close()
    second.close()


@pytest.mark.parametrize("boundary", [False, True])
def test_synchronize_checkpoint_boundary_syncs_at_each_block_and_the_ledger_counts_it(boundary):
    """DeepSpeed's key: a whole-device sync as each checkpointed block runs forward and is recomputed. It acts, and
    as every host-blocking wait, it is counted (it was the one wait the sync ledger did not see)."""
    from offload.observe.sync_ledger import Role
    engine = offload.initialize(model=GPT(GPTConfig(vocab_size=64, context=16, hidden_size=32, layers=3, heads=2)),
                                config=ac_config(1, 3, False, synchronize_checkpoint_boundary=boundary))[0]
    engine.accel.ledger.reset()
    tokens = batches(1, MICRO)[0]
    engine.backward(loss_of(engine, "gpt", tokens))
    forward = engine.accel.ledger.waits_by(Role.FORWARD).get("device synchronized", 0)
    backward = engine.accel.ledger.waits_by(Role.BACKWARD).get("device synchronized", 0)
    assert (forward, backward) == ((3, 3) if boundary else (0, 0))
    engine.close()
