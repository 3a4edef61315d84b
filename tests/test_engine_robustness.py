"""Edge cases found in review: tied siblings, tied modules under Init, failures inside forward and backward,
a model reused after close, and parameters read outside their module's forward."""

import pytest
import torch
from engine_cases import base_config
from torch import nn

import offload
from offload.zero import plan_units


def _config(**zero):
    config = base_config(2, 1, 1, **zero)
    config["offload"]["unit_bytes"] = 4096
    config["optimizer"]["params"] = {"lr": 1e-2}
    config["gradient_clipping"] = 0.0
    return config


class TiedSiblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight  # small siblings packed into one unit, sharing a weight
        self.big = nn.Linear(32, 32)

    def forward(self, x):
        return self.big(self.b(self.a(x)).repeat(1, 2)).pow(2).mean()


def test_a_weight_tied_between_siblings_of_one_unit_has_one_slot_and_trains_like_torch():
    torch.manual_seed(0)
    model = TiedSiblings()
    ref = TiedSiblings()
    ref.load_state_dict(model.state_dict())
    units = plan_units(model, 4096, 4)
    slots = [s.name for u in units for s in u.slots]
    assert len(slots) == len(set(id(p) for p in model.parameters())) == 5
    engine, *_ = offload.initialize(model=model, config=_config())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # the config: lr only
    x = torch.randn(4, 16)
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    state = engine.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value)
    engine.close()


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64)  # own bias, weight tied to the embedding (another unit)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens))).logsumexp(-1).mean()


def test_init_materialises_a_module_whose_weight_is_tied_into_another_unit():
    with offload.zero.Init(min_meta_numel=64):
        model = TiedHead()
    engine, *_ = offload.initialize(model=model, config=_config())
    assert len(engine.units) == 3
    state = engine.full_state_dict()
    assert torch.equal(state["head.weight"], state["emb.weight"])
    assert 0.5 < float(state["emb.weight"].std()) < 1.5  # nn.Embedding's N(0, 1), not the head's init
    engine.backward(engine(torch.randint(0, 64, (2, 5))))
    engine.step()
    engine.close()


class Boom(torch.autograd.Function):
    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if Boom.fail:
            raise RuntimeError("boom in backward")
        return grad


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
        self.used, self.unused = nn.Parameter(torch.ones(32)), nn.Parameter(torch.ones(32))

    def forward(self, x):
        return Boom.apply(self.b(self.a(x) * self.used)).pow(2).mean()


def _break_a_backward(engine, x):
    """One backward through ``Boom``, raising."""
    Boom.fail = True
    try:
        with pytest.raises(RuntimeError, match="boom in backward"):
            engine.backward(engine(x))
    finally:
        Boom.fail = False


def _train(fail_first: bool):
    torch.manual_seed(0)
    model = WithUnused()
    engine, *_ = offload.initialize(model=model, config=_config())
    x = torch.randn(4, 32)
    if fail_first:
        _break_a_backward(engine, x)
        engine.zero_grad()
    live = []
    for _ in range(3):
        loss = engine(x)
        live.append(engine.runtime.live)
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return live, state


def test_a_backward_that_raises_leaves_the_engine_usable():
    clean_live, clean = _train(False)
    live, state = _train(True)
    assert live == clean_live  # units are released after forward again
    for key, value in clean.items():
        torch.testing.assert_close(state[key], value)


def test_a_gather_that_fails_inside_forward_releases_exactly_what_it_took():
    torch.manual_seed(0)
    model = TiedHead()
    engine, *_ = offload.initialize(model=model, config=_config())
    runtime, real = engine.runtime, engine.runtime._unshard
    calls = {"emb": 0}

    def flaky(unit):
        if unit.name == "emb":
            calls["emb"] += 1
            if calls["emb"] == 2:  # the head's pre-forward gathers the tied embedding: fail there
                raise RuntimeError("simulated collective failure")
        return real(unit)

    runtime._unshard = flaky
    with pytest.raises(RuntimeError, match="simulated collective failure"):
        engine(torch.randint(0, 64, (2, 5)))
    runtime._unshard = real
    assert [u.holders for u in engine.units] == [0, 0, 0]
    engine.backward(engine(torch.randint(0, 64, (2, 5))))
    engine.step()
    engine.close()


def test_a_model_whose_engine_was_closed_cannot_start_another_and_says_why():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    engine, *_ = offload.initialize(model=model, config=_config())
    engine.close()
    with pytest.raises(ValueError, match="has no memory of its own.*full_state_dict"):
        offload.initialize(model=model, config=_config())


class ReadsChildWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)

    def forward(self, tokens):
        h = self.body(self.emb(tokens))
        return torch.nn.functional.linear(h, self.emb.weight).logsumexp(-1).mean()  # emb's weight, emb not called


def test_reading_a_child_weight_outside_its_forward_is_a_clear_error_and_atomic_modules_fixes_it(monkeypatch):
    # Host-homed shards on a discrete device are gathered and released (a device home at W = 1 is read in place).
    monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    engine, *_ = offload.initialize(model=ReadsChildWeight(), config=_config(offload_param={"device": "cpu"}))
    with pytest.raises(offload.EngineError, match="read while its unit was released.*offload.atomic_modules"):
        engine(torch.randint(0, 64, (2, 5)))
    engine.close()
    config = _config()
    config["offload"]["atomic_modules"] = ["ReadsChildWeight"]
    engine, *_ = offload.initialize(model=ReadsChildWeight(), config=config)
    assert len(engine.units) == 1
    engine.backward(engine(torch.randint(0, 64, (2, 5))))
    engine.step()
    engine.close()


class SharedMask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.lin(x) * self.mask


def test_a_buffer_shared_by_two_modules_stays_one_tensor():
    mask = torch.ones(8)
    model = nn.Sequential(SharedMask(mask), SharedMask(mask))
    engine, *_ = offload.initialize(model=model, config=_config())
    assert model[0].mask is model[1].mask
    engine.close()


def _train_stage1(fail_second_micro: bool):
    """ZeRO stage 1 with accumulation 2: the micro-batches add up in .grad, so a backward failing in the second
    one drops the first one too, and the next backward starts a new accumulation."""
    torch.manual_seed(0)
    engine, *_ = offload.initialize(model=WithUnused(), config=base_config(4, 2, 1, stage=1))
    x = torch.randn(4, 32)
    if fail_second_micro:
        engine.backward(engine(x))
        _break_a_backward(engine, x)
        with pytest.raises(offload.EngineError, match="without a backward"):
            engine.step()  # nothing is pending: the accumulation was dropped
    for _ in range(2):
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def test_a_failed_backward_in_stage_1_drops_the_whole_accumulation_and_training_goes_on_exactly():
    clean, after_failure = _train_stage1(False), _train_stage1(True)
    for key, value in clean.items():
        assert torch.equal(after_failure[key], value), key


class BreaksMidway(nn.Module):
    """Boom between two units: backward reduces the later unit's gradient, then breaks before the earlier one's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(Boom.apply(self.a(x))).pow(2).mean()


def _train_after_a_backward_broke_midway(fail: bool, ratio: float, bf16: bool):
    torch.manual_seed(0)
    config = _config(offload_optimizer={"device": "cpu", "ratio": ratio})
    config["gradient_clipping"] = 1.0  # no step overlapped with backward: a broken pass leaves it unapplied
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = offload.initialize(model=BreaksMidway(), config=config)
    x = torch.randn(2, 32, dtype=torch.bfloat16 if bf16 else torch.float32)
    if fail:
        _break_a_backward(engine, x)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("ratio,bf16", [(1.0, False), (0.0, False), (0.0, True)])
def test_a_backward_that_broke_after_some_units_reduced_leaves_nothing_of_them_in_the_retry(ratio, bf16):
    """Stage 3, one micro-batch: the units the broken pass reduced (stepped on the host, or on the device with an
    fp32 accumulator or their 16-bit gradient kept) keep nothing of it, so the retried step is the clean one, bit
    for bit."""
    clean = _train_after_a_backward_broke_midway(False, ratio, bf16)
    retried = _train_after_a_backward_broke_midway(True, ratio, bf16)
    for key, value in clean.items():
        assert torch.equal(retried[key], value), key
