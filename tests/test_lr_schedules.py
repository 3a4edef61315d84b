"""Every learning-rate schedule DeepSpeed names gives DeepSpeed 0.19.8's lr (and OneCycle's betas) at every step,
defaults included: against its schedules recorded once (tests/ds_battery/expected/lr_schedules.json, from the
lr_schedules.py of DeepSpeed 0.19.8's sdist, run by tests/lr_cases.py's cases), and against DeepSpeed itself where
it is installed (`./dev.sh deepspeed`)."""

import json

import pytest
import torch
from conftest import REPO
from lr_cases import CASES, OPT_LR, STEPS, run_schedule

from offload.config import Config, ConfigError
from offload.optim.lr_schedules import build_lr_schedule

RECORDED = json.loads((REPO / "tests" / "ds_battery" / "expected" / "lr_schedules.json").read_text())


def ours(kind: str, params: dict) -> list[list[float]]:
    config = Config.load({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": kind, "params": params}})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=OPT_LR, betas=(0.9, 0.999))
    return run_schedule(optimizer, build_lr_schedule(optimizer, config.scheduler), STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_every_schedule_gives_deepspeeds_rates_at_every_step(name):
    kind, params = CASES[name]
    got, want = ours(kind, params), RECORDED["schedules"][name]
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine == pytest.approx(theirs, rel=1e-12, abs=1e-15), f"{name}, step {step}: {mine} != {theirs}"


def test_the_recorded_schedules_are_deepspeeds_own_where_it_is_installed():
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    for name, (kind, params) in CASES.items():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=OPT_LR, betas=(0.9, 0.999))
        live = run_schedule(optimizer, getattr(lr_schedules, kind)(optimizer, **params), STEPS)
        recorded = RECORDED["schedules"][name]  # per step: lr, or [lr, beta1, beta2] where the schedule cycles them
        assert len(live) == len(recorded), name
        for step, (ours, theirs) in enumerate(zip(live, recorded)):
            assert ours == pytest.approx(theirs, rel=1e-12), (name, step)


def test_a_onecycle_without_its_rates_is_refused_naming_them():
    with pytest.raises(ConfigError, match="scheduler.params.cycle_min_lr: is required by OneCycle"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "OneCycle", "params": {}}})
