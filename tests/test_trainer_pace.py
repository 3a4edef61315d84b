"""tools/trainer_pace.py, #44's Trainer row, as a smoke run of a tiny Llama on this CPU: each side writes its
tokens/s and losses, and a side that fails writes its error as it happened instead of a figure. Each run is the
script as ``python tools/trainer_pace.py`` runs it, forked from a zygote that imported transformers' Trainer and
offload.hf once (tests/zygote.py)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from zygote import Zygote  # noqa: E402

TOOL = Path(__file__).resolve().parents[1] / "tools" / "trainer_pace.py"
CONFIG = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu", "ratio": "auto"}},
          "offload": {"budgets": {"device": "1MiB"}}}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(["transformers", "transformers.trainer", "offload.hf"], env={"CUDA_VISIBLE_DEVICES": ""})
    yield z
    z.close()


def run_side(zygote, tmp_path, side, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / f"{side}.json"
    ran, = zygote.script(TOOL, "--tiny", "--side", side, "--config", str(path), "--out", str(out), "--seq", "32",
                         "--steps", "2", "--warmup", "1", cwd=tmp_path)
    return ran.code, json.loads(out.read_text())


@pytest.mark.parametrize("side", ["offload", "plain"])
def test_a_side_reports_its_tokens_per_second_and_losses(zygote, tmp_path, side):
    rc, result = run_side(zygote, tmp_path, side, CONFIG)
    assert rc == 0 and "error" not in result, result.get("traceback")
    assert result["tokens_per_s"] > 0 and len(result["losses"]) == 3 and len(result["steps"]) == 3
    assert result["params"] > 0 and result["peak_rss"] > 0


def test_a_side_that_fails_writes_its_error_and_exits_1(zygote, tmp_path):
    broken = json.loads(json.dumps(CONFIG))
    broken["zero_optimization"]["offload_optimizer"]["ratio"] = 2.0
    rc, result = run_side(zygote, tmp_path, "offload", broken)
    assert rc == 1 and "ratio" in result["error"] and "tokens_per_s" not in result
