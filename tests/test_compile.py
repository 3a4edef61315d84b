"""torch.compile under the engine: compiled blocks train as the same blocks compiled under plain PyTorch, with the
engine's gathers and releases outside the graphs (no graph break, one graph per block shape and input kind, no
recompile after the first step), whether the user compiled them before ``initialize`` or ``engine.compile()`` did.

The backend is ``aot_eager`` (dynamo and AOTAutograd, without inductor's code generation) except where named: what
the engine changes is what dynamo traces, which every backend shares."""

import pytest
import torch
from engine_cases import backward_over, base_config, batches, engine_device, loss_of, make_model
from torch.utils.checkpoint import checkpoint

import offload
from offload.engine.errors import EngineError
from offload.machine.launch import run_ranks
from offload.models.gpt import Block
from offload.zero.compiled import DynamoCounts

STEPS, MICRO = 6, 2
BACKEND = "aot_eager"


class CheckpointedBlock(Block):
    """A GPT block whose activations are recomputed in backward, inside its compiled graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(Block.forward, self, x, use_reentrant=False)


BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


def gpt(recompute: bool = False, compiled: tuple[str, ...] = BLOCKS) -> torch.nn.Module:
    """The test GPT with ``compiled`` modules compiled in place (``module.compile()``)."""
    model = make_model("gpt")
    modules = dict(model.named_modules())
    for block in model.blocks:
        if recompute:
            block.__class__ = CheckpointedBlock
    for name in compiled:
        modules[name].compile(backend=BACKEND)
    return model


def plain(steps: int, rows: int, recompute: bool = False, clip: float = 1.0, compiled: tuple[str, ...] = BLOCKS,
          world: int = 1) -> dict:
    """The compiled model under plain PyTorch and torch's AdamW, on the whole global batch of each step, on the
    device the engine's ``world`` ranks train on."""
    torch._dynamo.reset()
    start = DynamoCounts.now()
    device = engine_device(world)
    model = gpt(recompute, compiled).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for tokens in batches(steps, rows):
        losses.append(backward_over(model, "gpt", tokens.to(device), MICRO))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "graphs": DynamoCounts.now().since(start).graphs}


def train(rank: int, world: int, config: dict, steps: int, recompute: bool = False, late: bool = False,
          eager: bool = False) -> dict:
    """The same model under the engine: blocks compiled before initialize, or by engine.compile() (``late``), or
    not at all (``eager``)."""
    torch._dynamo.reset()
    model = gpt(recompute, compiled=() if late or eager else BLOCKS)
    engine, *_ = offload.initialize(model=model, config=config)
    if late:
        engine.compile(backend=BACKEND)
    losses = []
    for tokens in batches(steps, MICRO * world):
        rows = tokens[rank * MICRO:(rank + 1) * MICRO]
        loss = engine.backward(loss_of(engine, "gpt", rows))
        engine.step()
        mean = loss.detach().reshape(1).double()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    report = engine.compile_report()
    engine.close()
    return {"losses": losses, "report": report.as_dict()}


def config(tmp_path, stage: int = 3, params: str = "cpu", state: str = "cpu", world: int = 1) -> dict:
    cfg = base_config(MICRO, 1, world, stage=stage, offload_optimizer={"device": state}, sub_group_size=3000)
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": params}
    for section in ("offload_optimizer", "offload_param"):
        if cfg["zero_optimization"].get(section, {}).get("device") == "nvme":
            cfg["zero_optimization"][section].update(nvme_path=str(tmp_path), buffer_count=2)
    return cfg


def check(run: dict, ref: dict, compiled: tuple[str, ...] = BLOCKS) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    report = run["report"]
    assert report["graph_breaks"] == 0, report["reasons"]
    assert report["recompiles"] == 0
    assert report["graphs"] == ref["graphs"], "one graph per block shape and input kind, as plain PyTorch makes"
    assert report["compiled"] == list(compiled)


# a variant the others cover in the inner loop (`-m "not slow"`) is marked slow; the whole suite runs it
@pytest.mark.parametrize("stage,params,state", [pytest.param(3, "cpu", "cpu", marks=pytest.mark.slow),
                                                (3, "nvme", "nvme"), (3, "none", "none"),
                                                (2, "none", "cpu"), (1, "none", "cpu"), (0, "none", "none")])
def test_blocks_compiled_before_initialize_train_as_under_plain_torch(tmp_path, stage, params, state):
    ref = plain(STEPS, MICRO)
    check(train(0, 1, config(tmp_path, stage, params, state), STEPS), ref)


def test_engine_compile_compiles_each_unit_and_trains_as_plain_torch(tmp_path):
    """Units of about a block each (as a model's block classes make them): engine.compile() compiles each unit's
    blocks (the embeddings and the final norm, units of their own, are torch's single layers and stay eager)."""
    cfg = config(tmp_path)
    cfg["offload"]["unit_bytes"] = 1 << 16
    check(train(0, 1, cfg, STEPS, late=True), plain(STEPS, MICRO))


def test_activation_checkpointing_inside_a_compiled_block(tmp_path):
    ref = plain(STEPS, MICRO, recompute=True)
    check(train(0, 1, config(tmp_path), STEPS, recompute=True), ref)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compiled_blocks_train_in_bf16_and_fp16_as_the_same_engine_eager(tmp_path, dtype):
    """The engine's 16-bit weights (and fp16's loss scaling) under compiled blocks: the eager engine's losses."""
    cfg = config(tmp_path)
    cfg[dtype] = {"enabled": True}
    eager = train(0, 1, cfg, STEPS, eager=True)
    run = train(0, 1, cfg, STEPS)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager["losses"]), rtol=1e-3, atol=1e-3)
    assert run["report"]["graph_breaks"] == 0 and run["report"]["recompiles"] == 0, run["report"]


def test_two_ranks_train_compiled_blocks_as_plain_torch(tmp_path):
    ref = plain(STEPS, 2 * MICRO, world=2)
    for rank in run_ranks(train, 2, config=config(tmp_path, world=2), steps=STEPS):
        check(rank, ref)


def test_a_block_compiled_whole_is_one_unit_however_small_the_units():
    """Units cut inside a compiled block would put the engine's hooks in its graph: the block stays whole."""
    cfg = base_config(MICRO, 1, 1)
    cfg["offload"]["unit_bytes"] = 4096  # a twelfth of a block
    engine, *_ = offload.initialize(model=gpt(), config=cfg)
    names = [u.name for u in engine.units]
    engine.close()
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(names)
    assert not any(n.startswith("blocks.") and n.count(".") > 1 for n in names), names


def test_compile_refuses_what_it_cannot_honour():
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(MICRO, 1, 1))
    with pytest.raises(EngineError, match="DeepCompile's passes"):
        engine.compile(schedule=[(0, "pass")])
    with pytest.raises(EngineError, match="backend="):
        engine.compile(compile_kwargs={"backend": "eager"})
    assert not engine.is_compiled
    engine.close()


@pytest.mark.parametrize("how", [pytest.param("module.compile", marks=pytest.mark.slow), "torch.compile"])
def test_a_model_compiled_whole_trains_exactly_and_is_told_to_compile_its_blocks(caplog, how):
    """The units' gathers stay outside the graph, so a whole-model graph breaks at each unit: correct, said once."""
    ref = plain(STEPS, MICRO)
    torch._dynamo.reset()
    model = make_model("gpt")
    if how == "module.compile":
        model.compile(backend=BACKEND)
    else:
        model = torch.compile(model, backend=BACKEND)
    cfg = base_config(MICRO, 1, 1)
    cfg["offload"]["unit_bytes"] = 1 << 16
    with caplog.at_level("WARNING", logger="offload.engine"):
        engine, *_ = offload.initialize(model=model, config=cfg)
    said = [r.getMessage() for r in caplog.records if "compiled whole" in r.getMessage()]
    assert len(said) == 1 and "engine.compile()" in said[0], said
    losses = []
    for tokens in batches(STEPS, MICRO):
        losses.append(engine.backward(loss_of(engine, "gpt", tokens)).item())
        engine.step()
    assert engine.compile_report().recompiles == 0
    engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)


def test_engine_compile_says_when_the_units_are_cut_inside_the_blocks(caplog):
    engine, *_ = offload.initialize(model=make_model("gpt"), config=base_config(MICRO, 1, 1, unit_bytes=8192))
    with caplog.at_level("WARNING", logger="offload.engine"):
        engine.compile(backend=BACKEND)
    said = [r.getMessage() for r in caplog.records if "cut inside" in r.getMessage()]
    engine.close()
    assert len(said) == 1 and "3 block(s) (blocks.0, blocks.1 ...)" in said[0] and "block.compile()" in said[0]
