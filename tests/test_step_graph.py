"""A recorded step graph holds the step's work as the engine ran it (FLOPs, bytes, which thread, after what), and the
replay times such a graph as its lanes and links say (see [Note: recorded step graph] in
offload/observe/step_graph.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from offload.bench import replay as R
from offload.commands.cli import main

TINY = dict(hidden=64, layers=2, heads=2, vocab=512, seq=32, micro=2, dtype="fp32", unit_bytes=4096, steps=2)


def _items(data, lane=None, kind=None):
    return [i for name, items in data["lanes"].items() if lane in (None, name) for i in items
            if kind in (None, i["kind"])]


def _plain_flops() -> tuple[float, int]:
    """FLOPs of the same GPT's forward and backward on the same batch, and its parameter count."""
    from torch.utils.flop_counter import FlopCounterMode

    from offload.bench.step import StepBench, batches
    from offload.models import GPT
    b = StepBench(**{k: TINY[k] for k in ("hidden", "layers", "heads", "vocab", "seq", "micro")}, world=1)
    torch.manual_seed(0)
    model = GPT(b.model_config())
    rows = batches(b, 1, b.micro)[0]
    with FlopCounterMode(display=False) as counter:
        model(rows[:, :-1], rows[:, 1:]).backward()
    return counter.get_total_flops(), sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The tiny GPT recorded with device-homed shards (synchronous step), host-homed ones (early step), and
    device-homed ones speculated during backward (clipping that never fires) and stepped early."""
    out = tmp_path_factory.mktemp("step_graphs")
    return {mode: R.record(R.ScheduleBench(**TINY, params=params, early=early, speculative=speculative, clip=clip),
                           out / f"{mode}.json")
            for mode, params, early, speculative, clip in (("sync", "none", "off", "off", 1.0),
                                                           ("early", "cpu", "on", "off", 1.0),
                                                           ("speculative", "none", "on", "on", 1e9))}


def test_the_step_graph_holds_the_models_flops_and_every_shards_bytes_once_a_step(recorded):
    flops, params = _plain_flops()
    steps = TINY["steps"]
    for mode, data in recorded.items():
        compute = _items(data, "compute")
        recorded_flops = sum(i.get("flops", 0) for i in compute if i["kind"] in ("forward", "backward"))
        assert recorded_flops == pytest.approx(steps * flops, rel=1e-9), mode
        assert sum(i.get("flops", 0) for i in compute if i["kind"] == "backward") > \
            sum(i.get("flops", 0) for i in compute if i["kind"] == "forward"), mode
        # fp32, W = 1: each shard's gradient leaves once a step, and Adam streams 32 bytes per element.
        d2h = sum(i["nbytes"] for i in _items(data, "d2h", "d2h"))
        assert params * 4 * steps <= d2h <= params * 4 * steps * 1.02, mode
        adam = sum(i["nbytes"] for i in _items(data, kind="adam"))
        assert params * 32 * steps <= adam <= params * 32 * steps * 1.02, mode
    # Device homes get their new shards back once a step; host homes come over before each use instead.
    assert params * 4 * steps <= sum(i["nbytes"] for i in _items(recorded["sync"], "h2d", "h2d")) <= \
        params * 4 * steps * 1.02
    assert sum(i["nbytes"] for i in _items(recorded["early"], "param-h2d", "h2d")) >= params * 4 * steps


def test_the_synchronous_step_runs_adam_on_the_training_thread_and_the_early_one_on_the_worker(recorded):
    sync, early = recorded["sync"], recorded["early"]
    assert {lane for lane, items in sync["lanes"].items() if any(i["kind"] == "adam" for i in items)} == {"host"}
    assert {lane for lane, items in early["lanes"].items() if any(i["kind"] == "adam" for i in items)} == \
        {"grad-land"}
    # The early step's forward waits on the training thread for the worker's record of each unit's step.
    records = {i["record"]: lane for lane, items in early["lanes"].items() for i in items if "record" in i}
    host_waits = [records.get(rid) for i in _items(early, "host", "wait") for rid in i.get("waits", ())]
    assert "grad-land" in host_waits


def test_the_speculative_adam_runs_on_its_lane_or_the_early_steps_never_on_the_training_thread(recorded):
    """Each speculation runs on the speculation lane unless the early step (on the landing worker) claimed the
    shard first (see [Note: speculation on a lane of its own])."""
    lanes = {lane for lane, items in recorded["speculative"]["lanes"].items()
             if any(i["kind"] == "adam" for i in items)}
    assert lanes and lanes <= {"speculate", "grad-land"}
    assert recorded["speculative"]["lane_kinds"]["speculate"] == "host"


def test_every_copy_waits_for_what_it_reads_and_every_link_points_backwards(recorded):
    for mode, data in recorded.items():
        lanes = data["lanes"]
        where = {i["record"]: (lane, n) for lane, items in lanes.items() for n, i in enumerate(items) if "record" in i}
        for lane, items in lanes.items():
            for n, item in enumerate(items):
                if item.get("issued"):
                    issuing, at = item["issued"]
                    assert at <= len(lanes[issuing]), (mode, lane, n)
        # A gradient's D2H copy is ordered after its reduction on the compute stream.
        d2h = lanes["d2h"]
        for n, item in enumerate(d2h):
            if item["kind"] == "d2h":
                waits = [rid for i in d2h[:n] if i["kind"] == "wait" for rid in i.get("waits", ())]
                assert waits and where[waits[-1]][0] == "compute", (mode, n)


def test_replay_of_the_recording_finishes_and_scales_compute_with_tokens(recorded):
    machine = R.MACHINES["h100"]
    for data in recorded.values():
        base = R.replay(data, machine)
        more = R.replay(data, machine, tokens=data["meta"]["tokens"] * 1000)
        assert base.steps == TINY["steps"]
        assert more.lane_busy_ms["compute"] > 100 * base.lane_busy_ms["compute"]
        assert more.lane_busy_ms["d2h"] == pytest.approx(base.lane_busy_ms["d2h"])
        assert more.step_ms >= base.step_ms


def test_recording_needs_a_discrete_device_and_leaves_the_environment_as_it_was(monkeypatch):
    from offload.machine.accelerator import Accelerator
    monkeypatch.delenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="OFFLOAD_EMULATED_DISCRETE_DEVICE=1"):
        Accelerator("cpu").start_graph()
    R.record(R.ScheduleBench(**{**TINY, "steps": 1}), Path("/dev/null"))
    import os
    assert "OFFLOAD_EMULATED_DISCRETE_DEVICE" not in os.environ


# ----------------------------------------------------------------- the replay on graphs made by hand


def _graph(lanes, kinds, tokens=1, world=1):
    return {"format": "offload-schedule/1", "meta": {"tokens": tokens, "world": world}, "lane_kinds": kinds,
            "lanes": lanes}


MACHINE = R.Machine(device_tflops=1.0, device_gbps=1.0, h2d_gbps=1.0, d2h_gbps=0.5, host_gbps=2.0, link_gbps=1.0,
                    hook_forward_us=1000.0, hook_backward_us=2000.0, hook_step_us=0.0)


def test_replay_waits_for_records_and_issue_points_and_finds_the_critical_path():
    lanes = {
        "host": [{"kind": "mark", "label": "forward"}, {"kind": "hook_forward"}, {"kind": "hook_forward"}],
        # 1e9 FLOPs at 1 TFLOP/s: 1 ms, issued after the first hook (1 ms), recorded as 7.
        "compute": [{"kind": "forward", "flops": 1e9, "issued": ["host", 2]},
                    {"kind": "record", "record": 7, "issued": ["host", 2]}],
        # 1e6 bytes at 0.5 GB/s: 2 ms, after compute's record 7 (2 ms).
        "d2h": [{"kind": "wait", "waits": [7], "issued": ["host", 2]}, {"kind": "d2h", "nbytes": 1_000_000}],
        # 4e6 bytes at 2 GB/s: 2 ms, issued at the host's start; a record from outside the window is done.
        "land": [{"kind": "wait", "waits": [99], "issued": ["host", 1]}, {"kind": "adam", "nbytes": 4_000_000}],
    }
    r = R.replay(_graph(lanes, {"host": "host", "compute": "device", "d2h": "copy", "land": "host"}), MACHINE)
    assert r.total_ms == pytest.approx(4.0)
    assert r.lane_busy_ms == pytest.approx({"host": 2.0, "compute": 1.0, "d2h": 2.0, "land": 2.0})
    assert r.critical_ms == pytest.approx({"d2h/d2h": 2.0, "compute/forward": 1.0, "host/hook_forward": 1.0})
    # With the D2H copy free, the forward's end (2 ms) and the host's Adam (2 ms) set the time.
    what_if = R.replay(_graph(lanes, {"host": "host", "compute": "device", "d2h": "copy", "land": "host"}),
                       MACHINE, free=frozenset({"d2h"}))
    assert what_if.total_ms == pytest.approx(2.0) and what_if.lane_busy_ms["d2h"] == 0.0
    with pytest.raises(ValueError, match="unknown kind"):
        R.replay(_graph(lanes, {}), MACHINE, free=frozenset({"bogus"}))
    scaled = R.replay(_graph(lanes, {"host": "host", "compute": "device", "d2h": "copy", "land": "host"},
                             tokens=2), MACHINE, tokens=6)
    assert scaled.lane_busy_ms["compute"] == pytest.approx(3.0)
    assert scaled.total_ms == pytest.approx(6.0)


def test_copies_in_one_direction_share_the_bus_whichever_stream_issues_them():
    """#68: the parameters' and the streamed state's copies up run on streams of their own but over one bus: the
    replay serialises them (1e6 bytes at 1 GB/s: 1 ms each), while the copy down runs beside them."""
    lanes = {"host": [{"kind": "mark", "label": "forward"}],
             "param-h2d": [{"kind": "h2d", "nbytes": 1_000_000}],
             "state-h2d": [{"kind": "h2d", "nbytes": 1_000_000}],
             "state-d2h": [{"kind": "d2h", "nbytes": 500_000}]}
    r = R.replay(_graph(lanes, dict.fromkeys(lanes, "copy")), MACHINE)
    assert r.total_ms == pytest.approx(2.0)
    assert r.lane_busy_ms["param-h2d"] == r.lane_busy_ms["state-h2d"] == pytest.approx(1.0)
    assert r.critical_ms == pytest.approx({"state-h2d/h2d": 1.0, "param-h2d/h2d": 1.0})


REPLAY_ORDER = """
import sys
sys.path.insert(0, sys.argv[1])
import offload.bench.replay as R
from test_step_graph import MACHINE, _graph
lanes = {"host": [{"kind": "mark", "label": "forward"}], "compute": []}
for i in range(1, 6):  # compute records at 1..5 ms; a read of state waits for each
    lanes["compute"] += [{"kind": "forward", "flops": 1e9}, {"kind": "record", "record": i}]
    lanes[f"read-{i}"] = [{"kind": "wait", "waits": [i]}, {"kind": "h2d", "nbytes": 1_000_000}]
lanes["gather"] = [{"kind": "h2d", "nbytes": 1_000_000} for _ in range(5)]  # ready at once, 1 ms each
print(R.replay(_graph(lanes, {k: "copy" for k in lanes} | {"host": "host", "compute": "device"}), MACHINE).total_ms)
"""


def test_the_replay_gives_the_bus_to_the_copy_ready_first_in_every_process():
    """[Note: the replay's order]: the gathers, ready at once, take the bus first (0-5 ms) and the reads after
    (5-10 ms), whatever order a set of lane names comes in. Placed lane by lane, the bus went to whichever copy the
    replay reached first, and that order was the lane names' hashes: PYTHONHASHSEED 3 made this 15 ms, and a
    recorded step 322 to 461 ms from one process to the next."""
    here = str(Path(__file__).parent)
    totals = {subprocess.run([sys.executable, "-c", REPLAY_ORDER, here], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in range(4)}
    assert len(totals) == 1 and float(totals.pop()) == pytest.approx(10.0)


def test_the_streamed_lane_is_recorded_as_copies_each_way_and_takes_adam_off_the_host(tmp_path):
    """#68: recorded with offload.stream_state auto at the h100 preset's rates (given to the emulated device), the
    streamed units' state crosses on lanes of its own, each way, byte for byte what the engine counted, and the
    host's Adam shrinks by their share."""
    machine, runs = R.MACHINES["h100"], {}
    for stream in (0.0, "auto"):
        data = R.record(R.ScheduleBench(**TINY, params="cpu", clip=0.0, stream=stream), tmp_path / f"{stream}.json",
                        machine=machine)
        runs[stream] = (data, R.replay(data, machine))
    data, streamed = runs["auto"]
    up = [i for i in data["lanes"]["state-h2d"] if i["kind"] == "h2d"]
    down = [i for i in data["lanes"]["state-d2h"] if i["kind"] in ("d2h",)]
    assert up and down and all(i["nbytes"] > 0 for i in up + down)
    assert sum(i["nbytes"] for i in up) <= sum(i["nbytes"] for i in down)  # the new weights go down too
    def adam_bytes(d, where):  # the Adam items' bytes on the device's lanes or the host's
        return sum(i.get("nbytes", 0) for lane, items in d["lanes"].items() for i in items
                   if i["kind"] == "adam" and (d["lane_kinds"][lane] == "device") == (where == "device"))
    host_only, _ = runs[0.0]
    assert adam_bytes(host_only, "device") == 0 and "state-h2d" not in host_only["lanes"]
    assert adam_bytes(data, "host") < adam_bytes(host_only, "host") and adam_bytes(data, "device") > 0
    assert streamed.lane_busy_ms["state-h2d"] > 0


def test_replay_says_which_lanes_can_never_finish():
    lanes = {"a": [{"kind": "wait", "waits": [2]}, {"kind": "record", "record": 1}],
             "b": [{"kind": "wait", "waits": [1]}, {"kind": "record", "record": 2}]}
    with pytest.raises(ValueError, match="cannot finish"):
        R.replay(_graph(lanes, {"a": "copy", "b": "copy"}), MACHINE)


def test_machine_overrides_are_checked():
    assert R.machine_from("h100", {"h2d_gbps": 25.0}).h2d_gbps == 25.0
    with pytest.raises(ValueError, match="unknown machine"):
        R.machine_from("a100", {})
    with pytest.raises(ValueError, match="must be > 0"):
        R.machine_from("h100", {"host_gbps": 0.0})


# ----------------------------------------------------------------- the commands


def test_bench_schedule_and_replay_commands_write_their_files(tmp_path, capsys):
    schedule, replayed = tmp_path / "s.json", tmp_path / "r.json"
    assert main(["bench", "schedule", "--hidden", "64", "--layers", "2", "--seq", "32", "--vocab", "512", "--micro",
                 "2", "--dtype", "fp32", "--unit-bytes", "4Ki", "--steps", "1", "--out", str(schedule)]) == 0
    assert main(["bench", "replay", str(schedule), "--tokens", "4096", "--host-gbps", "20", "--out",
                 str(replayed)]) == 0
    result = json.loads(replayed.read_text())
    assert result["tokens"] == 4096 and result["machine"]["host_gbps"] == 20.0 and "spans" not in result
    assert "critical path" in capsys.readouterr().out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the lanes drawn beside it
    assert Counter(json.loads(schedule.read_text())["lane_kinds"].values())["copy"] == 2


def test_replay_refuses_what_is_not_a_schedule(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert main(["bench", "replay", str(bad)]) == 2
    assert "is not a schedule recorded by offload" in capsys.readouterr().err
    assert main(["bench", "replay", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_split_beside_host_parameters_replays_nearer_the_max_of_its_lanes_than_their_sum(tmp_path):
    """#44, on the H100 preset: host parameters and optimizer without clipping (Adam overlapped with backward), all
    of the state on the host beside ratio auto under a device budget that keeps part of it (and those units'
    shards) on the GPU. Both steps take less than their lanes' sum (the stages overlap); the split moves Adam and
    copies off the host's lanes, and its step is the shorter. The replay prices recorded shapes at the preset's
    rates: no time is measured here."""
    machine, runs = R.MACHINES["h100"], {}
    for ratio in (1.0, "auto"):
        data = R.record(R.ScheduleBench(**TINY, params="cpu", clip=0.0, overlap="on", ratio=ratio,
                                        device_budget=1_600_000), tmp_path / f"{ratio}.json")
        runs[ratio] = R.replay(data, machine, tokens=data["meta"]["tokens"] * 1000)
        kinds = {item["kind"] for lane in data["lanes"].values() for item in lane}
        assert "adam" in kinds
    full, split = runs[1.0], runs["auto"]
    for run in (full, split):
        busy = [ms / run.steps for ms in run.lane_busy_ms.values()]
        assert max(busy) <= run.step_ms < sum(busy)
    assert split.lane_busy_ms["param-h2d"] < full.lane_busy_ms["param-h2d"]
    assert split.lane_busy_ms["grad-land"] < full.lane_busy_ms["grad-land"]
    assert split.step_ms < full.step_ms
