"""`offload bench hooks` runs end to end and counts the hook calls it divides by; telemetry spans reach a torch
profiler only while one records."""

import json

import torch

from offload.commands.cli import main
from offload.observe.telemetry import Telemetry


def test_bench_hooks_writes_every_row_with_the_calls_it_divides_by(tmp_path, capsys):
    out = tmp_path / "hooks.json"
    assert main(["bench", "hooks", "--layers", "4", "--rounds", "1", "--iterations", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["placement"], r["tracing"], r["phase"]) for r in rows} == {
        (p, t, phase) for p in ("device", "host") for t in (False, True) for phase in ("forward", "backward")}
    for r in rows:
        # 4 layers, one unit each: a pre- and a post-hook per forward; a pre-backward and two gradient hooks
        # (weight, bias) per backward.
        assert r["calls_per_pass"] == (8 if r["phase"] == "forward" else 12)
        assert r["within_budget"] == (r["us_per_call"] <= result["budget_us_per_call"])
    assert "us/call" in capsys.readouterr().out


def test_bench_hooks_rejects_a_layer_below_the_unit_floor(capsys):
    assert main(["bench", "hooks", "--layers", "1"]) == 2
    assert "layers >= 2" in capsys.readouterr().err


def test_spans_are_profiler_ranges_only_while_a_profiler_records():
    telemetry = Telemetry()
    with telemetry.span("gather", "unit0"):
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with telemetry.span("gather", "unit1"):
            torch.ones(4).sum()
    names = {e.name for e in prof.events()}
    assert "offload::gather (unit1)" in names
    assert telemetry.snapshot().counts["gather"] == 2  # counted either way


def test_spans_open_no_profiler_range_when_none_records(monkeypatch):
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler recording")
    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    telemetry = Telemetry()
    with telemetry.span("reduce_scatter", "unit0"):
        pass
    assert telemetry.snapshot().counts["reduce_scatter"] == 1
