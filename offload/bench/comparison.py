"""What a benchmark's figure compares, carried as data: its subject, its baseline, the quantity and so the direction.

A ratio alone does not say whether 0.8 is good. Time ratios are better below 1 and rate ratios (throughput,
bandwidth) above it. When a field's meaning depends on the row it sits in, a summary that collects the rows can
only guess. So every figure that leaves a benchmark for the summary, the JSON and the picture is a
``Comparison``: what was measured (``subject``, named whole: the format, the variant, the engine), against what
(``baseline``), at what size, and which quantity. The direction comes from the quantity alone, so the three
outputs cannot disagree with each other or with the detailed table.
"""

from __future__ import annotations

from dataclasses import dataclass

TIME = "time"  # subject's time over the baseline's: lower is better
RATE = "rate"  # subject's throughput or bandwidth over the baseline's: higher is better
QUANTITIES = (TIME, RATE)


@dataclass(frozen=True)
class Comparison:
    """One figure: ``value`` is the subject's ``quantity`` over the baseline's (``TIME`` or ``RATE``)."""

    bench: str  # the benchmark it came from: adam, nvme, pcie, step
    subject: str  # what was measured, named whole
    baseline: str  # what it is measured against
    quantity: str  # TIME or RATE
    value: float
    size: str = ""  # the size it was measured at, where the bench has several ("10M elements")

    def __post_init__(self) -> None:
        if self.quantity not in QUANTITIES:
            raise ValueError(f"a comparison's quantity is one of {QUANTITIES}, not {self.quantity!r}")

    @property
    def lower_is_better(self) -> bool:
        return self.quantity == TIME

    @property
    def better(self) -> str:
        return "lower is better" if self.lower_is_better else "higher is better"

    @property
    def wins(self) -> bool:
        """Whether the subject beats its baseline."""
        return self.value < 1 if self.lower_is_better else self.value > 1

    @property
    def label(self) -> str:
        return f"{self.subject}" + (f" at {self.size}" if self.size else "")

    def reads(self) -> str:
        """The figure as a sentence's end: '0.84x the time of the fp32 state (lower is better)'."""
        what = "the time of" if self.lower_is_better else "the rate of"
        return f"{self.value:.2f}x {what} {self.baseline} ({self.better})"


def summary_lines(comparisons: list[Comparison]) -> list[str]:
    """The summary's text: grouped by benchmark and baseline, each group headed once by what it compares with,
    then one line per figure, named whole."""
    lines = []
    for (bench, baseline, quantity), group in grouped(comparisons).items():
        lines.append(f"  {bench}: against {baseline} ({quantity}, {group[0].better})")
        width = max(len(c.label) for c in group)
        for c in group:
            lines.append(f"    {c.label:<{width}}  {c.value:6.2f}x")
    return lines


def grouped(comparisons: list[Comparison]) -> dict[tuple[str, str, str], list[Comparison]]:
    """The comparisons by (bench, baseline, quantity), in the order they came."""
    groups: dict[tuple[str, str, str], list[Comparison]] = {}
    for c in comparisons:
        groups.setdefault((c.bench, c.baseline, c.quantity), []).append(c)
    return groups
