"""TRL's trainers and transformers' DeepSpeed path on offload's engine through the one-line switch
(offload.as_deepspeed, [Note: offload behind the DeepSpeed path]): the same script trains as it does without
DeepSpeed (plain accelerate, fp32) to within 1e-4 over 20 steps, resumes from its checkpoint-N exactly, and its
reference model is an engine holding 1/W of the weights on each rank. Every case runs in a process forked from one
zygote per module (tests/zygote.py) that imported the switch, transformers, TRL and datasets once; the switch is
never installed in the pytest worker itself."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
if importlib.util.find_spec("datasets") is None:  # found, not imported: datasets brings pyarrow and pandas
    pytest.skip("datasets is not installed", allow_module_level=True)

import trl_cases  # noqa: E402
from zygote import Zygote, torchrun_env  # noqa: E402

ENGINE = "offload.engine.core.Engine"
TOLERANCE = 1e-4  # the bound; the runs here agree to a few ulps of the loss (fp32 sums in another order)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(["offload.as_deepspeed", "transformers", "accelerate", "trl", "datasets", "trl_cases"],
               env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    yield z
    z.close()


def close(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs) >= 20
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= TOLERANCE, f"losses differ by up to {worst:.3g}: {ours} against {theirs}"


def test_the_switch_answers_as_deepspeed_0_19_8(zygote):
    answers = zygote.run(trl_cases.switch_answers)[0]
    assert answers["version"] == answers["module_version"] == "0.19.8"
    assert answers["transformers_sees"] and answers["accelerate_sees"] and answers["offloads"]
    assert answers["initialize"] == "offload.stand_in.modules"
    assert answers["cpu_adam"].startswith("offload.") and answers["zero_init"]
    assert answers["status"] == ["AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"]
    assert answers["file"] == str(ROOT / "offload" / "stand_in" / "path" / "deepspeed" / "__init__.py")
    assert "deepspeed.moe" in answers["missing_module"] and "offload does not answer" in answers["missing_module"]
    assert "deepspeed.runtime.pipe" in answers["missing_name"] and "offload" in answers["missing_name"]


def test_deepspeed_imported_before_the_switch_is_refused():
    script = ("import sys, types; sys.modules['deepspeed'] = types.ModuleType('deepspeed')\n"
              "import offload.as_deepspeed")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "DeepSpeed was imported before offload.as_deepspeed" in done.stderr
    assert "offload launch" in done.stderr


def test_sft_trains_on_the_engine_as_without_deepspeed(zygote, tmp_path):
    plain = zygote.run(trl_cases.sft, out=str(tmp_path / "plain"), ds=None)[0]
    ours = zygote.run(trl_cases.sft, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD)[0]
    assert ours["engine"] == ENGINE and plain["engine"] != ENGINE
    close(ours["losses"], plain["losses"])


# TRL's SFT case under DeepSpeed itself: a fresh process without the switch, as a user of DeepSpeed runs it
DEEPSPEED_SIDE = """
import json, sys
import trl_cases
result = trl_cases.sft(0, 1, out=sys.argv[1], ds=trl_cases.ZERO3_OFFLOAD)
import deepspeed
assert not getattr(deepspeed, "__offload__", False), "offload stood in"
print("RESULT " + json.dumps(result))
"""


def test_sft_under_the_switch_trains_as_under_deepspeed_itself(zygote, tmp_path):
    """Where DeepSpeed is installed (./dev.sh deepspeed): the same SFT script and ZeRO-3 offload config under
    DeepSpeed 0.19.8 and under offload, on this CPU, agree to a few ulps of the loss a step (4.8e-7 over 20 steps
    on an AVX2 EPYC, 2026-12-07), far inside the 1e-4 the plain-accelerate comparison allows."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (./dev.sh deepspeed installs it)")
    from offload.machine.launch import _free_port
    env = {**os.environ, **torchrun_env(0, 1, _free_port()), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", DEEPSPEED_SIDE, str(tmp_path / "deepspeed")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.split("RESULT ")[-1])
    ours = zygote.run(trl_cases.sft, out=str(tmp_path / "ours"), ds=trl_cases.ZERO3_OFFLOAD)[0]
    assert theirs["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine" and ours["engine"] == ENGINE
    assert len(ours["losses"]) == len(theirs["losses"]) == 20
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=2e-5)


@pytest.mark.slow  # the inner loop keeps the switch's answers and one trainer
def test_sft_resumes_from_its_checkpoint_n_exactly(zygote, tmp_path):
    whole = zygote.run(trl_cases.sft, out=str(tmp_path / "whole"), ds=trl_cases.ZERO3_OFFLOAD,
                       save_strategy="steps", save_steps=10)[0]
    checkpoint = tmp_path / "whole" / "checkpoint-10"
    assert (checkpoint / "latest").read_text().strip() == "global_step10"
    resumed = zygote.run(trl_cases.sft, out=str(tmp_path / "resumed"), ds=trl_cases.ZERO3_OFFLOAD,
                         resume=str(checkpoint))[0]
    assert resumed["steps"][10:] == list(range(11, 21))
    assert resumed["losses"][10:] == whole["losses"][10:]


@pytest.mark.slow  # the inner loop keeps the switch's answers and one trainer
def test_dpo_prepares_its_reference_model_as_an_engine(zygote, tmp_path):
    plain = zygote.run(trl_cases.dpo, out=str(tmp_path / "plain"), ds=None)[0]
    ours = zygote.run(trl_cases.dpo, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD)[0]
    assert plain["reference"].endswith("LlamaForCausalLM")
    assert ours["engine"] == ours["reference"] == ENGINE and not ours["reference_training"]
    host, device = ours["reference_summary"]["host"], ours["reference_summary"]["device"]
    assert device["shards"] == 0 and host["total"] >= ours["reference_full_bytes"]  # offload_param: cpu
    close(ours["losses"], plain["losses"])


@pytest.fixture(scope="module")
def plain_dpo_at_two_ranks(zygote, tmp_path_factory):
    return zygote.run(trl_cases.dpo, world=2, out=str(tmp_path_factory.mktemp("plain_dpo")), ds=None)


@pytest.mark.slow  # the inner loop keeps the switch's answers and one trainer
def test_two_ranks_hold_half_the_reference_each(zygote, plain_dpo_at_two_ranks, tmp_path):
    plain = plain_dpo_at_two_ranks
    ours = zygote.run(trl_cases.dpo, world=2, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD)
    full = ours[0]["reference_full_bytes"]
    for rank in ours:
        held = rank["reference_summary"]["host"]["total"]
        assert full / 2 <= held <= 0.55 * full, (held, full)  # a half, and the units' padding
    close(ours[0]["losses"], plain[0]["losses"])
    assert ours[0]["losses"] == ours[1]["losses"]


@pytest.mark.slow  # the inner loop keeps the switch's answers and one trainer
def test_a_trainer_subclass_that_overrides_training_step_and_compute_loss_runs_unchanged(zygote, tmp_path):
    plain = zygote.run(trl_cases.subclassed_trainer, out=str(tmp_path / "plain"), ds=None)[0]
    ours = zygote.run(trl_cases.subclassed_trainer, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD)[0]
    assert ours["engine"] == ENGINE and ours["calls"] == plain["calls"] == 40
    close(ours["losses"], plain["losses"])


ACCELERATE_ZERO3_OFFLOAD = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


@pytest.mark.slow
def test_offload_launch_runs_accelerate_launch_with_a_deepspeed_config_on_the_engine(plain_dpo_at_two_ranks, tmp_path):
    config = tmp_path / "zero3_offload.yaml"
    config.write_text(ACCELERATE_ZERO3_OFFLOAD)
    bin_dir = Path(sys.executable).parent
    done = subprocess.run([str(bin_dir / "offload"), "launch", str(bin_dir / "accelerate"), "launch",
                           "--config_file", str(config), str(ROOT / "tests" / "trl_scripts" / "train.py"), "dpo",
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**_env(), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "stands in for DeepSpeed 0.19.8" in done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["engine"] == r["reference"] == ENGINE for r in ranks)
    close(ranks[0]["losses"], plain_dpo_at_two_ranks[0]["losses"])


def test_offload_launch_refuses_deepspeeds_own_launcher_before_anything_starts():
    from offload.stand_in.launch import LaunchError, resolve
    with pytest.raises(LaunchError, match="DeepSpeed's own launcher"):
        resolve(["deepspeed", "--num_gpus", "2", "train.py"])
    with pytest.raises(LaunchError, match="DeepSpeed's own launcher"):
        resolve(["python", "-m", "deepspeed.launcher.runner", "train.py"])
    with pytest.raises(LaunchError, match="needs a command"):
        resolve(["--"])
    with pytest.raises(LaunchError, match="no such command"):
        resolve(["no-such-launcher-here"])


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}


@pytest.fixture(scope="module")
def checkpoint(zygote, tmp_path_factory):
    return zygote.run(trl_cases.save_tiny, out=str(tmp_path_factory.mktemp("tiny")))[0]


def test_from_pretrained_under_zero3_loads_every_weight(zygote, checkpoint):
    """transformers marks each loaded weight before gathering it, so that its initialiser skips it; zero.Init's
    parameters built on the meta device kept the mark through their materialisation (they lost it once, and the
    embeddings and head of every model so loaded were re-drawn at random)."""
    assert zygote.run(trl_cases.zero3_from_pretrained, checkpoint=checkpoint) == [[]]


@pytest.mark.slow
def test_grpo_generates_the_same_completions_gathered_or_unit_by_unit_and_trains_as_without_deepspeed(
        zygote, checkpoint, tmp_path):
    plain = zygote.run(trl_cases.grpo, out=str(tmp_path / "plain"), ds=None, checkpoint=checkpoint)[0]
    gathered = zygote.run(trl_cases.grpo, out=str(tmp_path / "gathered"), ds=trl_cases.ZERO3_OFFLOAD,
                          checkpoint=checkpoint, gather=True)[0]
    by_unit = zygote.run(trl_cases.grpo, out=str(tmp_path / "by_unit"), ds=trl_cases.ZERO3_OFFLOAD,
                         checkpoint=checkpoint, gather=False)[0]
    assert gathered["engine"] == gathered["reference"] == ENGINE
    assert gathered["completions"] == by_unit["completions"] and gathered["grad_norms"] == by_unit["grad_norms"]
    assert gathered["completions"][0] == plain["completions"][0]  # sampled from the same weights and generator
    close(gathered["grad_norms"], plain["grad_norms"])


@pytest.mark.slow
def test_reward_trainer_trains_a_classifier_on_the_engine_as_without_deepspeed(zygote, tmp_path):
    plain = zygote.run(trl_cases.reward_model, out=str(tmp_path / "plain"), ds=None)[0]
    ours = zygote.run(trl_cases.reward_model, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD)[0]
    assert ours["engine"] == ENGINE
    close(ours["losses"], plain["losses"])


@pytest.mark.slow
def test_grpo_at_two_ranks_trains_as_without_deepspeed(zygote, checkpoint, tmp_path):
    ours = zygote.run(trl_cases.grpo, world=2, out=str(tmp_path / "ds"), ds=trl_cases.ZERO3_OFFLOAD,
                      checkpoint=checkpoint, steps=10)
    plain = zygote.run(trl_cases.grpo, world=2, out=str(tmp_path / "plain"), ds=None, checkpoint=checkpoint, steps=10)
    for rank in (0, 1):
        assert ours[rank]["completions"][0] == plain[rank]["completions"][0]
        assert max(abs(a - b) for a, b in zip(ours[rank]["grad_norms"], plain[rank]["grad_norms"])) <= TOLERANCE
    assert ours[0]["grad_norms"] == ours[1]["grad_norms"] and len(ours[0]["grad_norms"]) == 10


def test_a_deepspeed_feature_offload_refuses_stops_the_trainer_before_its_first_step(zygote, tmp_path):
    got = zygote.run(trl_cases.refused_config, out=str(tmp_path), zero={"zenflow": {"topk_ratio": 0.1}})[0]
    assert got["steps"] == 0
    assert "zero_optimization.zenflow" in got["error"] and "offload.delayed_update" in got["error"]
