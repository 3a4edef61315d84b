"""#72: `offload bench all`'s summary says what each figure compares (offload/bench/comparison.py): every row
named whole, its baseline and which way is better carried as data, so the printed summary, all.json and
summary.png read as the detailed table does."""

import dataclasses

import pytest

from offload.bench import adam
from offload.bench.comparison import RATE, TIME, Comparison, grouped, summary_lines
from offload.bench.suite import SuiteResult, adam_headlines, plot
from offload.store.state_format import FORMATS


@pytest.fixture(scope="module")
def adam_report():
    return adam.run([100_000], repeats=1)


def test_the_adam_rows_say_what_each_ratio_compares(adam_report):
    """Three meanings once shared one field: a speed-up against torch, a time against the fp32 state's, a cold
    step against its floor. Each row now names its own."""
    by_what: dict[str, list[Comparison]] = {}
    for row in adam_report.rows:
        if row.versus is not None:
            by_what.setdefault(row.what, []).append(row.versus)
    assert {c.baseline for c in by_what["adam"]} == {"torch AdamW fused=True"}
    assert all(c.quantity == RATE and not c.lower_is_better and c.subject.startswith("offload adam_step")
               for c in by_what["adam"])
    assert [c.quantity for c in by_what["cpu-side"]] == [RATE]
    assert by_what["cpu-side"][0].baseline.startswith("torch float()+clip+fused AdamW")
    formats = by_what["format"]
    assert all(c.quantity == TIME and c.lower_is_better and c.baseline == adam.FP32_SIDE for c in formats)
    # every format but fp32 (compared with itself it says nothing), each named
    assert sorted(c.subject for c in formats) == sorted(
        f"state format {name}" for name in FORMATS if name != "fp32")
    assert all(c.quantity == TIME and c.baseline.startswith("its compute floor") for c in by_what.get("compute", []))
    assert all(c.size == "0.1M elements" for cs in by_what.values() for c in cs)


def test_the_summary_keeps_every_row_and_heads_each_group_with_its_baseline_and_direction(adam_report):
    headlines = adam_headlines(adam_report)
    labels = [c.label for c in headlines]
    assert len(labels) == len(set(labels)) == sum(1 for r in adam_report.rows if r.versus is not None)
    lines = summary_lines(headlines)
    headers = [line for line in lines if not line.startswith("    ")]
    assert "  adam: against torch AdamW fused=True (rate, higher is better)" in headers
    assert f"  adam: against {adam.FP32_SIDE} (time, lower is better)" in headers
    for c in headlines:  # each figure printed once, under its own group's header
        at = next(i for i, line in enumerate(lines)
                  if line.startswith(f"    {c.label} ") and line.endswith(f"{c.value:6.2f}x"))
        header = next(line for line in reversed(lines[:at]) if not line.startswith("    "))
        assert c.baseline in header and c.better in header


def test_a_summary_of_known_rows_reads_right_and_draws(tmp_path):
    rows = [Comparison("adam", "offload adam_step (avx512)", "torch AdamW fused=True", RATE, 6.0, "10M elements"),
            Comparison("adam", "state format bf16 moments", "the fp32 state", TIME, 0.84, "10M elements"),
            Comparison("adam", "state format 16+16", "the fp32 state", TIME, 0.77, "10M elements"),
            Comparison("step", "offload, params and optimizer state on cpu", "plain PyTorch's step", TIME, 0.17)]
    assert [c.wins for c in rows] == [True, True, True, True]
    assert not Comparison("step", "x", "y", TIME, 1.3).wins and not Comparison("pcie", "x", "y", RATE, 0.9).wins
    assert rows[1].reads() == "0.84x the time of the fp32 state (lower is better)"
    assert rows[0].reads() == "6.00x the rate of torch AdamW fused=True (higher is better)"
    assert list(grouped(rows)) == [("adam", "torch AdamW fused=True", RATE), ("adam", "the fp32 state", TIME),
                                   ("step", "plain PyTorch's step", TIME)]
    assert summary_lines(rows) == [
        "  adam: against torch AdamW fused=True (rate, higher is better)",
        "    offload adam_step (avx512) at 10M elements    6.00x",
        "  adam: against the fp32 state (time, lower is better)",
        "    state format bf16 moments at 10M elements    0.84x",
        "    state format 16+16 at 10M elements           0.77x",
        "  step: against plain PyTorch's step (time, lower is better)",
        "    offload, params and optimizer state on cpu    0.17x"]
    suite = SuiteResult(machine={"cpu": "test", "gpu": None}, quick=True, headlines=rows)
    plot(suite, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert dataclasses.asdict(suite)["headlines"][1] == {
        "bench": "adam", "subject": "state format bf16 moments", "baseline": "the fp32 state", "quantity": "time",
        "value": 0.84, "size": "10M elements"}


def test_a_quantity_that_is_neither_time_nor_rate_is_refused():
    with pytest.raises(ValueError, match="quantity is one of"):
        Comparison("adam", "x", "y", "speed", 1.0)
