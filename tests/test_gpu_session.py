"""tools/gpu_session.sh is run only on a lent GPU machine, minutes at a time: a plan naming a stage the script
does not know, or a syntax error, would waste a loan. Checked here, where there is time."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "gpu_session.sh"


def _text() -> str:
    return SCRIPT.read_text()


def _stage_arms(text: str) -> set[str]:
    """The stage names the dispatching `case` runs (its arms with a name, not the plans or the catch-all)."""
    dispatch = text[text.index('for s in "${stages[@]}"; do'):]
    return set(re.findall(r"^\s{4}([a-z0-9-]+)\)", dispatch, re.M))


def _plans(text: str) -> dict[str, list[str]]:
    return {name: body.split() for name, body in re.findall(r"^\s{4}(plan\w+)\) stages\+=\(([^)]*)\)", text, re.M)}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_plan_names_known_stages():
    text = _text()
    arms, plans = _stage_arms(text), _plans(text)
    assert {"plan1", "plan44a", "plan44b", "plan55", "plan59"} <= set(plans) and arms
    unknown = {plan: [s for s in stages if s not in arms] for plan, stages in plans.items()}
    assert not any(unknown.values()), f"plans name stages the script does not run: {unknown}"


def test_the_header_lists_every_stage():
    """The header is what a session reads before a loan: every stage it lists must exist, and every stage must be
    listed (the plans and the `wheels` verb, run here, aside)."""
    text = _text()
    header = text[text.index("# Every stage by name"):text.index("set -uo pipefail")]
    listed = set()
    for line in header.splitlines():
        if re.fullmatch(r"#   [a-z0-9 -]+", line):
            listed |= set(line[1:].split())
    arms = _stage_arms(text) - {"wheels"}
    assert listed == arms, f"listed but not run: {sorted(listed - arms)}; run but not listed: {sorted(arms - listed)}"
