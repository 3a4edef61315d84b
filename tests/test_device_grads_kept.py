"""[Note: a device gradient kept as it landed] (offload/optim/sharded.py): with one 16-bit micro-batch a step, a unit
stepped on the device keeps its gradient as the reduction left it (2 bytes an element, not an fp32 accumulator's
4) until the step, which reads it widened as the accumulator would have held it: the same values, bit for bit."""

import pytest
import torch
from engine_cases import STREAM_CHECK, check_bitwise, train_engine
from test_partial_offload import ratio_config
from test_split_beside_params import split_config

from offload.machine.launch import run_ranks
from offload.optim.shard_state import ShardPhase, ShardState, widened
from offload.store.placement import KEPT_GRADS

EMULATED_GPU = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "OFFLOAD_EMULATED_COPY_DELAY_S": "0.002",
                "CUDA_VISIBLE_DEVICES": ""}


def device_stepped(result):
    """Elements of optimizer state the start-up plan put on the device (one rank's)."""
    return result["tiers"]["device"]


@pytest.mark.parametrize("scales", [(1.0,), (0.5,), (1 / 3,), (1.0, 1.0), (1 / 3, 0.25)])
def test_a_kept_gradient_widened_is_bitwise_what_an_accumulator_holds(scales):
    """One gradient, or two of one backward (the second adds in fp32, as the accumulator adds it), at factors an
    exact power of two or not."""
    torch.manual_seed(0)
    grads = [torch.randn(1000).to(torch.bfloat16) for _ in scales]
    accumulated = ShardState(0, "u", None, [], numel=1000)
    kept = ShardState(0, "u", None, [], numel=1000)
    for g, s in zip(grads, scales):
        accumulated.add(g, s, threads=1)
        kept.keep_landed(g, s, threads=1)
    assert kept.phase is ShardPhase.HOLDING and kept.grad is None
    assert torch.equal(widened(*kept.gradient()), accumulated.grad)
    if len(scales) == 1:  # kept as it landed: 16-bit, not a copy
        assert kept.landed is grads[0] and kept.landed_scale == scales[0]


def test_a_bf16_split_with_one_micro_batch_keeps_16_bit_gradients_and_is_bitwise_the_whole_offload(tmp_path):
    """On a CPU device the device tier runs the host's native kernels: the kept gradient read with its factor
    changes no bit against the whole offload (whose gradients are read where they land), and the device holds 2
    bytes an element for them where the accumulators took 4."""
    runs = []
    for ratio in (0.5, 1.0):
        config, _ = split_config(tmp_path, 1, 1, ratio, "cpu")
        config["bf16"] = {"enabled": True}
        runs.append(run_ranks(train_engine, 1, name="gpt", config=config, steps=3, micro=2, accum=1))
    memory = runs[0][0]["memory"]
    assert memory["device"][KEPT_GRADS] == 2 * device_stepped(runs[0][0]) > 0
    assert "gradient accumulators" not in memory["device"]
    check_bitwise(runs[0], runs[1])


def _train_with_norms(rank, world, **kwargs):
    """train_engine, with each step's global gradient norm."""
    norms = []
    return train_engine(rank, world, after_step=lambda i, engine: norms.append(engine.get_global_grad_norm()),
                        finished=lambda engine: {"norms": norms}, **kwargs)


@pytest.mark.parametrize("world", [1, 2])
def test_on_the_emulated_gpu_a_split_keeping_16_bit_gradients_steps_as_the_whole_offload(world):
    """The GPU's path (the device's norm and torch's fused Adam, each reading the gradient widened and scaled one
    unit at a time; at two ranks by the factor 1/2 that averages them): each step's global norm is the whole
    offload's (whose host parts are float64 sums) to float32 rounding, and the training its own to bf16's."""
    runs = {}
    for ratio in (0.5, 1.0):
        config = ratio_config(world, 1, ratio)
        config["bf16"] = {"enabled": True}
        runs[ratio] = run_ranks(_train_with_norms, world, env=EMULATED_GPU, name="gpt", config=config, steps=3,
                                micro=2, accum=1)
    memory = runs[0.5][0]["memory"]
    assert memory["device"][KEPT_GRADS] == 2 * device_stepped(runs[0.5][0]) > 0
    torch.testing.assert_close(torch.tensor(runs[0.5][0]["norms"]), torch.tensor(runs[1.0][0]["norms"]),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(runs[0.5][0]["losses"]), torch.tensor(runs[1.0][0]["losses"]),
                               rtol=0, atol=0.02)


def test_with_gradient_accumulation_or_fp32_the_device_keeps_fp32_accumulators():
    for accum, bf16 in ((2, True), (1, False)):
        config = ratio_config(1, accum, 0.5)
        if bf16:
            config["bf16"] = {"enabled": True}
        result = train_engine(0, 1, name="gpt", config=config, steps=1, micro=2, accum=accum)
        memory = result["memory"]
        assert memory["device"]["gradient accumulators"] == 4 * device_stepped(result) > 0
        assert KEPT_GRADS not in memory["device"]


def test_the_refit_counts_a_kept_gradient_at_its_two_bytes():
    """offload/engine/refit.py: a unit moving to the device costs its state and the gradient it will keep there, so
    the same room takes more units where the gradient is 16-bit and kept than where it is an fp32 accumulator."""
    from offload.engine.refit import refit_choice
    from offload.store.sub_groups import plan_sub_groups
    groups = plan_sub_groups([(i, 1000) for i in range(10)], 3000)
    per_unit = {grad: 12 * 1000 + grad * 1000 + 2 * 1000 for grad in (2, 4)}
    spare = 5 * per_unit[2]
    for grad in (2, 4):
        chosen = refit_choice(groups, spare, lambda unit: 2 * 1000, frozenset(), grad)
        assert sum(count for _, count in chosen) == spare // per_unit[grad]


def test_what_the_estimate_plans_for_kept_gradients_is_what_initialize_keeps(tmp_path):
    from engine_cases import make_model

    from offload.commands.estimate import estimate, model_units
    from offload.config import Config
    config, _ = split_config(tmp_path, 1, 1, 0.5, "cpu")
    config["bf16"] = {"enabled": True}
    memory = train_engine(0, 1, name="gpt", config=config, steps=1, micro=2, accum=1)["memory"]
    resolved = Config.load(config).resolve(world_size=1)
    est = estimate(model_units(make_model("gpt"), resolved), resolved, 1, discrete=False)
    assert est.tiers["device"][KEPT_GRADS] == memory["device"][KEPT_GRADS] > 0
