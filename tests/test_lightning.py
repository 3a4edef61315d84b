"""offload.lightning: a LightningModule fitted by Lightning's Trainer with an offload_* strategy trains as under
Lightning's own DDP (tests/lightning_scripts/fit.py, run as a script per side: losses, learning rates, validation,
final weights), at one process and at two through Lightning's own launcher; fit(ckpt_path=...) from a
ModelCheckpoint resumes bitwise; DeepSpeed is never imported; what it cannot run is refused by name.

The scripts run as `python script.py` (and at two ranks as under torchrun) in processes forked from one zygote per
module that imported Lightning and offload once (tests/zygote.py): Lightning's import alone is about 6 s of CPU. The
two tests named for Lightning's and Fabric's own launchers start the script as a subprocess, as a user does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from zygote import Zygote, succeeded  # noqa: E402

FIT = Path(__file__).parent / "lightning_scripts" / "fit.py"
FABRIC_LOOP = Path(__file__).parent / "lightning_scripts" / "fabric_loop.py"


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(["lightning", "lightning.pytorch", "offload.lightning", "offload.zero.compiled"])
    yield z
    z.close()


def launched(script: Path, cwd: Path, *argv: str) -> str:
    """The script started as a user starts it (Lightning's launcher then starts its other ranks): its stderr."""
    # faulthandler: a rank that aborts (the rare "terminate called without an active exception" at exit, see
    # docs/testing.md) prints every thread's Python stack into stderr, which the assertion shows
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, proc.stderr[-8000:]
    return proc.stderr


def fit(zygote: Zygote | None, strategy: str, out: Path, *extra: str, devices: int = 1) -> list[dict]:
    """Each rank's record of one run; without a zygote through Lightning's own launcher."""
    argv = (strategy, str(out), "--devices", str(devices), *extra)
    if zygote is None:
        stderr = launched(FIT, out.parent, *argv)
    else:
        stderr = succeeded(zygote.script(FIT, *argv, world=devices, cwd=out.parent))
    records = [torch.load(f"{out}.{rank}.pt") for rank in range(devices)]
    for record in records:
        record["stderr"] = stderr
    return records


def assert_trains_as(ours: dict, plain: dict) -> None:
    """fp32: equal to the rounding of a gradient reduced in another order."""
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)
    assert ours["val_losses"] == pytest.approx(plain["val_losses"], rel=1e-5, abs=1e-6)
    assert ours["validated"] == pytest.approx(plain["validated"], rel=1e-5)
    assert ours["lrs"] == plain["lrs"] and ours["global_step"] == plain["global_step"] == 8
    assert ours["weights"].keys() == plain["weights"].keys()
    for key, value in plain["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    assert ours["strategy"] == "OffloadStrategy" and not ours["deepspeed_imported"]


@pytest.fixture(scope="module")
def ddp_run(zygote, tmp_path_factory) -> dict:
    """Lightning's DDP at one process: the reference the one-process runs compare with (run once per worker)."""
    plain, = fit(zygote, "ddp", tmp_path_factory.mktemp("ddp") / "ddp")
    return plain


@pytest.mark.parametrize("strategy", ["offload_stage_3_offload", "offload_stage_2"])
def test_a_lightning_module_trains_on_the_engine_as_under_ddp(zygote, tmp_path, strategy, ddp_run):
    """Accumulation 2 (the loss divided once, see [Note: the loss is divided once]), clipping at 0.5, a StepLR
    stepped by Lightning, validation inside the fit and trainer.validate after it (on the fit's engine)."""
    plain = ddp_run
    ours, = fit(zygote, strategy, tmp_path / "offload")
    assert_trains_as(ours, plain)
    whole = sum(v.numel() for k, v in plain["weights"].items() if k != "batches")  # the parameters
    assert ours["params_total"] == whole and sum(ours["params_per_device"][1:]) == whole  # the model summary


def test_blocks_compiled_in_configure_model_train_under_the_strategy_as_under_ddp(zygote, tmp_path):
    """#69: blocks compiled in place in configure_model: each one unit, its gathers outside its graph, the losses
    and weights of the same compiled blocks under DDP."""
    plain, = fit(zygote, "ddp", tmp_path / "ddp", "--compile", "aot_eager")
    ours, = fit(zygote, "offload_stage_3_offload", tmp_path / "offload", "--compile", "aot_eager")
    assert_trains_as(ours, plain)
    assert ours["compiled"]["compiled"] == ["net.blocks.0", "net.blocks.1"]
    # the training graph and validation's (no gradients), as under DDP; no break
    assert ours["graphs"] == plain["graphs"] == 2 and ours["graph_breaks"] == plain["graph_breaks"] == 0


def test_two_processes_through_lightnings_launcher(zygote, tmp_path):
    """The offload side started as a user starts it (Lightning's launcher starts rank 1); DDP's reference forked."""
    plain = fit(zygote, "ddp", tmp_path / "ddp", devices=2)
    ours = fit(None, "offload_stage_3_offload", tmp_path / "offload", devices=2)
    for rank in range(2):
        assert ours[rank]["world"] == 2
        assert_trains_as(ours[rank], plain[rank])
    whole = sum(v.numel() for k, v in plain[0]["weights"].items() if k != "batches")  # the parameters
    # the summary's "Params per Device": each rank's shard of the units, half of the model between them
    assert ours[0]["params_per_device"][0] + ours[1]["params_per_device"][0] == whole
    assert 0 < ours[0]["params_per_device"][0] < whole


def test_manual_optimization_trains_as_under_ddp(zygote, tmp_path):
    """A training_step that calls manual_backward and optimizer.step itself (as GANs and RL modules do), at two
    processes: DDP's losses, learning rates and weights (see [Note: manual optimization runs beside the forward]).
    Before, the step inside the engine's forward was refused: the root's unit was in use by that forward."""
    plain = fit(zygote, "ddp", tmp_path / "ddp", "--manual", devices=2)
    ours = fit(zygote, "offload_stage_3_offload", tmp_path / "offload", "--manual", devices=2)
    for rank in range(2):
        assert ours[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-5, abs=1e-6)
        assert ours[rank]["lrs"] == plain[rank]["lrs"] and ours[rank]["global_step"] == plain[rank]["global_step"]
        for key, value in plain[rank]["weights"].items():
            torch.testing.assert_close(ours[rank]["weights"][key], value, rtol=1e-5, atol=1e-6)


def test_fit_from_a_model_checkpoint_resumes_bitwise(zygote, tmp_path):
    whole, = fit(zygote, "offload_stage_3_offload", tmp_path / "whole", "--save", str(tmp_path / "saved"))
    saved = tmp_path / "saved" / "epoch=0-step=4.ckpt"
    assert (saved / "latest").is_file() and (saved / "checkpoint").is_dir()  # the engine's folder, as DeepSpeed's
    resumed, = fit(zygote, "offload_stage_3_offload", tmp_path / "resumed", "--resume", str(saved))
    assert resumed["losses"] == whole["losses"][8:] and resumed["lrs"] == whole["lrs"][8:]
    assert resumed["val_losses"] == whole["val_losses"][4:] and resumed["validated"] == whole["validated"]
    for key, value in whole["weights"].items():  # the module's buffer too
        assert torch.equal(resumed["weights"][key], value), key
    # Lightning's state (loops, callbacks, hyperparameters) was kept as plain data: nothing left out on load
    assert "left out" not in resumed["stderr"]


def test_a_single_file_checkpoint_loads_into_the_shards(zygote, tmp_path):
    """OffloadStrategy(load_full_weights=True): a plain Lightning checkpoint (DDP's ModelCheckpoint file) read into
    the stage-3 shards at two ranks: the resumed run's first step sees DDP's weights exactly on each rank, and each
    rank's buffer its saved value (the optimizer state is not in such a file, as Lightning warns). A file missing a
    key of the model is refused before anything is written."""
    plain = fit(zygote, "ddp", tmp_path / "ddp", "--save", str(tmp_path / "saved"), devices=2)
    saved = tmp_path / "saved" / "epoch=0-step=4.ckpt"
    assert saved.is_file()
    ours = fit(zygote, "offload_stage_3_offload", tmp_path / "offload", "--full-weights", "--resume", str(saved),
               devices=2)
    for rank in range(2):
        assert ours[rank]["losses"][:2] == plain[rank]["losses"][8:10]  # the first step, before any update
        assert ours[rank]["batches"] == plain[rank]["batches"] == 16  # 8 saved, 8 more
    assert "optimizer states cannot be restored" in ours[0]["stderr"]

    checkpoint = torch.load(saved, weights_only=False)
    del checkpoint["state_dict"]["net.head.bias"]
    torch.save(checkpoint, tmp_path / "lacking.ckpt")
    refused, = zygote.script(FIT, "offload_stage_3_offload", str(tmp_path / "lacking"), "--full-weights", "--resume",
                             str(tmp_path / "lacking.ckpt"), cwd=tmp_path)
    assert refused.code != 0 and "missing keys: net.head.bias" in refused.output


def test_bf16_mixed_runs_the_engine_in_bf16(zygote, tmp_path, ddp_run):
    """DeepSpeed's meaning of bf16-mixed under Lightning: bf16 weights and inputs, an fp32 master (beside the fp32
    run, which the offload strategies equal to fp32 rounding: the test above)."""
    fp32 = ddp_run
    bf16, = fit(zygote, "offload_stage_3_offload", tmp_path / "bf16", "--precision", "bf16-mixed")
    assert bf16["losses"] != fp32["losses"]
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=5e-2, abs=1e-2)
    assert all(v.dtype == torch.float32 for v in bf16["weights"].values())  # the master, whole


def fabric_loop(zygote: Zygote | None, tmp_path: Path, devices: int) -> list[dict]:
    """Each rank's record of the Fabric loop's four runs (ddp, offload, offload resumed, offload from DDP's file);
    without a zygote through Fabric's own launcher."""
    argv = (str(tmp_path / "out"), "--folder", str(tmp_path), "--devices", str(devices))
    if zygote is None:
        stderr = launched(FABRIC_LOOP, tmp_path, *argv)
    else:
        stderr = succeeded(zygote.script(FABRIC_LOOP, *argv, cwd=tmp_path))
    records = [torch.load(tmp_path / f"out.{rank}.pt") for rank in range(devices)]
    for record in records:
        record["stderr"] = stderr
    return records


@pytest.mark.parametrize("devices", [1, 2])
def test_a_fabric_loop_trains_on_the_engine_as_under_ddp_and_resumes_bitwise(zygote, tmp_path, devices):
    """The loop a Fabric user of DeepSpeed writes (fabric.init_module, fabric.setup(model, optimizer,
    scheduler=...), accumulation 2 by two fabric.backward calls and one optimizer.step, clipping at 0.5 from the
    config where DDP's loop calls fabric.clip_gradients, the scheduler stepped by the script, fabric.save and
    fabric.load of model, optimizer, scheduler and a counter) against the same loop under ddp; at two processes
    through Fabric's own launcher."""
    for record in fabric_loop(zygote if devices == 1 else None, tmp_path, devices):
        plain, ours, resumed, full = record["ddp"], record["offload"], record["resumed"], record["full_weights"]
        assert ours["strategy"] == "OffloadStrategy" and ours["world"] == devices and not record["deepspeed_imported"]
        assert max(plain["norms"]) > 0.5  # the clipping bit
        assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6) and ours["lrs"] == plain["lrs"]
        for key, value in plain["weights"].items():  # the module's buffer too
            torch.testing.assert_close(ours["weights"][key], value, rtol=1e-5, atol=1e-6)
        # resumed from the folder fabric.save wrote after step 4: the steps after it, bitwise
        assert resumed["losses"] == ours["losses"][8:] and resumed["lrs"] == ours["lrs"][4:]
        for key, value in ours["weights"].items():
            assert torch.equal(resumed["weights"][key], value), key
        # load_full_weights: DDP's single file cut into the shards; the next step's losses are DDP's exactly
        assert full["losses"] == plain["losses"][8:10]
        refused = resumed["refused"]
        assert refused["load not strict"].startswith("ValueError: fabric.load(..., strict=False)")
        assert refused["save without the model"].startswith("ValueError: fabric.save(path, state): the state must "
                                                             "hold exactly one model")
        assert refused["save with a filter"].startswith("TypeError: fabric.save(..., filter=...) is not supported")
        assert refused["step with a closure"].startswith("TypeError: optimizer.step(closure)")
        assert refused["clip_gradients"].startswith("NotImplementedError")  # DeepSpeed's: the config's clipping
    assert "partitioned parameters as empty" not in record["stderr"]
    assert "parameters on different devices" not in record["stderr"]  # the engine places them; nothing moves


def test_the_strategy_names_mirror_deepspeeds():
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    import offload.lightning  # noqa: F401
    from offload.lightning import OffloadStrategy
    theirs = {k: v for k, v in StrategyRegistry.items() if v["strategy"] is DeepSpeedStrategy}
    assert len(theirs) == 7
    for name, entry in theirs.items():
        ours = StrategyRegistry["offload" + name[len("deepspeed"):]]
        assert ours["strategy"] is OffloadStrategy and ours["init_params"] == entry["init_params"]
    assert issubclass(OffloadStrategy, DeepSpeedStrategy)  # what Lightning's precision plugin and callbacks gate on
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
    theirs = {k: v for k, v in STRATEGY_REGISTRY.items() if v["strategy"] is FabricDeepSpeed}
    assert len(theirs) == 8  # Fabric's has deepspeed_stage_1_offload too
    for name, entry in theirs.items():
        ours = STRATEGY_REGISTRY["offload" + name[len("deepspeed"):]]
        assert ours["strategy"] is offload.lightning.fabric.OffloadStrategy
        assert ours["init_params"] == entry["init_params"]


def test_the_trainer_gives_it_deepspeeds_precision_plugin_and_config():
    import lightning as L
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from offload.lightning import OffloadStrategy
    trainer = L.Trainer(strategy="offload_stage_3_offload_nvme", accelerator="cpu", devices=1,
                        precision="bf16-mixed", logger=False)
    assert isinstance(trainer.strategy, OffloadStrategy) and isinstance(trainer.precision_plugin, DeepSpeedPrecision)
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["sub_group_size"] == "auto"  # not Lightning's 1e12, which would make one buffer of the state
    assert OffloadStrategy(stage=3, sub_group_size=10**8).config["zero_optimization"]["sub_group_size"] == 10**8
    given = OffloadStrategy(config={"zero_optimization": {"stage": 2}, "offload": {"unit_bytes": 1 << 20}})
    assert given.config == {"zero_optimization": {"stage": 2}, "offload": {"unit_bytes": 1 << 20}}
    assert not given.zero_stage_3


def test_fabric_gives_it_deepspeeds_precision_and_joint_set_up():
    import lightning as L
    from lightning.fabric.plugins.precision import DeepSpeedPrecision

    from offload.lightning.fabric import OffloadStrategy
    fabric = L.Fabric(strategy="offload_stage_3_offload", accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(fabric.strategy, OffloadStrategy) and isinstance(fabric._precision, DeepSpeedPrecision)
    zero = fabric.strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert fabric.strategy._backward_sync_control is None  # no_backward_sync says so, as under DeepSpeed
    with pytest.raises(ValueError, match="exclude_frozen_parameters=True"):
        OffloadStrategy(exclude_frozen_parameters=True)


def test_what_it_cannot_run_is_refused_by_name():
    from offload.lightning import OffloadStrategy
    with pytest.raises(ValueError, match="exclude_frozen_parameters=True: offload's checkpoint holds every"):
        OffloadStrategy(exclude_frozen_parameters=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stages'"):
        OffloadStrategy(stages=3)  # DeepSpeedStrategy's signature, checked as it checks it
