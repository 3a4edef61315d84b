"""The step's schedule as one object (offload/engine/step_schedule.py): which classes a config gets, the
speculative rule's own state, and that nothing else reads the keys that choose them.

What each schedule does to training is held where it is exercised: ``Overlapped`` in test_engine_overlap.py,
``Speculative`` in test_speculative_step.py, ``Early`` in test_early_step.py (and test_early_step_readers.py),
``EarlyNvme`` in test_early_nvme.py and test_early_param_nvme.py, ``Delayed`` in test_delayed_update.py, and
``AfterBackward``/``Whole`` (the reference the others are bitwise equal to) in test_engine_parity.py.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest
from conftest import REPO
from engine_cases import base_config, make_model

import offload
from offload.engine.step_schedule import AfterBackward, Speculative, StepSchedule, Whole
from offload.machine.launch import run_ranks
from offload.optim.loss_scale import unclipped_factor

KEYS = ("overlap_step", "speculative_step", "early_step", "delayed_update")


def test_the_adaptive_speculation_skips_exactly_the_steps_after_a_clipped_one():
    spec = Speculative(adaptive=True)
    seen = []
    for clipped in (False, True, True, False, False):
        seen.append(spec.begins(loss_scale=4.0))
        spec.norm_known(clipped)
    guess = (True, unclipped_factor(4.0))
    assert seen == [guess, guess, (False, None), (False, None), guess]


def test_plain_speculation_guesses_every_step_and_the_exact_schedules_never_guess():
    spec = Speculative(adaptive=False)
    spec.norm_known(clipped=True)
    assert spec.begins(loss_scale=1.0) == (True, unclipped_factor(1.0))
    assert AfterBackward("why").begins(loss_scale=1.0) == (False, None)


def test_the_description_is_the_two_choices_in_order():
    schedule = StepSchedule(AfterBackward("offload.overlap_step is off"), Whole("offload.early_step is off"))
    assert schedule.describe() == ("after backward (offload.overlap_step is off); step() returns after Adam "
                                   "(offload.early_step is off)")


def _config(clip: float = 0.0, **offload_keys: Any) -> dict[str, Any]:
    config = base_config(2, 1, 1, clip=clip)
    config["offload"].update(offload_keys)
    return config


def _nvme(config: dict[str, Any], path: str) -> dict[str, Any]:
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
    return config


def _schedules(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """Each config's schedule, as (during, adaptive, returns, the delayed update's exact steps' return)."""
    out = {}
    for name, config in configs.items():
        engine, _, _, _ = offload.initialize(model=make_model("gpt"), config=config, device="cpu")
        s = engine.schedule
        assert engine.step_mode == s.describe()
        out[name] = (type(s.during).__name__, getattr(s.during, "adaptive", None), type(s.returns).__name__,
                     type(getattr(s.returns, "exact", None)).__name__)
        engine.close()
    return out


def test_each_config_gets_its_schedule(tmp_path):
    configs = {
        "plain": _config(),
        "clip": _config(clip=1.0, speculative_step="off"),
        "clip, speculated": _config(clip=1.0, speculative_step="on"),
        "clip, NVMe, auto": _nvme(_config(clip=1.0), str(tmp_path / "a")),
        "early": _config(early_step="on"),
        "early, NVMe": _nvme(_config(early_step="on"), str(tmp_path / "b")),
        "delayed": _config(delayed_update={"warmup_steps": 2}),
        "delayed, early": _config(delayed_update={"warmup_steps": 2}, early_step="on"),
    }
    got = run_ranks(_schedules, 1, configs=configs)[0]
    assert got == {
        "plain": ("Overlapped", None, "Whole", "NoneType"),
        "clip": ("AfterBackward", None, "Whole", "NoneType"),
        "clip, speculated": ("Speculative", False, "Whole", "NoneType"),
        "clip, NVMe, auto": ("Speculative", True, "Whole", "NoneType"),
        "early": ("Overlapped", None, "Early", "NoneType"),
        "early, NVMe": ("Overlapped", None, "EarlyNvme", "NoneType"),
        "delayed": ("AfterBackward", None, "Delayed", "Whole"),
        "delayed, early": ("AfterBackward", None, "Delayed", "Early"),
    }


def _reads_of_the_keys() -> list[str]:
    """Attribute reads ``.overlap_step`` and the like in offload/, by file and line."""
    found = []
    for path in sorted((REPO / "offload").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in KEYS:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{node.attr}")
    return found


def test_only_the_schedule_reads_the_keys_that_choose_it():
    others = [r for r in _reads_of_the_keys() if not r.startswith("offload/engine/step_schedule.py:")]
    assert others == [], "read these through offload.engine.step_schedule (wanted / choose)"


@pytest.mark.parametrize("key", KEYS)
def test_the_key_check_sees_each_key(key):
    assert any(r.endswith(f".{key}") for r in _reads_of_the_keys())
