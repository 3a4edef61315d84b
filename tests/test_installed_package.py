"""The package as users install it (`pip install .`, not the editable install ./dev.sh makes): a wheel built from this
checkout carries every file the package reads at run time, and unpacked, as pip installs it, and imported with
nothing of the source tree in reach, the DeepSpeed switch reports its distribution and a TrainingArguments(deepspeed=)
run trains on the engine."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from offload.machine.launch import _free_port

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def runtime_files() -> set[str]:
    """What the package reads besides its modules: every file under offload/ in the checkout that is not Python
    source (the switch's metadata, the embedded defaults), by git's list where there is one."""
    listed = subprocess.run(["git", "ls-files", "offload"], cwd=ROOT, capture_output=True, text=True)
    names = listed.stdout.split() if listed.returncode == 0 and listed.stdout else [
        str(p.relative_to(ROOT)) for p in (ROOT / "offload").rglob("*") if p.is_file()]
    return {n for n in names if not n.endswith((".py", ".pyc", ".so")) and "__pycache__" not in n}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip install .` builds (in its isolated build environment), unpacked: the files pip installs."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                            "--disable-pip-version-check", "-w", str(out)], capture_output=True, text=True,
                           timeout=900)
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = out.glob("offload-*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def test_the_wheel_carries_every_file_the_package_reads(installed):
    expected = runtime_files()
    assert "offload/defaults/demo.json" in expected and any(n.endswith(".egg-info") for n in expected)
    missing = sorted(n for n in expected if not (installed / n).is_file())
    assert missing == [], f"the wheel leaves out {missing}: pip install . would lack them"
    assert list((installed / "offload").glob("_native*.so")), "the wheel has no native extension"


INSTALLED_SWITCH = """
import importlib.metadata, json, logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import offload
assert offload.__file__.startswith(sys.argv[1]), offload.__file__  # the unpacked wheel, not the checkout
import offload.as_deepspeed
from transformers.integrations import is_deepspeed_available
result = {"version": importlib.metadata.version("deepspeed"), "available": is_deepspeed_available()}
if sys.argv[2] == "train":
    import trl_cases
    trained = trl_cases.sft(0, 1, out=sys.argv[3], ds=trl_cases.ZERO3_OFFLOAD, steps=2)
    result.update(engine=trained["engine"], losses=trained["losses"])
print("RESULT " + json.dumps(result))
"""


def run_installed(site: Path, cwd: Path, *args: str, before: list[str] = ()) -> tuple[dict, str]:
    """The script in a fresh interpreter whose path is the unpacked wheel, then ``before`` (another install), then
    the venv's site-packages, with -S: no .pth runs, so the editable install's redirect to the checkout is off."""
    paths = [str(site), *before, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], str(TESTS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-S", "-c", INSTALLED_SWITCH, str(site), *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT ")[-1]), done.stderr


def test_the_installed_switch_reports_deepspeed_and_a_trainer_run_starts(installed, tmp_path):
    result, _ = run_installed(installed, tmp_path, "train", str(tmp_path / "out"))
    assert result["version"] == "0.19.8" and result["available"]
    assert result["engine"] == "offload.engine.core.Engine"
    assert len(result["losses"]) == 2 and all(0 < loss < 10 for loss in result["losses"])


def test_the_installed_switch_wins_over_an_installed_deepspeed(installed, tmp_path):
    """DeepSpeed installed beside it (another version's distribution and package, ahead of the venv on the path):
    the switch still reports 0.19.8, says which one it leaves unused, and the package it stands in is never run."""
    other = tmp_path / "other"
    (other / "deepspeed-0.16.0.dist-info").mkdir(parents=True)
    (other / "deepspeed-0.16.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.16.0\n")
    (other / "deepspeed").mkdir()
    (other / "deepspeed" / "__init__.py").write_text("raise SystemExit('the installed DeepSpeed was imported')\n")
    result, stderr = run_installed(installed, tmp_path, "report", before=[str(other)])
    assert result == {"version": "0.19.8", "available": True}
    assert "the installed DeepSpeed 0.16.0 is not used" in stderr
