"""A job asked to stop (SIGTERM, SIGINT, or its own loop) ends after a step every rank agrees on, with a
checkpoint of that step, and resumes from it as if it had never stopped ([Note: stopping at an agreed step])."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

from offload.commands.cli import main
from offload.engine.stopping import Stop, StopRequest
from offload.machine.launch import run_ranks

# `offload train` with a signal sent to this process while the backward of its STOP_AT-th call runs (on rank
# STOP_RANK only), STOP_TIMES times: inside autograd's hooks, the worst place for a KeyboardInterrupt.
SIGNALLED = """
import os, signal, sys, time
from offload.engine.core import Engine
from offload.commands.cli import main
at, signum = int(os.environ["STOP_AT"]), getattr(signal, os.environ["STOP_SIGNAL"])
times, rank = int(os.environ.get("STOP_TIMES", "1")), int(os.environ.get("STOP_RANK", "0"))
calls = []
backward = Engine.backward
def signalled(self, loss, *args, **kwargs):
    calls.append(1)
    if len(calls) == at and self.group.rank == rank:
        for _ in range(times):
            os.kill(os.getpid(), signum)
            # Signals of one kind do not queue: one sent while the last is still pending (the kernel may hand it to
            # another thread, which has yet to run) is merged with it. A person's second Ctrl-C comes after the first
            # was taken; so does this one.
            deadline = time.monotonic() + 30
            while not self.stop.requested and time.monotonic() < deadline:
                time.sleep(0.01)
    return backward(self, loss, *args, **kwargs)
Engine.backward = signalled
raise SystemExit(main(sys.argv[1:]))
"""


def _record(path):
    return json.loads((path / "record.json").read_text())


def _swap_left(tmp_path):
    swap = tmp_path / "swap"
    return list(swap.iterdir()) if swap.exists() else []


def _common(tmp_path, state):
    return ["--steps", "8", "--print-every", "4", "--offload-optimizer", state, "--nvme-path", str(tmp_path / "swap")]


def test_a_stop_request_moves_running_to_requested_to_agreed_once():
    stop = StopRequest()
    assert not stop.requested and stop.exit_status == 0
    stop.request("SIGTERM", signal.SIGTERM)
    stop.request("SIGINT", signal.SIGINT)  # the first reason stays
    assert stop.requested and stop.state is Stop.REQUESTED and stop.reason == "SIGTERM" and stop.exit_status == 143
    stop.agreed(5, by_peer=False)
    stop.agreed(6, by_peer=True)  # idempotent
    assert stop.state is Stop.AGREED and stop.step == 5 and stop.reason == "SIGTERM"
    peer = StopRequest()
    peer.agreed(3, by_peer=True)
    assert peer.state is Stop.AGREED and peer.reason == "a request on another rank" and peer.exit_status == 0


def _stop_on_rank(rank, world, ask_at):
    import offload
    torch.manual_seed(0)
    engine = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, world))[0]
    seen = []
    for step, batch in enumerate(batches(8, 2, seed=rank + 1), start=1):
        if rank == 1 and step == ask_at:
            engine.request_stop()  # before this step's backward: the step it ends with is this one
        loss = loss_of(engine, "gpt", batch)
        engine.backward(loss)
        engine.step()
        seen.append(engine.should_stop)
        if engine.should_stop:
            break
    reason, at = engine.stop.reason, engine.stop.step
    engine.close()
    return seen, reason, at


def test_one_rank_asked_to_stop_stops_every_rank_after_the_same_step():
    results = run_ranks(_stop_on_rank, 2, ask_at=3)
    assert [r[0] for r in results] == [[False, False, True]] * 2
    assert [r[2] for r in results] == [3, 3]
    assert results[0][1] == "a request on another rank" and results[1][1] == "the training loop asked"


@pytest.mark.parametrize("signame,state", [("SIGTERM", "nvme"), ("SIGINT", "cpu")])
def test_a_signal_at_a_random_step_saves_that_step_and_resumes_bitwise(tmp_path, signame, state):
    at = random.Random(f"{signame}{state}").randint(2, 6)  # the step whose backward the signal lands in
    assert main(["train", "--out", str(tmp_path / "straight"), *_common(tmp_path, state)]) == 0
    args = ["train", "--out", str(tmp_path / "stopped"), *_common(tmp_path, state)]
    env = {**os.environ, "STOP_AT": str(at), "STOP_SIGNAL": signame}
    proc = subprocess.run([sys.executable, "-c", SIGNALLED, *args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 128 + getattr(signal, signame), proc.stderr[-3000:]
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"global_step{at}"
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"offload train: stopped by {signame} after step {at}; saved checkpoint {checkpoint}; "
                           "resume: offload train --out"), line
    assert line.endswith(" --resume") and "Traceback" not in proc.stderr
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert _swap_left(tmp_path) == []  # the engine closed: its swap directory is gone
    record = _record(tmp_path / "stopped")
    assert len(record["losses"]) == at and record["stopped"]["step"] == at
    assert main([*args, "--resume"]) == 0
    assert _record(tmp_path / "stopped")["losses"] == _record(tmp_path / "straight")["losses"]


def test_without_save_on_stop_it_stops_after_the_step_and_names_the_last_checkpoint(tmp_path):
    args = ["train", "--out", str(tmp_path / "out"), *_common(tmp_path, "cpu"), "--save-every", "2",
            "--no-save-on-stop"]
    env = {**os.environ, "STOP_AT": "5", "STOP_SIGNAL": "SIGTERM"}
    proc = subprocess.run([sys.executable, "-c", SIGNALLED, *args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 143, proc.stderr[-3000:]
    last = tmp_path / "out" / "checkpoints" / "global_step4"
    assert (f"stopped by SIGTERM after step 5; no checkpoint saved (--no-save-on-stop); the last one is {last}"
            in proc.stdout)
    assert sorted(p.name for p in last.parent.iterdir() if p.name.startswith("global")) == ["global_step2",
                                                                                           "global_step4"]


@pytest.mark.parametrize("started", ["SIGINT default", "SIGINT ignored"])
def test_a_second_signal_stops_at_once_and_leaves_the_last_checkpoint(tmp_path, started):
    """Also where the process started with SIGINT ignored, as bash starts a background job (Python then installs
    no KeyboardInterrupt of its own): the first line promised that a second SIGINT stops at once."""
    args = ["train", "--out", str(tmp_path / "out"), *_common(tmp_path, "cpu"), "--save-every", "2"]
    env = {**os.environ, "STOP_AT": "5", "STOP_SIGNAL": "SIGINT", "STOP_TIMES": "2"}
    disposition = signal.SIG_IGN if started == "SIGINT ignored" else signal.SIG_DFL
    proc = subprocess.run([sys.executable, "-c", SIGNALLED, *args], capture_output=True, text=True, timeout=600,
                          env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "interrupted at once by a second SIGINT" in proc.stderr
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "global_step4"
    assert _swap_left(tmp_path) == []


@pytest.mark.parametrize("state", ["nvme"])  # the host state's W = 2 path is the same agreement (tested above)
def test_a_signal_to_one_rank_under_torchrun_stops_both_at_one_step_and_resumes_bitwise(tmp_path, state):
    at = random.Random(state).randint(2, 6)
    common = _common(tmp_path, state)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "offload", "train"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    straight = subprocess.run([*torchrun, "--out", str(tmp_path / "straight"), *common], env=env,
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # rank 1 alone gets the signal; rank 0 learns it with that step's norm
    stopped = subprocess.run([*torchrun[:-3], "--no-python", sys.executable, "-c", SIGNALLED, "train", "--out",
                              str(tmp_path / "stopped"), *common], capture_output=True, text=True, timeout=600,
                             env={**env, "STOP_AT": str(at), "STOP_SIGNAL": "SIGTERM", "STOP_RANK": "1"})
    assert stopped.returncode != 0  # each rank exits 143; torchrun reports a failure
    assert f"stopped by a request on another rank after step {at}" in stopped.stdout, stopped.stderr[-3000:]
    checkpoint = tmp_path / "stopped" / "checkpoints" / f"global_step{at}"
    assert sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("rank")) == [
        f"rank{r}.{kind}" for r in (0, 1) for kind in ("bin", "json", "pt")]  # whole: every rank's part
    resumed = subprocess.run([*torchrun, "--out", str(tmp_path / "stopped"), *common, "--resume"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _record(tmp_path / "stopped")["losses"] == _record(tmp_path / "straight")["losses"]
