"""``offload launch <command>``: run a command with offload standing in for DeepSpeed in it and every Python process
it starts ([Note: offload behind the DeepSpeed path]): offload/stand_in/path goes first on PYTHONPATH, so
``accelerate launch --config_file zero3_offload.yaml train.py`` (whose own process checks for DeepSpeed before it
starts the script) and ``torchrun train.py`` with ``TrainingArguments(deepspeed=...)`` run on offload's engine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

from offload.stand_in import PATH


class LaunchError(ValueError):
    """A command ``offload launch`` cannot run as asked: said before anything starts."""


# DeepSpeed's own launchers: their flags (--hostfile, --include, --num_gpus, --autotuning) drive DeepSpeed's runner,
# which offload does not answer; torchrun and accelerate launch start the same ranks.
_DEEPSPEED_LAUNCHERS = ("deepspeed", "ds", "deepspeed.launcher.runner", "deepspeed.launcher.launch")


def environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the stand-in first on PYTHONPATH (once)."""
    env = dict(base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PATH)]
    env["PYTHONPATH"] = os.pathsep.join([str(PATH), *parts])
    return env


def resolve(command: Sequence[str]) -> list[str]:
    """The command as it will be executed, or a LaunchError that says what is wrong with it."""
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise LaunchError("needs a command to run, for example `offload launch accelerate launch --config_file "
                          "zero3_offload.yaml train.py` or `offload launch torchrun --nproc_per_node 2 train.py`")
    program = os.path.basename(argv[0])
    module = argv[2] if program.startswith("python") and len(argv) > 2 and argv[1] == "-m" else None
    if program in _DEEPSPEED_LAUNCHERS or module in _DEEPSPEED_LAUNCHERS:
        raise LaunchError(f"{argv[0] if module is None else module} is DeepSpeed's own launcher, which offload does "
                          "not answer (its --hostfile, --include and --num_gpus drive DeepSpeed's runner): start the "
                          "same ranks with `offload launch torchrun --nproc_per_node N script.py ...` or "
                          "`offload launch accelerate launch --config_file your_deepspeed.yaml script.py ...`")
    found = shutil.which(argv[0])
    if found is None:
        raise LaunchError(f"{argv[0]!r}: no such command on PATH")
    return [found, *argv[1:]]


def exec_command(command: Sequence[str]) -> None:
    """Replace this process with the command (its signals and exit status are the command's own)."""
    argv = resolve(command)
    os.execve(argv[0], argv, environment(os.environ))
