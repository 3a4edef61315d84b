"""Plain weights out of checkpoints: equal to torch trained the same way, loadable by load_state_dict,
sharded like Hugging Face's files, and exported within a memory budget smaller than the model."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from engine_cases import base_config, make_model, train_engine, train_reference

from offload.commands.cli import main
from offload.files.export import export_weights, load_exported
from offload.machine.launch import run_ranks


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A W=2 run's checkpoint and the torch reference trained on the same global batches."""
    root = tmp_path_factory.mktemp("trained")
    run_ranks(train_engine, 2, name="gpt", config=base_config(2, 2, 2), steps=4, micro=2, accum=2,
              save_dir=str(root / "ckpt"))
    return root / "ckpt", train_reference("gpt", 4, 8, 2, world=2)


def test_export_equals_torch_trained_the_same_way_and_loads_into_the_model(trained, tmp_path):
    ckpt, ref = trained
    result = export_weights(ckpt, tmp_path / "out", max_shard_bytes=40_000)
    assert len(result.files) > 2 and result.files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "out" / result.files[-1]).read_text())
    assert set(index["weight_map"].values()) == set(result.files[:-1])
    state = load_exported(tmp_path / "out")
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    model = make_model("gpt")
    model.load_state_dict(state)  # strict: every key, every shape


def test_export_in_bf16_through_the_command_line_and_inspect(trained, tmp_path, capsys):
    ckpt, ref = trained
    assert main(["export-weights", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    state = load_exported(tmp_path / "bf16")
    assert (tmp_path / "bf16" / "model.safetensors").is_file()  # small enough for one file
    for key, value in ref["state"].items():
        if value.is_floating_point():
            assert state[key].dtype == torch.bfloat16
            torch.testing.assert_close(state[key].float(), value, rtol=1e-2, atol=1e-2)
    assert main(["inspect", str(ckpt)]) == 0
    table = capsys.readouterr().out
    assert "world size     2" in table and "global_step4" in table and "fp32 master" in table
    assert main(["inspect", str(tmp_path / "nothing-here")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


EXPORT_UNDER_A_BUDGET = """
import resource, sys, torch
from offload.files.export import export_weights
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
export_weights(sys.argv[1], sys.argv[2], max_shard_bytes=8 << 20)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""

SAVE_A_LARGER_MODEL = """
import sys, torch, offload
from offload.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=1024, context=64, hidden_size=512, layers=8, heads=8))
config = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "offload": {"unit_bytes": 2 << 20}}
engine = offload.initialize(model=model, config=config)[0]
engine.save_checkpoint(sys.argv[1])
print(sum(p.ds_numel for p in model.parameters()) * 4)  # released parameters are empty: their whole size
engine.close()
"""


def _run(code: str, *args: object) -> str:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.split()[-1]


@pytest.fixture(scope="module")
def larger(tmp_path_factory):
    """A checkpoint of a 98 MiB model in 2 MiB units, and the model's bytes."""
    path = tmp_path_factory.mktemp("larger") / "ckpt"
    return path, int(_run(SAVE_A_LARGER_MODEL, path))


@pytest.mark.parametrize("max_shard", ["8 << 20", "5 << 30"], ids=["8MiB-files", "one-file"])
def test_exporting_a_model_several_times_the_memory_budget_stays_within_it(larger, tmp_path, max_shard):
    """Whether the output is many files or one, it is written tensor by tensor, never built in memory first."""
    budget = 32 << 20
    ckpt, model_bytes = larger
    assert model_bytes > 2.5 * budget
    grew = int(_run(EXPORT_UNDER_A_BUDGET.replace("max_shard_bytes=8 << 20", f"max_shard_bytes={max_shard}"),
                    ckpt, tmp_path / "out"))
    assert grew < budget, f"exporting {model_bytes / 2**20:.0f} MiB of weights grew the RSS by {grew / 2**20:.0f} MiB"
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert (files == ["model.safetensors"]) == (max_shard == "5 << 30")
    assert sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors")) >= model_bytes


def _save_16bit(rank, world, save_dir, gather):
    import offload
    config = base_config(2, 1, world)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    saved = [engine.save_16bit_model(save_dir, name) for name in ("pytorch_model.bin", "model.safetensors")]
    state = engine.full_state_dict()
    engine.close()
    return saved, state


def _save_16bit_disk_full(rank, world, save_dir, name, after):
    """Rank 0's disk fills after ``after`` tensors: every rank must raise (none left in a gather), and the engine
    must still save once there is room."""
    import errno

    import offload
    from offload.files import weights_file
    config = base_config(2, 1, world)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = offload.initialize(model=make_model("gpt"), config=config)[0]
    real = {cls: cls.write for cls in (weights_file.SafetensorsStream, weights_file.TorchStream)}
    written = [0]

    def full_disk(cls):
        def write(self, key, tensor):
            if written[0] >= after:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp))
            written[0] += 1
            real[cls](self, key, tensor)
        return write

    if rank == 0:
        for cls in real:
            cls.write = full_disk(cls)
    try:
        engine.save_16bit_model(save_dir, name)
        error = None
    except OSError as e:
        error = (e.errno, str(e))
    for cls, write in real.items():
        cls.write = write
    again = engine.save_16bit_model(save_dir, name)  # the room is back
    engine.close()
    return error, again


@pytest.mark.parametrize("name,after", [("model.safetensors", 3), ("pytorch_model.bin", 0)])
def test_a_full_disk_on_rank_0_fails_the_16bit_save_on_every_rank_and_leaves_no_file(tmp_path, name, after):
    errors = run_ranks(_save_16bit_disk_full, 2, timeout=120, save_dir=str(tmp_path), name=name, after=after)
    (own, again0), (other, again1) = errors
    assert own[0] == 28 and "No space left" in own[1]  # rank 0: its own error
    assert "rank 1: rank 0 could not write" in other[1] and name in other[1]
    assert again0 and again1 and sorted(p.name for p in tmp_path.iterdir()) == [name]  # no .tmp left behind


def test_save_16bit_model_writes_the_gathered_compute_weights_only_when_the_config_asks(tmp_path):
    from safetensors.torch import load_file
    saved, full = run_ranks(_save_16bit, 2, save_dir=str(tmp_path), gather=True)[0]
    assert saved == [True, True]
    for state in (torch.load(tmp_path / "pytorch_model.bin"), load_file(str(tmp_path / "model.safetensors"))):
        assert state.keys() == full.keys()
        for key, value in full.items():
            assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], value.to(torch.bfloat16)), key
    saved, _ = run_ranks(_save_16bit, 1, save_dir=str(tmp_path / "off"), gather=False)[0]
    assert saved == [False, False] and not (tmp_path / "off").exists()


SAVE_16BIT = """
import sys, torch, offload
sys.path.insert(0, "tests")
from memwatch import AnonPeak, rss_anon
from offload.models import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=1024, context=64, hidden_size=512, layers=8, heads=8))
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "stage3_gather_16bit_weights_on_model_save": True,
                                "stage3_param_persistence_threshold": 0},  # many small units: nothing folds
          "offload": {"unit_bytes": 2 << 20, "host_malloc": {"mmap_threshold": "128KiB"}}}
engine = offload.initialize(model=model, config=config)[0]
assert len(engine.units) > 40
torch.save(engine.full_state_dict(), sys.argv[1] + "/expected.pt")
for name in ("pytorch_model.bin", "model.safetensors"):
    before = rss_anon()
    with AnonPeak() as peak:
        assert engine.save_16bit_model(sys.argv[1] + "/out", name)
    print(sum(p.ds_numel for p in model.parameters()) * 4, peak.peak - before)
"""


def test_save_16bit_model_streams_unit_by_unit(tmp_path):
    """The gathered weights go to the file one unit at a time: the anonymous memory the save adds stays near a
    few units (2 MiB each) on a model of about fifty (with RSS tracking what is live: offload.host_malloc)."""
    from safetensors.torch import load_file
    out = subprocess.run([sys.executable, "-c", SAVE_16BIT, str(tmp_path)], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.split()
    full = torch.load(tmp_path / "expected.pt")
    for name, (model_bytes, grew) in zip(("pytorch_model.bin", "model.safetensors"), zip(out[-4::2], out[-3::2])):
        model_bytes, grew = int(model_bytes), int(grew)
        assert grew < 12 << 20, f"{name}: saving {model_bytes >> 20} MiB grew anonymous memory by {grew >> 20} MiB"
        path = tmp_path / "out" / name
        state = torch.load(path, weights_only=True) if name.endswith(".bin") else load_file(str(path))
        assert list(state) == list(full) if name.endswith(".bin") else set(state) == set(full)  # state_dict's order
        assert all(torch.equal(state[k], v) for k, v in full.items())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "pytorch_model.bin"]


def test_the_recovery_script_beside_every_checkpoint_gives_export_weights_own_values_with_only_torch(tmp_path):
    """zero_to_fp32.py needs nothing of offload: run by a bare interpreter from the checkpoint folder alone (a
    copy elsewhere, offload's sources out of reach), its files hold what export-weights writes."""
    import ast
    import shutil

    from engine_cases import batches, loss_of
    from safetensors.torch import load_file

    import offload
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.save_checkpoint(tmp_path / "save")
    engine.close()
    script = tmp_path / "save" / "zero_to_fp32.py"
    tag = (tmp_path / "save" / "latest").read_text()
    assert script.is_file() and (tmp_path / "save" / tag / "zero_to_fp32.py").is_file()
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(script.read_text()))
                if isinstance(n, ast.Import)} | {n.module.split(".")[0] for n in ast.walk(ast.parse(
                    script.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert "offload" not in imported and imported <= {"__future__", "argparse", "hashlib", "json", "os", "struct",
                                                      "sys", "collections", "pathlib", "typing", "torch"}
    moved = shutil.copytree(tmp_path / "save", tmp_path / "elsewhere")
    out = subprocess.run([sys.executable, "-I", str(moved / "zero_to_fp32.py"), str(moved), str(tmp_path / "fp32"),
                          "--max-shard-size", "60000", "--safe_serialization"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    export_weights(tmp_path / "save", tmp_path / "exported", max_shard_bytes=60000)
    ours = sorted(p.name for p in (tmp_path / "fp32").iterdir())
    assert ours == sorted(p.name for p in (tmp_path / "exported").iterdir()) and len(ours) > 2
    for name in ours:
        if name.endswith(".safetensors"):
            got, want = load_file(tmp_path / "fp32" / name), load_file(tmp_path / "exported" / name)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


def _trained_checkpoint(tmp_path):
    from engine_cases import batches, loss_of

    import offload
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.save_checkpoint(tmp_path / "save")
    full = engine.full_state_dict()
    engine.close()
    return full


def test_the_recovery_script_takes_deepspeeds_flags_and_writes_what_deepspeeds_writes(tmp_path):
    """#57 item 8: `python zero_to_fp32.py DIR OUT` writes pytorch_model.bin, which the torch.load of DeepSpeed's
    own docstring reads; sharded past --max_shard_size (DeepSpeed's spelling and units), with its index."""
    full = _trained_checkpoint(tmp_path)
    script = tmp_path / "save" / "zero_to_fp32.py"
    one = subprocess.run([sys.executable, "-I", str(script), str(tmp_path / "save"), str(tmp_path / "bin"), "-d"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["pytorch_model.bin"]
    state = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert state.keys() >= {k for k in full} and all(torch.equal(state[k], v) for k, v in full.items())
    sharded = subprocess.run([sys.executable, "-I", str(script), str(tmp_path / "save"), str(tmp_path / "shards"),
                              "--max_shard_size", "60KB"], capture_output=True, text=True, timeout=300)
    assert sharded.returncode == 0, sharded.stderr
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    for name in files:
        part = torch.load(tmp_path / "shards" / name, weights_only=True)
        assert part and all(torch.equal(v, full[k]) for k, v in part.items() if k in full), name


def test_deepspeeds_zero_to_fp32_functions_read_an_offload_checkpoint(tmp_path):
    """#57 item 8: deepspeed.utils.zero_to_fp32's functions, after the import swap."""
    import offload as deepspeed
    full = _trained_checkpoint(tmp_path)
    z2f = deepspeed.utils.zero_to_fp32
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "save")
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], v) for k, v in full.items())
    model = z2f.load_state_dict_from_zero_checkpoint(make_model("gpt", seed=5), tmp_path / "save")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
    written = z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "save", tmp_path / "safe",
                                                             safe_serialization=True)
    assert written == ["model.safetensors"]
