"""Loading a checkpoint never runs code (#46): a rank file rewritten with a pickle whose ``__reduce__`` calls
``os.system``, and its sha256 put into meta.json as a writer would, is refused by every reader, unbuilt; plain
client_state round-trips bitwise; a script's objects in client_state are kept aside and loaded only on trust; an
old checkpoint loads, or gets the one-line conversion."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_model

import offload
from offload.commands.cli import main
from offload.files import small_state
from offload.files.training_checkpoint import CheckpointError


class _Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train_cli(out: Path, *extra: str) -> int:
    return main(["train", "--out", str(out), "--steps", "2", "--save-every", "2", "--print-every", "5",
                 "--nvme-path", str(out.parent / "swap"), *extra])


def _rewrite_rank0(tag_dir: Path, change, fmt: int | None = None) -> None:
    """rank0.pt rewritten by ``torch.save`` after ``change(state)``, its checksum in meta.json made to match (as
    any writer can), and meta.json's format set to ``fmt`` if given."""
    state = torch.load(tag_dir / "rank0.pt", weights_only=False)
    change(state)
    torch.save(state, tag_dir / "rank0.pt")
    meta = json.loads((tag_dir / "meta.json").read_text())
    meta["files"]["rank0.pt"] = hashlib.sha256((tag_dir / "rank0.pt").read_bytes()).hexdigest()
    if fmt is not None:
        meta["format"] = fmt
    (tag_dir / "meta.json").write_text(json.dumps(meta))


def _poison(tag_dir: Path, marker: Path) -> None:
    """The attack: the payload inside client_state."""
    _rewrite_rank0(tag_dir, lambda state: state.update(client_state={"step": 2, "note": _Payload(marker)}))


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    root = tmp_path_factory.mktemp("poisoned")
    assert _train_cli(root / "run") == 0
    save_dir = root / "run" / "checkpoints"
    tag_dir = save_dir / (save_dir / "latest").read_text()
    marker = root / "payload-ran"
    _poison(tag_dir, marker)
    return save_dir, tag_dir, marker


def test_resume_refuses_the_payload_and_runs_nothing(poisoned, capsys):
    save_dir, _, marker = poisoned
    assert _train_cli(save_dir.parent, "--resume", "--steps", "4") != 0
    assert not marker.exists()
    assert "only an unrestricted unpickler" in capsys.readouterr().err


def test_export_weights_refuses_the_payload_and_runs_nothing(poisoned, tmp_path, capsys):
    save_dir, _, marker = poisoned
    assert main(["export-weights", str(save_dir), str(tmp_path / "weights")]) != 0
    assert not marker.exists()
    assert "offload convert-checkpoint" in capsys.readouterr().err


def test_inspect_reports_the_checkpoint_unsafe_and_runs_nothing(poisoned, capsys):
    save_dir, _, marker = poisoned
    assert main(["inspect", str(save_dir)]) == 1
    assert not marker.exists()
    assert "unsafe: rank0.pt" in capsys.readouterr().err


def _engine():
    torch.manual_seed(0)
    return offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))[0]


def _steps(engine, n, start=0):
    losses = []
    for tokens in batches(start + n, 2)[start:]:
        losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
        engine.step()
    return losses


def test_load_checkpoint_refuses_the_payload_in_any_rank_file(tmp_path):
    engine = _engine()
    _steps(engine, 1)
    engine.save_checkpoint(tmp_path)
    tag_dir = tmp_path / (tmp_path / "latest").read_text()
    marker = tmp_path / "payload-ran"
    _poison(tag_dir, marker)
    with pytest.raises(CheckpointError, match="rank0.pt holds objects that only an unrestricted unpickler can build"):
        engine.load_checkpoint(tmp_path)
    assert not marker.exists()
    engine.close()


def test_plain_client_state_round_trips_and_the_resume_is_bitwise(tmp_path):
    client = {"epoch": 3, "lr": 1e-3, "name": "run-a", "history": [1.5, 2.5], "ema": {"w": torch.arange(4.0),
              "nested": {"k": (1, 2)}}, "none": None}
    engine = _engine()
    _steps(engine, 2)
    engine.save_checkpoint(tmp_path, client_state=client)
    after = _steps(engine, 2, start=2)
    straight = engine.full_state_dict()
    engine.close()
    resumed = _engine()
    _, got = resumed.load_checkpoint(tmp_path)
    assert torch.equal(got["ema"]["w"], client["ema"]["w"])
    assert {k: got[k] for k in client if k != "ema"} == {k: v for k, v in client.items() if k != "ema"}
    assert _steps(resumed, 2, start=2) == after
    for key, value in resumed.full_state_dict().items():
        assert torch.equal(value, straight[key]), key
    resumed.close()
    assert main(["inspect", str(tmp_path)]) == 0


def test_objects_in_client_state_are_kept_aside_and_loaded_only_on_trust(tmp_path, caplog):
    import argparse
    args = argparse.Namespace(lr=0.1, name="x")
    engine = _engine()
    _steps(engine, 1)
    with caplog.at_level("WARNING", logger="offload.checkpoint"):
        engine.save_checkpoint(tmp_path, client_state={"step": 1, "args": args})
    assert "client_state 'args' (argparse.Namespace) is not plain data" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload.checkpoint"):
        _, got = engine.load_checkpoint(tmp_path)
    assert got["step"] == 1 and "args" not in got and "'args' (argparse.Namespace) left out" in caplog.text
    assert "trust_client_state=True" in caplog.text
    _, trusted = engine.load_checkpoint(tmp_path, trust_client_state=True)
    assert trusted["step"] == 1 and trusted["args"] == args
    engine.close()
    assert main(["inspect", str(tmp_path)]) == 1  # intact, but holds what only an unrestricted unpickler reads


def test_a_schedule_whose_state_is_not_plain_data_is_refused_at_save_naming_it(tmp_path):
    class Odd(torch.optim.lr_scheduler.LambdaLR):
        def state_dict(self):
            return {**super().state_dict(), "when": np.datetime64("2026-01-01")}
    model = make_model("gpt")
    config = base_config(2, 1, 1)
    engine, *_ = offload.initialize(model=model, config=config, lr_scheduler=lambda o: Odd(o, lambda s: 1.0))
    _steps(engine, 1)
    with pytest.raises(ValueError, match=r"the LR scheduler's state_dict\(\)\['when'\] is a numpy.datetime64"):
        engine.save_checkpoint(tmp_path)
    assert not (tmp_path / "latest").exists()
    engine.close()


def _numpy_state_as_format_1(state) -> None:
    """What an offload before this change wrote: numpy's RNG state as its tuple (an array inside)."""
    state["rng"]["numpy"] = np.random.get_state()


def test_an_old_checkpoint_loads_with_the_safe_reader_or_converts_in_one_command(tmp_path, capsys):
    engine = _engine()
    _steps(engine, 1)
    engine.save_checkpoint(tmp_path / "a", client_state={"step": 1})
    engine.save_checkpoint(tmp_path / "b", client_state={"step": 1})
    engine.close()
    old = tmp_path / "a" / (tmp_path / "a" / "latest").read_text()
    _rewrite_rank0(old, _numpy_state_as_format_1, fmt=1)
    fresh = _engine()
    _, got = fresh.load_checkpoint(tmp_path / "a")  # numpy's arrays are the one thing the safe reader adds
    assert got["step"] == 1
    # One written with an object the safe reader refuses: the error names the command; the command converts it,
    # numpy's state included.
    odd = tmp_path / "b" / (tmp_path / "b" / "latest").read_text()

    def odd_format_1(state):
        _numpy_state_as_format_1(state)
        state["client_state"] = {"step": 1, "when": np.datetime64("2026-01-01")}
    _rewrite_rank0(odd, odd_format_1, fmt=1)
    np.random.random(700)  # this process's generator moves on from the state the file holds
    numpy_before = np.random.get_state()[1].copy()
    with pytest.raises(CheckpointError, match=f"offload convert-checkpoint {odd}"):
        fresh.load_checkpoint(tmp_path / "b")
    assert main(["convert-checkpoint", str(tmp_path / "b")]) == 0
    assert "'when' kept pickled" in capsys.readouterr().out
    assert np.array_equal(np.random.get_state()[1], numpy_before)  # converting left this process's generator be
    assert isinstance(small_state.read(odd / "rank0.pt")["rng"]["numpy"], dict)
    _, got = fresh.load_checkpoint(tmp_path / "b")
    assert got["step"] == 1 and "when" not in got
    fresh.close()


def test_the_trainers_resume_refuses_the_payload(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_trainer import DS, arguments, data
    from test_pretrained import save, tiny

    import offload.hf
    path = save(tiny("llama"), tmp_path / "model")

    def trainer(out, **kw):
        return offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=DS,
                                  args=arguments(tmp_path / out, **kw), train_dataset=data(rows=8))
    trainer("first", save_strategy="steps", save_steps=2).train()
    saved = tmp_path / "first" / "checkpoint-2" / "offload"
    marker = tmp_path / "payload-ran"
    _poison(saved / (saved / "latest").read_text(), marker)
    with pytest.raises(CheckpointError, match="only an unrestricted unpickler"):
        trainer("second").train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    assert not marker.exists()


def test_no_reader_in_offload_unpickles_a_file_but_the_trusted_ones():
    """torch.load lives in one room (its restricted reader, and the opt-in one); pickle.load reads only the
    results offload's own worker processes send back."""
    root = Path(offload.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        if "torch.load(" in text:
            assert rel in ("files/small_state.py", "files/zero_to_fp32.py"), rel
        if "pickle.load" in text:
            assert rel == "machine/launch.py", rel
    text = (root / "files" / "small_state.py").read_text()
    assert text.count("weights_only=False") == 1 and "def read_trusted" in text
    assert "weights_only=False" not in (root / "files" / "zero_to_fp32.py").read_text()
