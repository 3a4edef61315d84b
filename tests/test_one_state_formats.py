"""Lion and Adagrad with their state in fewer bytes ([Note: one state] and [Note: state formats] in
native/kernels.cpp): the master and the one state buffer loaded and stored as held, the arithmetic float32, so in
every kernel variant each format steps as the float32 kernel does on the widened values, rounded as the format
rounds (a 16+16 master not at all); through the engine at the formats' bytes, a 16+16 master bit for bit the fp32
one, and the GPU's torch-ops path (the emulated discrete device) bit for bit the host kernel."""

import pytest
import torch
from engine_cases import STREAM_CHECK, base_config, batches, loss_of, make_any

import offload
from offload.machine.launch import run_ranks
from offload.machine.native import NativeError, Stochastic
from offload.optim.one_state import adagrad_step, lion_step
from offload.store.state_format import join_master, split_master

N = 10_007  # not a multiple of any vector width: every variant's tail runs too
MASTERS = ["fp32", "16+16", "bf16", "bf16-stochastic"]


def step(rule, master, state, grad, lo=None, stochastic=None, out16=None):
    if rule == "lion":
        lion_step(master, grad, state, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, grad_scale=0.5, out16=out16,
                  master_lo=lo, stochastic=stochastic, threads=2)
    else:
        adagrad_step(master, grad, state, 3, lr=0.05, weight_decay=0.01, grad_scale=0.5, out16=out16,
                     master_lo=lo, stochastic=stochastic, threads=2)


def start(rule):
    torch.manual_seed(0)
    master, grad = torch.randn(N), torch.randn(N)
    state = torch.randn(N) if rule == "lion" else torch.rand(N) * 4  # Adagrad's sum of squares is positive
    return master, state, grad


@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("master_format", MASTERS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_each_format_steps_as_the_float32_kernel_on_the_widened_values(variant, rule, master_format, state_dtype):
    master, state, grad = start(rule)
    if master_format != "fp32":
        master = master.bfloat16().float()  # a bf16 master holds bf16 values; 16+16 any float32 (split below)
        if master_format == "16+16":
            master = torch.randn(N)
    held_state = state.to(state_dtype, copy=True)
    # the float32 kernel on the values as held
    ref_master, ref_state = master.clone(), held_state.float().clone()
    step(rule, ref_master, ref_state, grad.bfloat16())
    # the held format
    lo, stochastic = None, None
    if master_format == "fp32":
        held = master.clone()
    elif master_format == "16+16":
        held, lo = split_master(master.clone())
    else:
        held = master.bfloat16()
        stochastic = Stochastic(1234, 77) if master_format == "bf16-stochastic" else None
    out16 = torch.empty(N, dtype=torch.bfloat16)
    step(rule, held, held_state, grad.bfloat16(), lo=lo, stochastic=stochastic, out16=out16)
    assert torch.equal(held_state, ref_state.to(state_dtype))  # the state rounded to nearest even, once
    if master_format in ("fp32", "16+16"):  # exact
        assert torch.equal(held.float() if lo is None else join_master(held, lo), ref_master)
        assert torch.equal(out16, ref_master.bfloat16() if lo is None else held)
    elif master_format == "bf16":
        assert torch.equal(held, ref_master.bfloat16()) and torch.equal(out16, held)
    else:  # one of the two bf16 neighbours, each chosen often, the same again from the same stream
        bits = ref_master.view(torch.int32)
        toward = (bits & ~0xFFFF).view(torch.float32).bfloat16()  # the neighbour toward zero, and away from it
        away = torch.where(bits & 0xFFFF != 0, (bits & ~0xFFFF) + 0x10000, bits).view(torch.float32).bfloat16()
        inexact = bits & 0xFFFF != 0
        assert bool(((held == toward) | (held == away)).all())
        assert 0.2 < float((held == away)[inexact].float().mean()) < 0.8
        again, again_state = master.bfloat16(), state.to(state_dtype, copy=True)
        step(rule, again, again_state, grad.bfloat16(), stochastic=Stochastic(1234, 77))
        assert torch.equal(again, held)


def test_what_the_kernel_refuses_is_said():
    master, state, grad = start("lion")
    with pytest.raises(NativeError, match="state has dtype torch.float16"):
        step("lion", master, state.half(), grad)
    with pytest.raises(NativeError, match="param_lo and stochastic rounding go with a bfloat16 master"):
        step("lion", master, state, grad, lo=torch.zeros(N, dtype=torch.int16))
    with pytest.raises(NativeError, match="16\\+16 master.*no stochastic rounding"):
        step("lion", master.bfloat16(), state, grad, lo=torch.zeros(N, dtype=torch.int16),
             stochastic=Stochastic(1, 0))
    with pytest.raises(NativeError, match="a bfloat16 master's copy is bfloat16"):
        step("lion", master.bfloat16(), state, grad, out16=torch.empty(N, dtype=torch.float16))


# --------------------------------------------------------------------------- through the engine

STEPS, MICRO = 4, 2


def rule_config(rule, master, moments, world=1, ratio=None, device="cpu", path=None, stream=0):
    params = {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1} if rule == "lion" else {
        "lr": 0.05, "weight_decay": 0.01}
    opt = {"device": device} | ({"nvme_path": str(path), "buffer_count": 2} if device == "nvme" else {})
    if ratio is not None:
        opt["ratio"] = ratio
    config = base_config(MICRO, 1, world, clip=1.0, sub_group_size=3000, offload_optimizer=opt)
    config["optimizer"] = {"type": "Lion" if rule == "lion" else "Adagrad", "params": params}
    config["bf16"] = {"enabled": True}
    config["offload"]["optimizer_state"] = {"master": master, "moments": moments}
    config["offload"]["stream_state"] = stream
    return config


def train_masters(rank, world, config, steps=STEPS):
    """This rank's losses, the bytes an element its format holds, its tiers, and the whole fp32 master of every
    parameter after ``steps``."""
    from offload.utils import safe_get_full_fp32_param
    engine, *_ = offload.initialize(model=make_any("gpt"), config=config)
    losses = []
    for tokens in batches(steps, MICRO * world):
        losses.append(engine.backward(loss_of(engine, "gpt", tokens[rank * MICRO:(rank + 1) * MICRO])).item())
        engine.step()
    out = {"losses": losses, "bytes": engine.optimizer.state_format.bytes_per_element,
           "tiers": dict(engine.optimizer.store.placement.tiers),
           "streamed": sum(g.streamed for g in engine.optimizer.sub_groups),
           "masters": {n: safe_get_full_fp32_param(p).cpu() for n, p in engine.module.named_parameters()}}
    engine.close()
    return out


@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("world,device", [(1, "cpu"), (2, "nvme")])
def test_a_step_of_the_16_16_master_is_bitwise_the_fp32_masters(tmp_path, rule, world, device):
    """From the same weights and gradients a step of the 16+16 master (its high halves the weights, lent by the
    parameter store: 2 bytes of master and 2 of bf16 state an element) lands on the fp32 master's bits beside the
    same bf16 state (6 bytes): the format changes how the master is held, not the arithmetic."""
    runs = {m: run_ranks(train_masters, world, steps=1, config=rule_config(
        rule, m, "bf16", world, device=device, path=tmp_path / m.replace("+", "p"))) for m in ("fp32", "16+16")}
    # on the host the high halves are the weights; NVMe state keeps its own
    assert runs["16+16"][0]["bytes"] == (4 if device == "cpu" else 6) and runs["fp32"][0]["bytes"] == 6
    for name, value in runs["fp32"][0]["masters"].items():
        assert torch.equal(runs["16+16"][0]["masters"][name], value), name


@pytest.mark.parametrize("rule", ["lion", "adagrad"])
@pytest.mark.parametrize("master,lane", [("fp32", "device"), ("16+16", "device"), ("bf16-stochastic", "device"),
                                         ("16+16", "streamed")])
def test_state_on_the_emulated_gpu_steps_as_the_host_kernel(rule, master, lane):
    """Half the units' state on the emulated discrete device, or homed on the host and streamed through it (torch's
    ops, widened and stored back as held), the rest on the host (the native kernel), bf16 state: Lion's masters bit
    for bit those of all of it on the host; Adagrad's close (torch's CPU square root is not correctly rounded, the
    kernel's is: a weight's last place, fed back through its decay into the sum, can move the bf16 sum to its
    neighbour, 2**-8 of it); a stochastic master the same in distribution, from another generator, so its losses
    alone are compared."""
    env = {**STREAM_CHECK, "OFFLOAD_EMULATED_DISCRETE_DEVICE": "1", "CUDA_VISIBLE_DEVICES": ""}
    config = (rule_config(rule, master, "bf16", ratio=0.5) if lane == "device"
              else rule_config(rule, master, "bf16", ratio=1.0, stream=0.5))
    half = run_ranks(train_masters, 1, env=env, config=config)[0]
    host = run_ranks(train_masters, 1, env=env, config=rule_config(rule, master, "bf16", ratio=1.0))[0]
    if lane == "device":
        assert half["tiers"].get("device", 0) > 0 and host["tiers"].get("device", 0) == 0
    else:
        assert half["streamed"] > 0 and host["streamed"] == 0
    if master == "bf16-stochastic":
        torch.testing.assert_close(torch.tensor(half["losses"]), torch.tensor(host["losses"]), rtol=1e-2, atol=1e-2)
        return
    if rule == "lion":
        exact = dict(rtol=0, atol=0)
        torch.testing.assert_close(torch.tensor(half["losses"]), torch.tensor(host["losses"]), **exact)
        for name, value in host["masters"].items():
            torch.testing.assert_close(half["masters"][name], value, msg=lambda m, k=name: f"{k}: {m}", **exact)
        return
    # Adagrad. torch's CPU ops contract (or not) a multiply and an add into an FMA as the compiler built each of
    # its AVX2, AVX-512 or NEON kernels, where the native kernel always fuses the sum's addcmul: the fp32 sum
    # differs by an ulp or two, a fp32 weight by a few ulps a step (rtol 1e-6). Stored in bf16, such a sum can
    # round to its neighbour at a tie: at most one bf16 ulp (2**-7 relative) more each step, so by step t
    # the sums differ by at most (t - 1) * 2**-7 relative, sqrt(sum) by half that, and the step, lr * g /
    # sqrt(sum) with |g| <= sqrt(sum), by at most lr * (t - 1) * 2**-8. Over STEPS steps a weight is at most
    # lr * 2**-8 * STEPS * (STEPS - 1) / 2 apart (1.2e-3 here); the decay's feedback into g is 0.01 of that.
    lr = config["optimizer"]["params"]["lr"]
    apart = lr * 2 ** -8 * STEPS * (STEPS - 1) / 2
    for name, value in host["masters"].items():
        torch.testing.assert_close(half["masters"][name], value, rtol=1e-6, atol=apart,
                                   msg=lambda m, k=name: f"{k}: {m}")
    # the losses follow from the weights, which carry the bound: they are held loosely
    torch.testing.assert_close(torch.tensor(half["losses"]), torch.tensor(host["losses"]), rtol=1e-2, atol=0)
