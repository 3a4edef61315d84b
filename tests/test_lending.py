"""engine.offload_states() / reload_states() (offload/engine/lending.py): between steps, what the engine keeps on the
device goes to host memory and its device storages shrink to nothing; after reload_states training goes on bit for
bit as if nothing had moved. Run on the emulated discrete device (host and device memory kept apart on a CPU)."""

import pytest
import torch
from engine_cases import STREAM_CHECK, base_config, batches, check_bitwise, loss_of, make_model, train_engine
from test_partial_offload import ratio_config

import offload
from offload.engine.errors import EngineError
from offload.engine.lending import OffloadStateTypeEnum
from offload.machine.launch import run_ranks

DISCRETE = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
STEPS = 4


def _lend_after(rank, world, at, include=None, device="cpu", **kwargs):
    """train_engine, lending the device's states back after step ``at`` and reloading them: what was lent, what the
    device's storages held meanwhile, and that the engine refused work while they were away."""
    seen = {}

    def lend(i, engine):
        if i != at:
            return
        engine.offload_states(include=include, device=device)
        seen["lent"] = engine.states_offloaded
        seen["spilled"] = engine._lent.spilled
        seen["files"] = _lent_files(engine, kwargs["config"]) if device == "nvme" else []
        seen["unit_bytes"] = sum(u.full.untyped_storage().nbytes() for u in engine.units)
        seen["state_bytes"] = sum(t.untyped_storage().nbytes() for t in engine.optimizer.store.device_memory())
        with pytest.raises(EngineError, match="call engine.reload_states"):
            engine(batches(1, 2)[0][:, :-1])
        if device == "nvme":  # the drive fails the first read: the states stay offloaded, and a retry brings them
            import errno

            from offload.aio.base import SwapIOError
            io, read = engine._lent._spill.io, engine._lent._spill.io.read

            def failing(*args, **kwargs):
                io.read = read
                raise SwapIOError(errno.EIO, "lent-1", 0, 0, "read")
            io.read = failing
            with pytest.raises(EngineError, match="the states are still offloaded, on NVMe"):
                engine.reload_states()
            seen["after_failed_read"] = engine.states_offloaded
        engine.reload_states()
        seen["back"] = engine.states_offloaded
        if device == "nvme":
            seen["files_after"] = _lent_files(engine, kwargs["config"])
    return train_engine(rank, world, after_step=lend, finished=lambda engine: {"seen": seen}, **kwargs)


def _lent_files(engine, config):
    swap_dir = engine._swaps.at(config["zero_optimization"]["offload_optimizer"]["nvme_path"])[0]
    return sorted(p.name for p in swap_dir.path.iterdir() if p.name.startswith("lent"))


def configs():
    stage2 = base_config(2, 1, 2, stage=2, offload_optimizer={"device": "none"})
    return {"stage 3, half the state on the device": ratio_config(2, 1, 0.5),
            "stage 2, state on the device": stage2}


@pytest.mark.parametrize("case", list(configs()))
def test_lent_and_reloaded_states_train_on_bit_for_bit(case):
    config = configs()[case]
    plain = run_ranks(train_engine, 2, env=DISCRETE, name="gpt", config=config, steps=STEPS, micro=2, accum=1)
    lent = run_ranks(_lend_after, 2, env=DISCRETE, at=1, name="gpt", config=config, steps=STEPS, micro=2, accum=1)
    check_bitwise(lent, plain)
    for rank in lent:
        seen = rank["seen"]
        assert seen["lent"] > 0 and seen["back"] == 0
        assert seen["unit_bytes"] == 0 and seen["state_bytes"] == 0  # every device storage given back


def test_states_lent_to_nvme_leave_host_memory_and_train_on_bit_for_bit(tmp_path):
    """device="nvme": the kept bytes go through host memory into a file of their own in the config's NVMe
    directory (DeepSpeed refuses it), which the reload reads back and removes; a read the drive fails leaves
    them offloaded, and the reload called again brings them back whole."""
    config = ratio_config(2, 1, 0.5)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    plain = run_ranks(train_engine, 2, env=DISCRETE, name="gpt", config=config, steps=STEPS, micro=2, accum=1)
    lent = run_ranks(_lend_after, 2, env=DISCRETE, at=1, device="nvme", name="gpt", config=config, steps=STEPS,
                     micro=2, accum=1)
    check_bitwise(lent, plain)
    for rank in lent:
        seen = rank["seen"]
        assert seen["lent"] > 0 and seen["spilled"] and seen["back"] == 0 and seen["state_bytes"] == 0
        assert seen["files"] == ["lent-1"] and seen["files_after"] == []
        assert seen["after_failed_read"] == seen["lent"]  # a failed read kept them offloaded; the retry trained on


def _lend_to_a_full_drive(rank, world, mnt):
    """offload_states to a drive with no room: refused, nothing moved, and training goes on."""
    config = ratio_config(1, 1, 0.5)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(mnt)
    engine, *_ = offload.initialize(model=make_model("gpt"), config=config)
    tokens = batches(2, 2)
    engine.backward(loss_of(engine, "gpt", tokens[0]))
    engine.step()
    engine._swaps.at(str(mnt))  # the swap directory exists; then the drive fills
    with open(mnt / "filler", "wb") as f:
        try:
            f.write(b"\0" * (64 << 20))
        except OSError:
            pass
    with pytest.raises(EngineError, match=r"no space left.*nothing moved"):
        engine.offload_states(device="nvme")
    out = {"lent": engine.states_offloaded,
           "state_bytes": sum(t.untyped_storage().nbytes() for t in engine.optimizer.store.device_memory())}
    engine.backward(loss_of(engine, "gpt", tokens[1]))
    engine.step()
    out["steps"] = engine.global_steps
    engine.close()
    return out


def test_a_full_drive_refuses_the_lending_and_nothing_moves(small_fs):
    out = run_ranks(_lend_to_a_full_drive, 1, env=DISCRETE, mnt=small_fs(8))[0]
    assert out["lent"] == 0 and out["state_bytes"] > 0 and out["steps"] == 2


def test_include_names_what_moves():
    """optim_states alone: the state's slots go, the parameters stay."""
    config = ratio_config(1, 1, 0.5)
    lent = run_ranks(_lend_after, 1, env=DISCRETE, at=0, include=[OffloadStateTypeEnum.optim_states], name="gpt",
                     config=config, steps=2, micro=2, accum=1)
    seen = lent[0]["seen"]
    assert seen["state_bytes"] == 0 and seen["lent"] > 0
    assert seen["unit_bytes"] > 0  # in place at W = 1: the parameters' memory, left on the device


def _misuse(rank, world):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 2, 1))
    tokens = batches(1, 2)[0]
    out = {}
    with pytest.raises(EngineError, match="nothing is offloaded"):
        engine.reload_states()
    with pytest.raises(EngineError, match=r"this config names none: set zero_optimization.offload_optimizer.nvme_path"):
        engine.offload_states(device="nvme")
    with pytest.raises(EngineError, match=r"device='none'"):
        engine.offload_states(device="none")
    with pytest.raises(EngineError, match="'weights' is not a valid OffloadStateTypeEnum.*optim_states"):
        engine.offload_states(include=["weights"])
    engine.backward(loss_of(engine, "gpt", tokens))
    engine.step()  # the first of two micro-batches
    with pytest.raises(EngineError, match=r"between micro-batches \(1 of 2 in\).*after engine.step\(\)"):
        engine.offload_states()
    engine.backward(loss_of(engine, "gpt", tokens))
    engine.step()
    engine.offload_states()
    with pytest.raises(EngineError, match="states are offloaded"):
        engine.save_checkpoint("/nonexistent")
    from offload.utils import safe_get_full_fp32_param
    with pytest.raises(EngineError, match="states are offloaded"):
        safe_get_full_fp32_param(next(engine.module.parameters()))
    engine.reload_states()
    out["steps"] = engine.global_steps
    engine.close()
    return out


def test_what_cannot_be_done_is_said():
    assert run_ranks(_misuse, 1, env=DISCRETE)[0]["steps"] == 1


def test_on_a_cpu_device_nothing_moves_and_the_engine_still_waits_for_the_reload():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(2, 1, 1))
    engine.backward(loss_of(engine, "gpt", batches(1, 2)[0]))
    engine.step()
    engine.offload_states()
    assert engine.states_offloaded == 0  # the device is host memory here
    with pytest.raises(EngineError, match="call engine.reload_states"):
        engine.step()
    engine.reload_states()
    engine.close()
    assert torch.is_tensor(batches(1, 2)[0])
