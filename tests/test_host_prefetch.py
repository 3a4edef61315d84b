"""#68's host lane on every CPU: whether the host's Adam prefetches in software is chosen on the CPU that runs it,
from a measurement kept per CPU model (see [Note: prefetch by measurement] in offload/machine/prefetch.py), or fixed
by offload.host_prefetch; it changes no value."""

import json
import logging

import pytest
import torch

from offload.config import Config, ConfigError
from offload.machine import native, prefetch
from offload.optim import AdamHyper, adam_step
from offload.store.state_format import split_master


@pytest.fixture(autouse=True)
def _restore():
    before = native.prefetch_ahead()
    yield
    native.set_prefetch(before)


@pytest.mark.parametrize("fmt", ["fp32", "16+16 bf16 moments"])
def test_the_step_is_bitwise_the_same_however_far_ahead_it_prefetches(fmt):
    gen = torch.Generator().manual_seed(0)
    n = 100_003  # a ragged tail past the last vector
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    hyper = AdamHyper(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    results = []
    for ahead in (None, 0, 64, 4096):
        native.set_prefetch(ahead)
        if fmt == "fp32":
            state = [p0.clone(), torch.zeros(n), torch.zeros(n)]
            lo = None
        else:
            hi, lo = split_master(p0)
            state = [hi, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
        for step in (1, 2, 3):
            adam_step(*state[:1], g, *state[1:], step, hyper, threads=2, master_lo=lo)
        results.append([t.clone() for t in state] + ([lo.clone()] if lo is not None else []))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits))


def test_prefetching_is_kept_only_where_it_is_measurably_faster():
    assert prefetch.decide(0.85, 1.0)  # the Xeon's 0.82-0.89x
    assert not prefetch.decide(1.10, 1.0)  # the Zen 5 EPYC's 1.10x
    assert not prefetch.decide(0.99, 1.0)  # a tie within the margin: the hardware's own prefetchers
    with pytest.raises(native.NativeError, match="prefetch is a count of elements ahead"):
        native.set_prefetch(-1)


def test_on_and_off_are_taken_as_said_and_auto_measures_once_per_cpu(tmp_path, monkeypatch):
    cache = tmp_path / "host_prefetch.json"
    assert prefetch.choose("off", 2, cache).prefetch is False and native.prefetch_ahead() == 0
    assert prefetch.choose("on", 2, cache).prefetch is True and native.prefetch_ahead() is None
    assert not cache.exists()
    calls = []

    def measured(threads):
        calls.append(threads)
        return 0.8, 1.0  # prefetching faster
    monkeypatch.setattr(prefetch, "measure", measured)
    first = prefetch.choose("auto", 2, cache)
    assert first.prefetch and first.source == "measured" and native.prefetch_ahead() is None
    again = prefetch.choose("auto", 2, cache)
    assert again.source == "cached" and again.prefetch and calls == [2]
    assert "cached: 800.0 ms a pass prefetching, 1000.0 ms not" in again.describe()
    prefetch.choose("auto", 3, cache)  # another thread count is another measurement
    assert calls == [2, 3] and set(json.loads(cache.read_text())) == {prefetch.cpu_key(2), prefetch.cpu_key(3)}
    with pytest.raises(ValueError, match="offload.host_prefetch is one of auto, on, off"):
        prefetch.choose("sometimes", 2, cache)


def test_a_damaged_or_unwritable_cache_never_stops_a_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "measure", lambda threads: (1.2, 1.0))
    cache = tmp_path / "host_prefetch.json"
    cache.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="offload.engine"):
        choice = prefetch.choose("auto", 2, cache)
    assert not choice.prefetch and native.prefetch_ahead() == 0 and "not a readable prefetch cache" in caplog.text
    assert json.loads(cache.read_text())[prefetch.cpu_key(2)]["prefetch"] is False  # rewritten whole
    cache.write_text(json.dumps({"x": 3}))
    assert prefetch.choose("auto", 2, cache).source == "measured"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert prefetch.choose("auto", 2, blocked / "sub" / "cache.json").source == "measured"  # not kept, still chosen
    monkeypatch.setattr(prefetch, "measure", lambda threads: pytest.fail("measured again in the same process"))
    assert prefetch.choose("auto", 2, blocked / "sub" / "cache.json").prefetch is False  # this process remembers


def test_the_real_measurement_times_both_and_the_config_key_is_checked():
    with_s, without_s = prefetch.measure(1)
    assert 0 < with_s < 10 and 0 < without_s < 10
    assert Config.load({}).offload.host_prefetch == "auto"
    with pytest.raises(ConfigError, match="offload.host_prefetch"):
        Config.load({"offload": {"host_prefetch": "sometimes"}})


def test_an_engine_with_the_optimizer_offloaded_takes_the_configs_choice_and_says_it(caplog):
    from engine_cases import base_config, train_engine
    config = base_config(2, 1, 1)
    config["offload"]["host_prefetch"] = "off"
    with caplog.at_level(logging.INFO, logger="offload.engine"):
        train_engine(0, 1, name="gpt", config=config, steps=1, micro=2, accum=1)
    assert native.prefetch_ahead() == 0
    assert "the host's Adam leaves prefetching to the hardware (offload.host_prefetch)" in caplog.text
