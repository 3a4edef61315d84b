"""On a GPU: real CUDA copy streams and pinned buffers give the same training as torch on the GPU,
and the sharded model's memory high-water mark stays below plain torch's. Skipped without CUDA."""

import pytest
import torch
from engine_cases import base_config, make_model, train_engine, train_reference

import offload
from offload.store.sub_groups import STREAMED_SLOTS
from offload.store.tier import Tier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_cuda_engine_matches_torch_on_the_gpu():
    config = base_config(2, 2, 1)
    ours = train_engine(0, 1, name="gpt", config=config, steps=10, micro=2, accum=2)
    ref = train_reference("gpt", 10, 4, 2, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_state_on_the_gpu_is_stepped_there_and_matches_torch(ratio):
    """[Note: Adam on a discrete device]: the device tier's norm and Adam are torch's multi-tensor kernels on the
    GPU; all of the state there, or half beside the host's."""
    config = base_config(2, 2, 1)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    ours = train_engine(0, 1, name="gpt", config=config, steps=10, micro=2, accum=2)
    assert ours["memory"]["device"]["optimizer state"] > 0
    ref = train_reference("gpt", 10, 4, 2, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("params,stream,clip", [("none", 0.5, 1.0), ("cpu", 0.5, 0.0), ("cpu", 1.0, 1.0),
                                                 ("cpu", "auto", 1.0)])
def test_the_streamed_lane_on_the_gpu_matches_torch(params, stream, clip):
    """#68: state homed on the host, stepped on the GPU over real copy streams (the ring, the reads ahead under
    backward, the weights written down to a host home), beside the host's Adam on the rest; auto at the rates
    start-up measures here (with room bounded by a device budget: it may stream nothing, and says so)."""
    config = base_config(2, 1, 1, clip=clip)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if params != "none":
        config["zero_optimization"]["offload_param"] = {"device": params}
    config["offload"]["stream_state"] = stream
    if stream == "auto":
        config["offload"]["budgets"] = {"device": "1GiB"}
    ours = train_engine(0, 1, name="gpt", config=config, steps=6, micro=2, accum=1)
    if stream != "auto":
        assert ours["memory"]["device"][STREAMED_SLOTS] > 0
    ref = train_reference("gpt", 6, 2, 2, clip, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.5, "auto"])
def test_a_split_beside_host_parameters_on_the_gpu_matches_torch(ratio):
    """#44: the state and the shards of the first units on the GPU, the rest on the host (auto under a device
    budget that holds about half)."""
    config = base_config(2, 2, 1)
    config["zero_optimization"].update(offload_param={"device": "cpu"},
                                       offload_optimizer={"device": "cpu", "ratio": ratio})
    if ratio == "auto":
        from test_partial_offload import splitting_budget
        config["offload"]["budgets"] = {"device": splitting_budget()}
    ours = train_engine(0, 1, name="gpt", config=config, steps=10, micro=2, accum=2)
    memory = ours["memory"]
    assert memory["device"]["optimizer state"] > 0 and memory["host"]["optimizer state"] > 0
    assert memory["device"]["shards"] > 0
    ref = train_reference("gpt", 10, 4, 2, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5)


def test_a_released_parameter_on_the_gpu_is_the_empty_partition():
    """[Note: a released parameter]: host-homed units are gathered onto the GPU and released; outside forward their
    parameters are empty, never views of freed device memory."""
    config = base_config(2, 1, 1)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    tokens = torch.randint(0, 64, (2, 9), device="cuda")
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    released = [p for p in engine.module.parameters() if p.numel() == 0]
    assert released and all(p.is_cuda and p.ds_numel > 0 for p in released)
    assert float(released[0].sum()) == 0.0
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))  # training goes on
    engine.step()
    engine.close()


def test_only_what_copies_touch_is_pinned():
    """The master weights and moments are read by host threads alone: pageable (pinning them only locks pages and
    slows the start). What a copy engine reads or writes is pinned."""
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    assert engine.accel.is_cuda and engine.params.read(0).is_cuda
    group = optimizer.store.groups[0]
    assert group.tier is Tier.HOST and group.resident.master.device.type == "cpu"
    assert not group.resident.master.is_pinned()
    state = next(iter(optimizer.shards.values()))
    # The gradient's landing buffer is what the D2H copy writes: pinned. With one micro-batch a step the gradient is
    # read there, and no fp32 accumulator is ever made.
    assert state.landing is not None and state.landing.is_pinned() and state.grad is None
    assert engine.params.host_copy(state.index) is not None
    assert engine.params.host_copy(state.index).is_pinned()
    engine.close()


def test_parameters_coming_in_go_before_gradients_going_out():
    """The forward waits for the parameters' H2D copies; the D2H of gradients can wait: on a GPU the H2D streams
    have the higher priority (lower number)."""
    config = base_config(2, 1, 1)
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=config)
    assert engine.runtime.h2d.stream.priority < optimizer.landing.d2h.stream.priority
    engine.close()


def test_gradients_summed_on_the_gpu_train_bitwise_as_summed_on_the_host():
    """[Note: gradients accumulated on the device]: torch's kernels round the sum as the native kernel does (a
    product, then a fused multiply-add), so the fp32 sum brought over once equals the host's, bit for bit."""
    config = base_config(2, 3, 1, clip=0.5)
    config["bf16"] = {"enabled": True}
    host = {**config, "offload": {**config["offload"], "accumulate_on_device": False}}
    on_gpu = train_engine(0, 1, name="gpt", config=config, steps=3, micro=2, accum=3)
    on_host = train_engine(0, 1, name="gpt", config=host, steps=3, micro=2, accum=3)
    assert on_gpu["losses"] == on_host["losses"]
    for key, value in on_host["state"].items():
        assert torch.equal(on_gpu["state"][key], value), key
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    assert engine.memory_summary()["device"]["gradient accumulators"] > 0
    engine.close()


@pytest.mark.parametrize("params", ["none", "cpu"])
def test_auto_refits_after_the_first_step_into_the_memory_it_left(monkeypatch, params):
    """[Note: the split refitted]: start-up saw room for about half the state (the free memory it read is held
    low here, as if another process had held the rest until then), so auto split it; the first step's real peak on this
    GPU leaves room for all of it, so the rest moves there (with the host-homed shards, beside offloaded
    parameters), and training goes on as torch's."""
    from test_refit import split_config, splitting_free, train_refitted

    from offload.machine.accelerator import Accelerator
    config = split_config(1, 2, ratio="auto")
    config["zero_optimization"]["offload_param"] = {"device": params}
    free, real, started = splitting_free(raw=config), Accelerator.free_bytes, []
    monkeypatch.setattr(Accelerator, "free_bytes", lambda accel: real(accel) if started else free)
    ours = train_refitted(0, 1, config, steps=10, micro=2, accum=2, spare=None, started=started.append)
    assert Tier.HOST in ours["start"] and set(ours["end"]) == {Tier.DEVICE}
    ref = train_reference("gpt", 10, 4, 2, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5)


def test_start_up_measures_this_gpus_rates_and_auto_chooses_its_split_by_them(caplog):
    """[Note: rates measured at start-up]: the host's Adam, the bus each way and the device's memory, each within what
    any GPU machine has; the engine's split under a device budget is the plan's at those rates, logged with them,
    and trains as torch."""
    import logging

    from test_partial_offload import splitting_budget

    from offload.commands.estimate import model_units
    from offload.config import Config
    from offload.engine.rates import measure
    from offload.machine.accelerator import Accelerator
    from offload.store.placement import MachineOffer, Shards, plan
    from offload.zero.collectives import Group
    rates = measure(Accelerator("cuda"), None, Group(0, 1, None))
    assert 1 < rates.h2d_gbps < 1000 and 1 < rates.d2h_gbps < 1000
    assert 1 < rates.host_gbps < 2000 and 50 < rates.device_gbps < 20_000
    config = base_config(2, 2, 1)
    config["zero_optimization"].update(offload_param={"device": "cpu"},
                                       offload_optimizer={"device": "cpu", "ratio": "auto"})
    config["offload"]["budgets"] = {"device": splitting_budget()}
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        ours = train_engine(0, 1, name="gpt", config=config, steps=10, micro=2, accum=2)
    assert f"host to device {rates.h2d_gbps:,.1f} GB/s" in caplog.text and "offload's terms of a step" in caplog.text
    resolved = Config.load(config).resolve(world_size=1)
    sizes = list(enumerate(model_units(make_model("gpt"), resolved)))
    # measured once a process: the same
    expected = plan(Shards(sizes, {i for i, _ in sizes}, 4), resolved, machine=MachineOffer(rates=rates))
    assert ours["memory"]["device"]["optimizer state"] == expected.device["optimizer state"]
    assert ours["memory"]["device"]["shards"] == expected.device["shards"]
    ref = train_reference("gpt", 10, 4, 2, world=1)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)


def test_offload_states_gives_the_gpu_memory_back_and_training_goes_on_bit_for_bit():
    """#70: engine.offload_states() between steps frees the GPU's state (the device sub-groups, the parameters and
    the device gradients): torch's allocated bytes fall by what was lent; after reload_states the run is the
    unlent one's, bit for bit."""
    config = base_config(2, 1, 1)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    seen = {}

    def lend(i, engine):
        if i == 1:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            engine.offload_states()
            seen["freed"], seen["lent"] = before - torch.cuda.memory_allocated(), engine.states_offloaded
            engine.reload_states()

    plain = train_engine(0, 1, name="gpt", config=config, steps=4, micro=2, accum=1)
    lent = train_engine(0, 1, name="gpt", config=config, steps=4, micro=2, accum=1, after_step=lend)
    assert seen["lent"] > 0 and seen["freed"] >= seen["lent"]
    assert lent["losses"] == plain["losses"]
    for key, value in plain["state"].items():
        assert torch.equal(lent["state"][key], value), key


@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("where", ["ratio", "stream"])
def test_lion_and_adagrad_on_the_gpu_match_torch(tmp_path, rule, where):
    """#70: state on the GPU (half of it kept there, or streamed through it) is stepped by torch's ops in the
    reference's order, beside the host's native kernel on the rest."""
    from test_one_state import reference, rule_config
    config, hyper = rule_config(tmp_path, rule, 1, 3, "cpu", 1.0)
    if where == "ratio":
        config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    else:
        config["offload"]["stream_state"] = 0.5
    ours = train_engine(0, 1, name="gpt", config=config, steps=6, micro=2, accum=2)
    ref = reference(rule, 6, 4, 1.0, 1, **hyper)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_muon_on_the_gpu_matches_torch(ratio):
    """#70: Muon's orthogonalisation runs on the GPU for state homed on the host (all of it, or half beside state
    kept on the GPU), as torch.optim.Muon on the GPU runs it; AdamW's rate 0, as in tests/test_muon.py."""
    from test_muon import MICRO, STEPS, muon_config, reference
    config = muon_config(1, 3, "cpu", 0.0, adam_lr=0.0)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    ours = train_engine(0, 1, name="gpt", config=config, steps=STEPS, micro=MICRO, accum=1)
    ref = reference(STEPS, MICRO, 0.0, 1, adam_lr=0.0)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for key, value in ref["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("which", ["handmade", "hf-llama"])
def test_init_on_the_gpu_draws_there_as_plain_construction_under_cuda(which):
    """#71: [Note: drawing on the device]: zero.Init on a GPU draws every weight there, with the CUDA generator in
    plain construction's order: the engine starts from the weights `with torch.device("cuda"): Model()` gives, bit
    for bit, and the generator stands where that construction leaves it."""
    from test_engine_init import _Handmade, _llama
    make = _Handmade if which == "handmade" else _llama
    torch.manual_seed(0)
    with torch.device("cuda"):
        plain = make()
    plain_next = torch.rand(8, device="cuda")
    torch.manual_seed(0)
    with offload.zero.Init(min_meta_numel=1000) as init:
        model = make()
    assert init.device.type == "cuda" and sum(p.is_meta for p in model.parameters()) >= 4
    assert torch.equal(torch.rand(8, device="cuda"), plain_next)
    engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1))
    state = engine.full_state_dict()
    for key, value in plain.state_dict().items():
        if key in state:
            assert torch.equal(state[key].cpu(), value.cpu()), key
    engine.close()


class _NormalAndOwnCudaGenerator(torch.nn.Module):
    """A weight from torch.normal's size form (drawn on the host under torch.device("cuda"), which gives a device
    to constructors only), one from randn, one from a CUDA generator made as torch.Generator(device="cuda")."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.normal(0.0, 1.0, size=(64, 64)))
        self.b = torch.nn.Parameter(torch.randn(64, 64))
        self.c = torch.nn.Parameter(torch.empty(64, 64))
        torch.nn.init.normal_(self.c, generator=torch.Generator(device="cuda").manual_seed(3))


def test_init_on_the_gpu_draws_torch_normal_on_the_host_and_a_cuda_generator_there():
    """What torch.device("cuda") leaves to the host (torch.normal's size form) is drawn there, from the host's
    generator; a generator made as torch.Generator(device="cuda") (no index) draws on the GPU beside construction's,
    replayed, not handed to the initialiser: the weights and both generators as plain construction's."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        plain = _NormalAndOwnCudaGenerator()
    plain_next = (torch.rand(8), torch.rand(8, device="cuda"))
    torch.manual_seed(0)
    with offload.zero.Init(min_meta_numel=1000) as init:
        model = _NormalAndOwnCudaGenerator()
    assert init.device.type == "cuda" and model.b.is_meta
    assert torch.equal(torch.rand(8), plain_next[0]) and torch.equal(torch.rand(8, device="cuda"), plain_next[1])
    engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1))
    state = engine.full_state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key].cpu(), value.cpu()), key
    engine.close()


class _OwnGenerator(torch.nn.Module):
    """A weight drawn from the script's own host generator: not what the GPU's generator can replay."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        torch.nn.init.normal_(self.lin.weight, generator=torch.Generator().manual_seed(1))

    def forward(self, x):
        return self.lin(x).square().mean()


def test_init_on_the_gpu_gives_a_draw_from_a_host_generator_to_the_initialiser(caplog):
    """Drawing on the GPU, a draw from a host generator cannot be replayed beside the GPU's: the module's own
    initialiser makes that weight, and the warning says why."""
    with offload.zero.Init(min_meta_numel=1000) as init:
        model = _OwnGenerator()
    assert init.device.type == "cuda" and model.lin.weight.is_meta
    with caplog.at_level("WARNING", logger="offload.zero.init"):
        engine, *_ = offload.initialize(model=model, config=base_config(2, 1, 1))
    assert "drew from a generator on cpu while zero.Init draws on cuda" in caplog.text
    engine.close()
