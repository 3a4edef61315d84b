"""The learning-rate schedules DeepSpeed names, each with the parameters a config may give (defaults included), and
how a run of one is recorded: shared by tests/test_lr_schedules.py and the recording of DeepSpeed's own
(tests/ds_battery/expected/lr_schedules.json)."""

from __future__ import annotations

from typing import Any

STEPS = 40
OPT_LR = 3e-3  # the optimizer's own lr: what WarmupLR without warmup_max_lr and WarmupCosineLR read

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "warmup-defaults": ("WarmupLR", {}),
    "warmup-no-max": ("WarmupLR", {"warmup_num_steps": 10}),
    "warmup-linear": ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 8,
                                   "warmup_type": "linear"}),
    "warmup-one-step": ("WarmupLR", {"warmup_num_steps": 1, "warmup_max_lr": 1e-3}),
    "decay-defaults": ("WarmupDecayLR", {"total_num_steps": 30}),
    "decay-linear": ("WarmupDecayLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_max_lr": 1e-3,
                                       "warmup_type": "linear"}),
    "cosine-defaults": ("WarmupCosineLR", {"total_num_steps": 30}),
    "cosine": ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 6, "warmup_min_ratio": 0.1,
                                  "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    "cosine-past-its-end": ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4}),
    "onecycle": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 8}),
    "onecycle-asymmetric-decay": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                               "cycle_first_step_size": 6, "cycle_second_step_size": 10,
                                               "decay_step_size": 4, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01}),
    "onecycle-stairs": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 9,
                                     "cycle_first_stair_count": 3, "cycle_second_stair_count": 2}),
    "onecycle-no-momentum": ("OneCycle", {"cycle_min_lr": 2e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 5,
                                          "cycle_momentum": False}),
    "range-test": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5,
                                   "lr_range_test_step_rate": 0.5}),
    "range-test-staircase": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5,
                                             "lr_range_test_staircase": True}),
}


def run_schedule(optimizer: Any, schedule: Any, steps: int) -> list[list[float]]:
    """[lr, beta1, beta2] that each of ``steps`` optimizer steps runs at: read before the schedule steps after it,
    as an engine steps its schedule after the optimizer."""
    out = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        out.append([float(group["lr"]), float(group["betas"][0]), float(group["betas"][1])])
        schedule.step()
    return out
