"""Models, data and the reference loop shared by the engine tests (imported by spawned ranks too)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import offload
from offload.models import GPT, GPTConfig
from offload.optim.loss_scale import clip_coefficient

VOCAB, SEQ = 96, 16
# Every engine test on the emulated GPU checks its streams' order too (see [Note: stream order checked] in
# offload/machine/stream_check.py): a copy that forgets to wait for the compute stream fails on the CPU.
STREAM_CHECK = {"OFFLOAD_EMULATED_STREAM_CHECK": "1"}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, context=SEQ, hidden_size=32, layers=3, heads=2))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=True, attn_implementation="eager")
        return LlamaForCausalLM(cfg)
    raise ValueError(name)


def exact_norm(grads: list[torch.Tensor]) -> float:
    """The global norm of float32 gradients summed in float64, as the engine sums it."""
    return math.sqrt(float(sum(g.double().square().sum() for g in grads)))


def clip_at_exact_norm_(params: Any, max_norm: float) -> float:
    """``clip_grad_norm_`` from the exact global norm: the norm summed in float64 (as the engine sums it) and the
    factor in torch's float32 steps (``clip_coefficient``). torch's own norm sums float32 squares in an order set by
    the CPU's vector width, so a reference clipped by it is not the same on every CPU ([Note: the clip factor] in
    offload/optim/loss_scale.py); returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = exact_norm(grads)
    factor = clip_coefficient(norm, max_norm)
    for g in grads:
        g.mul_(torch.tensor(factor, dtype=g.dtype, device=g.device))
    return norm


def loss_of(model: Any, name: str, tokens: torch.Tensor) -> torch.Tensor:
    if name in ("gpt", "features", "frozen-base"):
        return model(tokens[:, :-1], tokens[:, 1:])
    return model(input_ids=tokens, labels=tokens).loss


def backward_over(model: Any, name: str, tokens: torch.Tensor, micro: int) -> float:
    """Plain PyTorch's accumulation over one global batch: each micro-batch's loss over their count backward; the
    mean loss."""
    chunks = tokens.split(micro)
    total = 0.0
    for chunk in chunks:
        loss = loss_of(model, name, chunk)
        (loss / len(chunks)).backward()
        total += loss.item()
    return total / len(chunks)


def batches(steps: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    """Counting sequences with a random start and stride: learnable within a few steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (rows, 1), generator=gen)
        stride = torch.randint(1, 4, (rows, 1), generator=gen)
        out.append((start + stride * torch.arange(SEQ + 1)) % VOCAB)
    return out


def base_config(micro: int, accum: int, world: int, clip: float = 1.0, unit_bytes: int = 8192,
                **zero: Any) -> dict[str, Any]:
    return {
        "train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum, "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0, **zero},
        "offload": {"unit_bytes": unit_bytes},
    }


def train_engine(rank: int, world: int, name: str, config: dict[str, Any], steps: int, micro: int,
                 accum: int, save_dir: str | None = None, started: Callable[[Any], None] | None = None,
                 after_step: Callable[[int, Any], None] | None = None,
                 finished: Callable[[Any], dict[str, Any]] | None = None,
                 optimizer: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Train with offload on this rank's slices of each global batch; every rank's mean loss per step
    (and a checkpoint in ``save_dir`` at the end). ``started(engine)`` runs after initialize,
    ``after_step(i, engine)`` after step i, and ``finished(engine)`` adds to the result before the engine closes;
    ``optimizer``: the script's optimizer, built by initialize from the parameters (a class or partial)."""
    model = make_any(name)
    engine, _, _, _ = offload.initialize(model=model, config=config, optimizer=optimizer)
    if started is not None:
        started(engine)
    losses = []
    for i, tokens in enumerate(batches(steps, micro * accum * world)):
        total = 0.0
        for a in range(accum):
            rows = tokens[(a * world + rank) * micro:(a * world + rank + 1) * micro].to(engine.accel.device)
            loss = engine.backward(loss_of(engine, name, rows))
            engine.step()
            total += loss.item()
        mean = torch.tensor([total / accum], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if after_step is not None:
            after_step(i, engine)
    eval_tokens = batches(1, 4, seed=7)[0][:, :-1].to(engine.accel.device)
    engine.eval()
    with torch.no_grad():
        logits = engine(eval_tokens) if name != "llama" else engine(input_ids=eval_tokens).logits
    engine.train()
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    out = {"losses": losses, "state": engine.full_state_dict(), "eval_logits": logits.cpu(),
           "peak_live": engine.peak_live_parameters,
           "units": len(engine.units), "gathers": engine.runtime.gathers,
           "prefetched": engine.runtime.prefetched_gathers,
           "counts": engine.telemetry.snapshot().counts,
           "overlapped": engine.telemetry.snapshot().counts.get("optimizer_overlapped", 0),
           "mismatches": engine.runtime.prefetch.mismatches, "skipped": engine.skipped_steps,
           "scale": engine.loss_scale, "memory": engine.memory_summary(), "mode": engine.step_mode,
           "tiers": dict(engine.optimizer.store.placement.tiers)}
    if finished is not None:
        out |= finished(engine)
    engine.close()
    return out


def resume_engine(rank: int, world: int, name: str, config: dict[str, Any], load_dir: str, steps: int, start: int,
                  micro: int, accum: int, optimizer: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Steps ``start`` + 1 to ``steps`` of ``train_engine``'s run, from the checkpoint it saved after step ``start``:
    the whole state, and the param groups without their params."""
    engine, _, _, _ = offload.initialize(model=make_any(name), config=config, optimizer=optimizer)
    engine.load_checkpoint(load_dir)
    for tokens in batches(steps, micro * accum * world)[start:]:
        for a in range(accum):
            rows = tokens[(a * world + rank) * micro:(a * world + rank + 1) * micro]
            engine.backward(loss_of(engine, name, rows))
            engine.step()
    out = {"state": engine.full_state_dict(), "groups": [dict(g, params=None) for g in engine.optimizer.param_groups]}
    engine.close()
    return out


def engine_device(world: int) -> str:
    """Where the engine trains: one rank takes the GPU if there is one; run_ranks puts several on the CPU."""
    return "cuda" if world == 1 and torch.cuda.is_available() else "cpu"


def train_reference(name: str, steps: int, rows: int, micro: int, clip: float = 1.0, *, world: int,
                    device: str | None = None) -> dict[str, Any]:
    """Plain single-process torch AdamW on the whole global batch of each step, on the device the
    engine's ``world`` ranks train on (so both sides share kernels and rounding)."""
    device = device or engine_device(world)
    model = make_any(name).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.95),
                            weight_decay=0.1)
    losses = []
    for tokens in batches(steps, rows):
        chunks = tokens.to(device).split(micro)
        total = 0.0
        for chunk in chunks:
            loss = loss_of(model, name, chunk)
            (loss / len(chunks)).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / len(chunks))
    eval_tokens = batches(1, 4, seed=7)[0][:, :-1].to(device)
    model.eval()
    with torch.no_grad():
        logits = model(eval_tokens) if name != "llama" else model(input_ids=eval_tokens).logits
    return {"losses": losses, "state": {k: v.cpu() for k, v in model.state_dict().items()},
            "eval_logits": logits.cpu()}


class Features(torch.nn.Module):
    """Tied weights, a partly frozen module, a module called twice, a parameter-less module and a buffer."""

    def __init__(self, hidden: int = 40) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden)
        self.frozen.weight.requires_grad_(False)  # its bias still trains: a unit holding both kinds
        self.shared = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.act = torch.nn.GELU()
        self.register_buffer("scale", torch.tensor(0.75))
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.act(self.frozen(self.embed(tokens))) * self.scale
        x = self.shared(self.shared(x))
        logits = self.head(x)
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _make_features(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Features()


def _make_frozen_base(seed: int = 0) -> torch.nn.Module:
    """The test GPT with its blocks' projections frozen, as a LoRA-style fine-tune leaves its base: whole units that
    nothing trains beside the embedding and the norms, which do."""
    model = make_model("gpt", seed)
    for name, p in model.named_parameters():
        if ".attn." in name or ".mlp." in name:
            p.requires_grad_(False)
    return model


def make_any(name: str) -> torch.nn.Module:
    if name == "frozen-base":
        return _make_frozen_base()
    return _make_features() if name == "features" else make_model(name)


def check_parity(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Every rank's losses, parameters, buffers and evaluation logits equal the torch reference (fp32)."""
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    for rank in results:
        assert rank["state"].keys() == ref["state"].keys()
        for key, value in ref["state"].items():
            torch.testing.assert_close(rank["state"][key], value, msg=lambda m, k=key: f"{k}: {m}")
        torch.testing.assert_close(rank["eval_logits"], ref["eval_logits"])


def check_bitwise(results: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """Two train_engine runs (one result per rank) trained alike bit for bit: losses, state and evaluation logits;
    for schedules that promise the same values (an early step against the whole one)."""
    for run, ref in zip(results, reference, strict=True):
        assert run["losses"] == ref["losses"]
        for key, value in ref["state"].items():
            assert torch.equal(run["state"][key], value), key
        assert torch.equal(run["eval_logits"], ref["eval_logits"])


def describe_engine(rank: int, world: int, config: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """What initialize decided for the test GPT: step mode, optimizer state per tier, memory per tier."""
    engine, optimizer, _, _ = offload.initialize(model=make_model("gpt"), config=config, device=device)
    out = {"mode": engine.step_mode, "tiers": dict(optimizer.store.placement.tiers), "memory": engine.memory_summary(),
           "staged": sum(t.numel() for t in optimizer.early.staged.values())}
    engine.close()
    return out
