"""offload.accelerate.Accelerator: an accelerate loop with the DeepSpeed plugin, its import changed, trains as the
same loop under accelerate's own Accelerator (tests/accelerate_scripts/loop.py, run as a script, once per side),
resumes bitwise from save_state / load_state, one process and two under accelerate launch, and never imports
DeepSpeed; what it cannot run is refused by name.

The one-process runs are `python loop.py ...` forked from one zygote per module that imported accelerate and offload
once (tests/zygote.py); accelerate's own launcher and DeepSpeed's side start subprocesses, as a user does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from zygote import Zygote, succeeded, torchrun_env  # noqa: E402

LOOP = Path(__file__).parent / "accelerate_scripts" / "loop.py"


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(["accelerate", "accelerate.utils", "offload.accelerate", "offload.machine.backward_context"])
    yield z
    z.close()


def run_loop(zygote: Zygote, impl: str, out: Path, *extra: str) -> dict:
    succeeded(zygote.script(LOOP, impl, str(out), *extra, cwd=out.parent))
    return torch.load(out)


def run_deepspeed(out: Path, env: dict[str, str]) -> dict:
    """accelerate's own DeepSpeed path, in a fresh process (DeepSpeed's import never enters the zygote)."""
    proc = subprocess.run([sys.executable, str(LOOP), "deepspeed", str(out)], capture_output=True, text=True,
                          cwd=out.parent, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def plain_run(zygote, tmp_path_factory) -> dict:
    """accelerate's own loop at one process, the reference (run once per worker)."""
    return run_loop(zygote, "plain", tmp_path_factory.mktemp("plain") / "plain.pt")


def test_an_accelerate_loop_trains_on_the_engine_as_under_accelerate(zygote, tmp_path, plain_run):
    """Accumulation 2, clipping at 1.0, a StepLR the script steps every micro-batch: the same losses, norms,
    learning rates and final weights (fp32, to the rounding of a gradient summed in another order)."""
    plain = plain_run
    ours = run_loop(zygote, "offload", tmp_path / "offload.pt")
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert ours["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    assert ours["lrs"] == plain["lrs"]
    assert ours["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    assert ours["unwrapped"] == "Sequential" and not ours["deepspeed_imported"] and not ours["bf16"]


def test_dynamo_backend_compiles_each_block_and_trains_as_accelerates_compiled_model(zygote, tmp_path):
    """dynamo_backend: accelerate compiles the whole model; offload compiles each unit's blocks (engine.compile, as
    accelerate's DeepSpeed path calls it), to the same losses and weights."""
    plain = run_loop(zygote, "plain", tmp_path / "plain.pt", "--dynamo", "aot_eager")
    ours = run_loop(zygote, "offload", tmp_path / "offload.pt", "--dynamo", "aot_eager")
    assert ours["compiled"] == ["1", "2"]  # the two residual blocks; torch's own layers stay eager
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    for key, value in plain["state"].items():
        torch.testing.assert_close(ours["state"][key.removeprefix("_orig_mod.")], value, rtol=1e-5, atol=1e-6)


def test_beside_accelerates_own_deepspeed_path(zygote, tmp_path):
    """Where DeepSpeed is installed, accelerate's own DeepSpeed path runs the same loop and config on this CPU
    (one process; DeepSpeedCPUAdam, ZeRO-3 with both offloads): offload's losses, gradient norms, learning rates
    and weights equal its."""
    pytest.importorskip("deepspeed")
    from offload.machine.launch import _free_port
    theirs = run_deepspeed(tmp_path / "deepspeed.pt", torchrun_env(0, 1, _free_port()))  # else DeepSpeed looks for MPI
    ours = run_loop(zygote, "offload", tmp_path / "offload.pt")
    assert theirs["deepspeed_imported"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-5) and ours["lrs"] == theirs["lrs"]
    for key, value in theirs["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_the_configs_optimizer_and_scheduler_and_the_accelerators_bf16(zygote, tmp_path, plain_run):
    """DummyOptim / DummyScheduler (the config's AdamW; the StepLR from the scheduler's lr_scheduler_callable,
    stepped by the engine at each step) train as the plain loop's own AdamW and StepLR. Accelerator(
    mixed_precision="bf16") turns on the engine's bf16 (DeepSpeed's meaning: bf16 weights and activations, an fp32
    master), where accelerate's own autocast keeps fp32 weights: close to fp32, not equal."""
    plain = plain_run
    dummy = run_loop(zygote, "offload", tmp_path / "dummy.pt", "--dummy")
    assert dummy["losses"] == pytest.approx(plain["losses"], rel=1e-5) and dummy["lrs"] == plain["lrs"]
    for key, value in plain["state"].items():
        torch.testing.assert_close(dummy["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    bf16 = run_loop(zygote, "offload", tmp_path / "bf16.pt", "--dummy", "--precision", "bf16")
    assert bf16["bf16"] and bf16["losses"] != dummy["losses"]
    assert bf16["losses"] == pytest.approx(dummy["losses"], rel=5e-2, abs=1e-2)
    assert all(v.dtype == torch.float32 for v in bf16["state"].values())  # the master, whole


def test_save_state_and_load_state_resume_bitwise(zygote, tmp_path):
    whole = run_loop(zygote, "offload", tmp_path / "whole.pt", "--save", str(tmp_path / "state"))  # saved after epoch 1
    assert (tmp_path / "state" / "pytorch_model").is_dir()  # the engine's checkpoint beside accelerate's state
    resumed = run_loop(zygote, "offload", tmp_path / "resumed.pt", "--load", str(tmp_path / "state"))
    assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
    assert resumed["lrs"] == whole["lrs"][len(whole["lrs"]) // 2:]
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key


@pytest.mark.parametrize("env, kwargs, message", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, {"deepspeed_plugin": True}, "ACCELERATE_USE_DEEPSPEED is set"),
    ({}, {}, "needs deepspeed_plugin=DeepSpeedPlugin"),
    ({}, {"deepspeed_plugin": True, "deepspeed_plugins": {"a": 1, "b": 2}}, "takes one DeepSpeed plugin"),
])
def test_what_it_cannot_run_is_refused_by_name(monkeypatch, env, kwargs, message):
    from accelerate.utils import DeepSpeedPlugin

    from offload.accelerate import Accelerator
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if kwargs.get("deepspeed_plugin"):
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=message):
        Accelerator(**kwargs)


def launch(impl: str, out: Path, *extra: str) -> list[dict]:
    """The loop on two processes, as `accelerate launch --multi_gpu --num_processes 2` starts them (on CPUs: gloo)."""
    from offload.machine.launch import _free_port
    # faulthandler: a rank that aborts at exit prints every thread's Python stack (see tests/test_lightning.py)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", str(_free_port()), str(LOOP), impl, str(out), *extra],
                          capture_output=True, text=True, cwd=out.parent, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-8000:]
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


def forked_pair(zygote: Zygote, impl: str, out: Path, *extra: str) -> list[dict]:
    """The loop's two ranks forked from the zygote with the variables accelerate launch hands torchrun's ranks (each
    rank writes OUT.rank only where accelerate saw two processes)."""
    succeeded(zygote.script(LOOP, impl, str(out), *extra, world=2, cwd=out.parent,
                            env={"ACCELERATE_USE_CPU": "true", "PYTHONWARNINGS": "ignore"}))
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


def test_two_processes_under_accelerate_launch_train_as_accelerate_and_resume_bitwise(zygote, tmp_path):
    """offload's run started by accelerate launch itself, as a user starts it; accelerate's reference and the
    resumed run forked as its ranks."""
    plain = forked_pair(zygote, "plain", tmp_path / "plain.pt")
    ours = launch("offload", tmp_path / "offload.pt", "--save", str(tmp_path / "state"))  # saved after epoch 1
    for mine, theirs in zip(ours, plain):
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        for key, value in theirs["state"].items():
            torch.testing.assert_close(mine["state"][key], value, rtol=1e-5, atol=1e-6)
    resumed = forked_pair(zygote, "offload", tmp_path / "resumed.pt", "--load", str(tmp_path / "state"))
    for whole, again in zip(ours, resumed):
        assert again["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        for key, value in whole["state"].items():
            assert torch.equal(again["state"][key], value), key
