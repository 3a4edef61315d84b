"""The prefetcher follows the recorded order of gathers, and a step whose order changes still trains right."""

import pytest
import torch
from engine_cases import base_config
from torch import nn

import offload
from offload.machine.launch import run_ranks
from offload.zero.prefetch import PrefetchTrace


class Swapping(nn.Module):
    """Runs its two blocks in one order on even steps and the other on odd ones (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(48, 48), nn.Linear(48, 48)
        self.head = nn.Linear(48, 8)
        self.flip = False

    def forward(self, x):
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x))))).pow(2).mean()


def _train(rank, world, steps, flip_every, nvme_path=None):
    torch.manual_seed(0)
    model = Swapping()
    ref = Swapping()
    ref.load_state_dict(model.state_dict())
    config = base_config(2, 1, world, stage3_prefetch_bucket_size=10_000)
    config["offload"]["unit_bytes"] = 8192
    if nvme_path is not None:  # every shard on NVMe, fewer read buffers than units: read-ahead follows the trace
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0,
                                                        "buffer_count": 2}
    engine, *_ = offload.initialize(model=model, config=config)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(2 * world, 48, generator=gen)
        model.flip = ref.flip = (step // flip_every) % 2 == 1
        engine.backward(engine(x[rank * 2:(rank + 1) * 2]))
        engine.step()
        ref(x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    reads = engine.params.swap.stats.reads_ahead if engine.params.swap is not None else None
    out = (engine.full_state_dict(), ref.state_dict(), engine.runtime.prefetch.mismatches,
           engine.runtime.prefetched_gathers, len(engine.units), reads)
    engine.close()
    return out


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_a_changing_order_is_detected_and_training_stays_exact(tmp_path, params):
    nvme = str(tmp_path) if params == "nvme" else None
    for state, ref, mismatches, prefetched, units, reads in run_ranks(_train, 2, steps=8, flip_every=2,
                                                                       nvme_path=nvme):
        assert units == 3
        assert mismatches >= 3  # every change of order leaves the trace once
        assert prefetched > 0  # and between changes it fetches ahead
        assert (reads is None) == (params == "device") and (reads is None or reads > 0)  # NVMe reads ran ahead
        for key, value in ref.items():
            torch.testing.assert_close(state[key], value)


def test_trace_follows_then_stops_at_the_first_difference():
    trace = PrefetchTrace(lookahead=100)
    trace.begin_iteration()
    for unit in (0, 1, 2, 2, 1, 0):
        assert trace.needed(unit) == []  # the first iteration only records
    trace.begin_iteration()
    assert trace.needed(0) == [1, 2, 2, 1, 0]
    assert trace.needed(1) == [2, 2, 1, 0]
    assert trace.needed(0) == [] and trace.mismatches == 1  # order changed: on demand from here
    assert trace.needed(2) == []
    trace.begin_iteration()
    assert trace.trace == [0, 1, 0, 2]  # what actually happened is the new trace
    assert PrefetchTrace(lookahead=0).needed(3) == []
