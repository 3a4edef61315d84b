"""The delayed parameter update (opt-in, not exact by design): after its warm-up each update reaches the parameters
one step late, as a PyTorch loop that applies each update one step late does (see [Note: delayed update] in
offload/optim/early_step.py)."""

import copy

import pytest
import torch
from engine_cases import (
    STREAM_CHECK,
    base_config,
    batches,
    describe_engine,
    loss_of,
    make_model,
    train_engine,
    train_reference,
)

import offload
from offload.machine.launch import run_ranks

STEPS, WARMUP = 6, 2


def delayed_config(world, accum, warmup=WARMUP, **zero):
    config = base_config(2, accum, world, **zero)
    config["offload"]["delayed_update"] = {"warmup_steps": warmup}
    return config


def one_step_late_reference(steps, rows, micro, warmup, clip=1.0):
    """torch.optim.AdamW on master weights; the model the batches run through gets each step's new masters at once
    for the first ``warmup`` steps, then the masters from before the step (the previous update) each step."""
    model = make_model("gpt")
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step, tokens in enumerate(batches(steps, rows), 1):
        chunks = tokens.split(micro)
        total = 0.0
        for chunk in chunks:
            loss = loss_of(model, "gpt", chunk)
            (loss / len(chunks)).backward()
            total += loss.item()
        losses.append(total / len(chunks))
        for m, p in zip(master.parameters(), model.parameters()):
            m.grad, p.grad = p.grad, None
        torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        before = [m.detach().clone() for m in master.parameters()]
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m, old in zip(model.parameters(), master.parameters(), before):
                p.copy_(m if step <= warmup else old)
    return {"losses": losses, "state": {k: v.clone() for k, v in master.state_dict().items()}}


# On a discrete device (emulated) a device home's new shard is written into its host copy at once and only the copy
# back waits; elsewhere it waits in a staging buffer.
@pytest.mark.parametrize("world,accum,discrete", [(1, 1, False), (2, 2, False), (1, 1, True), (1, 2, True)])
def test_the_delayed_update_trains_as_the_one_step_late_reference(world, accum, discrete):
    env = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"} if discrete else None
    results = run_ranks(train_engine, world, env=env, name="gpt", config=delayed_config(world, accum), steps=STEPS,
                        micro=2, accum=accum)
    late = one_step_late_reference(STEPS, 2 * accum * world, 2, WARMUP)
    exact = train_reference("gpt", STEPS, 2 * accum * world, 2, world=world)
    for rank in results:
        assert rank["mode"].startswith("delayed update after 2 exact steps")
        assert rank["counts"]["optimizer_delayed"] == (STEPS - WARMUP) * rank["units"]
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(late["losses"]), rtol=1e-5, atol=1e-5)
        for key, value in late["state"].items():  # the masters: every update applied, the last one too
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")
    # the delay shows: the same batches with the exact step give other losses from step WARMUP + 2 on
    assert late["losses"][:WARMUP + 1] == pytest.approx(exact["losses"][:WARMUP + 1], rel=1e-5)
    assert abs(late["losses"][-1] - exact["losses"][-1]) > 1e-4


def test_a_warm_up_as_long_as_the_run_is_the_exact_step_bitwise():
    runs = [run_ranks(train_engine, 1, name="gpt", config=config, steps=4, micro=2, accum=1)[0]
            for config in (delayed_config(1, 1, warmup=4), base_config(2, 1, 1))]
    assert runs[0]["losses"] == runs[1]["losses"] and "optimizer_delayed" not in runs[0]["counts"]
    for key, value in runs[1]["state"].items():
        assert torch.equal(runs[0]["state"][key], value), key


def test_a_lagging_worker_changes_nothing():
    """The worker's Adam delayed by the emulation: the next step still publishes exactly the staged update (a
    missing wait would publish a half-written one)."""
    lag = {"OFFLOAD_EMULATED_HOST_DELAY_S": "0.01"}
    runs = [run_ranks(train_engine, 1, env=env, name="gpt", config=delayed_config(1, 1), steps=5, micro=2,
                      accum=1)[0] for env in (lag, None)]
    assert runs[0]["losses"] == runs[1]["losses"]
    for key, value in runs[1]["state"].items():
        assert torch.equal(runs[0]["state"][key], value), key


@pytest.mark.parametrize("accum", [1, 2])
def test_the_next_backward_lands_beside_a_lagging_delayed_adam_and_changes_nothing(accum):
    """On a discrete device (emulated) each gradient comes down into a landing buffer. The delayed Adam runs on a
    thread of its own, lagging here, while the next backward's gradients land: each unit's landing waits until
    that Adam has read the unit's last gradient (a missing wait lands the new gradient under it)."""
    slow = {**STREAM_CHECK, "OFFLOAD_EMULATED_COPY_DELAY_S": "0.001", "OFFLOAD_EMULATED_HOST_DELAY_S": "0.03"}
    runs = [run_ranks(train_engine, 1, env=env, name="gpt", config=delayed_config(1, accum, warmup=1), steps=4,
                      micro=2, accum=accum)[0] for env in (slow, {"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"})]
    assert runs[0]["counts"]["optimizer_delayed"] == 3 * runs[0]["units"]
    assert runs[0]["losses"] == runs[1]["losses"]
    for key, value in runs[1]["state"].items():
        assert torch.equal(runs[0]["state"][key], value), key


def _saved_parameters(rank, world, tmp):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=delayed_config(1, 1, warmup=0))
    for tokens in batches(3, 2):
        engine.backward(loss_of(engine, "gpt", tokens))
        engine.step()
    masters = engine.full_state_dict()
    with engine.gathered_parameters() as module:
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    engine.save_checkpoint(tmp)
    with engine.gathered_parameters() as module:
        after = {k: v.detach().clone() for k, v in module.state_dict().items()}
    engine.close()
    return masters, before, after


def test_a_checkpoint_publishes_the_staged_update_first(tmp_path):
    masters, before, after = run_ranks(_saved_parameters, 1, tmp=str(tmp_path))[0]
    trained = [k for k in masters if "weight" in k]
    assert any(not torch.equal(before[k], masters[k]) for k in trained)  # one update behind the masters
    for key in trained:  # saved: the parameters are the masters (fp32)
        assert torch.equal(after[key], masters[key]), key


@pytest.mark.parametrize("change", [{"offload_optimizer": {"device": "none"}}, {"stage": 2},
                                    {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}])
def test_a_delayed_update_where_it_cannot_run_is_refused(change):
    config = delayed_config(1, 1)
    config["zero_optimization"].update(change)
    with pytest.raises(offload.ConfigError, match="offload.delayed_update.warmup_steps: the delayed update needs ZeRO "
                                                  "stage 3 with all of the optimizer state on the host"):
        offload.initialize(model=make_model("gpt"), config=config)


def test_the_estimate_and_the_engine_count_the_staging_copies():
    plan = run_ranks(describe_engine, 1, config=delayed_config(1, 1))[0]
    host = plan["memory"]["host"]
    assert abs(host["delayed update copies"] - host["optimizer state"] / 3) < 4096  # fp32: 4 of the state's 12 bytes
    # On a discrete device every home here is the device's: the new shards go into their host copies, none staged.
    plan = run_ranks(describe_engine, 1, env={"OFFLOAD_EMULATED_DISCRETE_DEVICE": "1"}, config=delayed_config(1, 1))[0]
    assert "delayed update copies" not in plan["memory"]["host"] and plan["staged"] == 0
