"""Pretrained weights straight into shards: a local Hugging Face checkpoint loads element for element as
transformers' from_pretrained loads it, at W = 1 and 2, sharded or single-file, bf16 or fp32, tied or bare; a
checkpoint that does not fit the model is an error naming what does not fit; building holds about one unit
beyond the shards, never the whole model."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import offload
import offload.hf
from offload.files.pretrained import PretrainedError
from offload.machine.launch import run_ranks

transformers = pytest.importorskip("transformers")


def config(stage=3, params="cpu", unit_bytes=8192, clip=1.0):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if params and stage == 3:
        zero["offload_param"] = {"device": params}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": zero, "offload": {"unit_bytes": unit_bytes}}


def tiny(family, seed=0, layers=2, hidden=32, vocab=128):
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=hidden, n_layer=layers, n_head=4,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def save(model, path, shard="20KB", dtype=None):
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return path


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def assert_equal_to_reference(ours, ref):
    assert set(ours) == set(ref)
    for key, value in ref.items():
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], value.float()), key


@pytest.mark.parametrize("family,shard,dtype,stage", [
    ("gpt2", "20KB", None, 3),  # sharded with an index, tied embeddings
    ("llama", "1GB", None, 3),  # one file
    ("llama", "20KB", torch.bfloat16, 3),  # stored bf16, fp32 masters
    ("gpt2", "20KB", None, 2),  # a resident unit reads its whole buffer
])
def test_loads_as_from_pretrained_does_at_w1(tmp_path, family, shard, dtype, stage):
    path = save(tiny(family), tmp_path / "ckpt", shard=shard, dtype=dtype)
    engine, *_ = offload.hf.from_pretrained(path, config(stage), dist_init_required=False)
    with engine:
        assert len(engine.units) >= 4
        assert_equal_to_reference(engine.full_state_dict(), reference(path))


def _load_on_rank(rank, world, path, cfg):
    import offload.hf
    from offload.files.pretrained import PretrainedWeights
    weights = PretrainedWeights(path)
    engine, *_ = offload.initialize(model=offload.hf.meta_model(path), config=cfg, weights=weights)
    with engine:
        return {"state": engine.full_state_dict(), "read": weights.elements_read,
                "shards": sum(unit.shard_numel for unit in engine.units),
                "whole": sum(unit.padded for unit in engine.units)}


@pytest.mark.parametrize("family,params", [("gpt2", "cpu"), ("llama", None)])
def test_each_rank_reads_its_shard_and_the_whole_equals_from_pretrained_at_w2(tmp_path, family, params):
    path = save(tiny(family, layers=3), tmp_path / "ckpt")
    ranks = run_ranks(_load_on_rank, 2, path=path, cfg=config(params=params))
    for rank in ranks:
        assert rank["read"] == rank["shards"] == rank["whole"] // 2  # its own half, no more
        assert_equal_to_reference(rank["state"], reference(path))


def test_forward_of_the_loaded_engine_equals_the_pretrained_model(tmp_path):
    path = save(tiny("llama"), tmp_path / "ckpt")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = ref(input_ids=tokens, labels=tokens).loss
    engine, *_ = offload.hf.from_pretrained(path, config(), dist_init_required=False)
    with engine:
        loss = engine(input_ids=tokens, labels=tokens).loss
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        engine.backward(loss)
        engine.step()  # it trains from there


def test_a_checkpoint_of_the_bare_model_loads_into_one_with_a_head(tmp_path):
    """The original GPT-2 checkpoints were saved from GPT2Model: keys without the "transformer." prefix."""
    torch.manual_seed(0)
    bare = transformers.GPT2Model(tiny("gpt2").config)
    bare.save_pretrained(tmp_path / "bare")
    config_file = tmp_path / "bare" / "config.json"
    meta = json.loads(config_file.read_text())
    meta["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(meta))
    engine, *_ = offload.hf.from_pretrained(tmp_path / "bare", config(), dist_init_required=False)
    with engine:
        assert_equal_to_reference(engine.full_state_dict(), reference(tmp_path / "bare"))


def test_keys_the_model_class_ignores_are_ignored(tmp_path):
    path = save(tiny("gpt2"), tmp_path / "ckpt", shard="1GB")
    tensors = load_file(path / "model.safetensors")
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # a causal mask older checkpoints stored
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    engine, *_ = offload.hf.from_pretrained(path, config(), dist_init_required=False)
    engine.close()


def _edited(tmp_path, edit):
    path = save(tiny("llama"), tmp_path / "ckpt", shard="1GB")
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     ["1 model tensor(s) have no key in the checkpoint", "model.layers.1.mlp.up_proj.weight"]),
    (lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2)}),
     ["1 checkpoint key(s) match nothing in the model", "model.layers.7.mlp.up_proj.weight"]),
    (lambda t: t.update({"model.norm.weight": torch.zeros(33)}),
     ["1 shape(s) differ", "model.norm.weight: [33] in the checkpoint, [32] in the model"]),
])
def test_a_checkpoint_that_does_not_fit_names_what_and_allocates_nothing(tmp_path, edit, words):
    path = _edited(tmp_path, edit)
    with pytest.raises(PretrainedError) as e:
        offload.hf.from_pretrained(path, config(), dist_init_required=False)
    for w in words:
        assert w in str(e.value)
    assert "does not fit LlamaForCausalLM" in str(e.value)


def test_a_path_that_is_not_a_local_checkpoint_says_so(tmp_path):
    with pytest.raises(PretrainedError, match="not a local directory.*never downloads"):
        offload.hf.from_pretrained("meta-llama/Llama-3.2-1B", config(), dist_init_required=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match="no model.safetensors .*pytorch_model.bin: convert it to safetensors"):
        offload.hf.from_pretrained(tmp_path / "bin", config(), dist_init_required=False)
    path = save(tiny("gpt2"), tmp_path / "damaged", shard="1GB")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(PretrainedError, match="not a readable safetensors file"):
        offload.hf.from_pretrained(path, config(), dist_init_required=False)


def test_persistent_buffers_load_without_transformers(tmp_path):
    """offload.initialize(weights=DIR) on any module: its parameters and persistent buffers (BatchNorm's running
    statistics) come from model.safetensors."""
    def make():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    torch.manual_seed(3)
    source = make()
    source[1].running_mean.uniform_()
    source[1].num_batches_tracked.fill_(7)
    (tmp_path / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "ckpt" / "model.safetensors")
    torch.manual_seed(4)
    engine, *_ = offload.initialize(model=make(), config=config(unit_bytes=4096), weights=tmp_path / "ckpt",
                                    dist_init_required=False)
    with engine:
        state = engine.full_state_dict()
        for key, value in source.state_dict().items():
            assert torch.equal(state[key].to(value.dtype), value), key


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _build_growth(rank, world, path, swap, pretrained):
    """(peak - start resident bytes, largest unit bytes, largest read bytes) of building an engine on the
    checkpoint at ``path``: from it, or (``pretrained`` false) with fresh weights, one unit materialised at a time
    by offload.zero.Init. The peak is the kernel's own high-water mark (reset first), so no short-lived allocation
    escapes it."""
    import offload.hf
    from offload.files.pretrained import PretrainedWeights
    from offload.machine.host_malloc import DEFAULT_THRESHOLD
    cfg = config(unit_bytes=1 << 20, params=None)
    # Small swap buffers, so what the engine holds once built is small beside the model.
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0,
                                                 "buffer_count": 2}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 2}
    cfg["zero_optimization"]["sub_group_size"] = 1 << 18
    # A fixed mmap threshold, as offload train sets: freed buffers go back to the kernel, so RSS tracks what is held.
    cfg["offload"]["host_malloc"] = {"mmap_threshold": DEFAULT_THRESHOLD}
    model = offload.hf.meta_model(path)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    start = _status("VmRSS")
    weights = PretrainedWeights(path)
    engine, *_ = offload.initialize(model=model, config=cfg, weights=weights if pretrained else None)
    with engine:
        return (_status("VmHWM") - start, max(unit.padded for unit in engine.units) * 4,
                weights.largest_read * 4 if pretrained else 0)


def test_building_holds_about_what_building_fresh_holds_not_the_model(tmp_path):
    """A 110 MiB model of 18 units (a GPT-2 block is never split), shards and optimizer state on NVMe: building it
    from the checkpoint reads no more than a unit at a time, and its peak resident memory is within two units of
    building it with fresh weights one unit at a time (measured here: 0.4-0.5 MiB apart); a load through a whole
    state dict would add all 110 MiB."""
    model = tiny("gpt2", layers=16, hidden=384, vocab=1024)
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    path = save(model, tmp_path / "ckpt", shard="10MB")
    del model
    fresh, largest, _ = run_ranks(_build_growth, 1, path=path, swap=str(tmp_path / "a"), pretrained=False)[0]
    loaded, _, read = run_ranks(_build_growth, 1, path=path, swap=str(tmp_path / "b"), pretrained=True)[0]
    print(f"growth: fresh {fresh / 2**20:.1f} MiB, pretrained {loaded / 2**20:.1f} MiB; largest unit "
          f"{largest / 2**20:.1f} MiB, model {model_bytes / 2**20:.1f} MiB")
    assert largest * 6 < model_bytes
    assert read <= largest  # the largest range read at once
    assert loaded < fresh + 2 * largest, (loaded, fresh, largest)


def test_offload_train_fine_tunes_a_local_checkpoint_from_its_weights(tmp_path):
    """`offload train --model DIR`: the first step's loss is the pretrained model's on the first batch (fresh
    weights would give another), and it trains on from there."""
    from offload.commands.cli import main
    from offload.commands.train import TrainArgs, _windows, load_tokens
    path = save(tiny("llama", vocab=300), tmp_path / "ckpt")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config(clip=0.0)))
    assert main(["train", "--model", str(path), "--config", str(cfg), "--steps", "3", "--seq", "16",
                 "--out", str(tmp_path / "out"), "--print-every", "1"]) == 0
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    tokens, vocab = load_tokens(TrainArgs(model=str(path)))
    assert vocab == 300  # the checkpoint's, though bytes are the tokens (it has no tokenizer)
    gen = torch.Generator()
    gen.manual_seed(0)  # seed 0, rank 0, step 0: how offload train seeds each step's batches
    batch = _windows(tokens, 16, 2, gen)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = ref(input_ids=batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), batch[:, 1:].reshape(-1))
    assert record["losses"][0] == pytest.approx(expected.item(), rel=1e-5)
    assert len(record["losses"]) == 3


def test_offload_train_refuses_what_does_not_fit_a_checkpoint(tmp_path, capsys):
    from offload.commands.cli import main
    path = save(tiny("llama", vocab=100), tmp_path / "ckpt")
    np.save(tmp_path / "tokens.npy", np.arange(200, dtype=np.uint16))

    def train(*extra):
        return main(["train", "--out", str(tmp_path / "out"), "--steps", "1", *extra])
    assert train("--model", str(tmp_path / "nothing-here")) == 2
    assert "not a local directory" in capsys.readouterr().err
    assert train("--model", str(path), "--layers", "4") == 2
    assert "drop --layers/--hidden/--heads" in capsys.readouterr().err
    assert train("--model", str(path)) == 2  # the embedded text's bytes reach 255
    assert "has a vocabulary of 100" in capsys.readouterr().err
    assert train("--model", str(path), "--data", str(tmp_path / "tokens.npy")) == 2
    assert "token id 199" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def tiny_tokenizer(text, vocab=120):
    """A BPE tokenizer trained here on ``text`` (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_offload_train_tokenizes_text_with_the_checkpoints_own_tokenizer(tmp_path):
    from offload.commands.demo import TEXT
    from offload.commands.train import TrainArgs, load_tokens
    tokenizer = tiny_tokenizer(TEXT)
    path = save(tiny("llama", vocab=128), tmp_path / "ckpt")
    tokenizer.save_pretrained(path)
    tokens, vocab = load_tokens(TrainArgs(model=str(path)))
    assert vocab == 128
    assert tokens.tolist() == tokenizer(TEXT)["input_ids"]


def _head_on_rank(rank, world, path, seed_by_rank):
    import torch

    import offload.hf
    torch.manual_seed(rank if seed_by_rank else 0)  # ranks that disagree: the fresh head comes from rank 0's
    engine, *_ = offload.hf.from_pretrained(path, config(), auto_class="AutoModelForSequenceClassification",
                                            strict=False, model_config={"num_labels": 3, "pad_token_id": 0},
                                            dist_init_required=world > 1)
    with engine:
        return engine.full_state_dict()


def test_a_new_head_on_a_pretrained_base_is_initialised_by_the_model_when_not_strict(tmp_path, caplog):
    path = save(tiny("llama"), tmp_path / "ckpt")
    with pytest.raises(PretrainedError, match="score.weight.*lm_head.weight.*strict=False"):
        offload.hf.from_pretrained(path, config(), auto_class="AutoModelForSequenceClassification",
                                   model_config={"num_labels": 3, "pad_token_id": 0}, dist_init_required=False)
    with caplog.at_level("WARNING", logger="offload.files.pretrained"):
        one = _head_on_rank(0, 1, path, seed_by_rank=False)
    assert "score.weight is not in the checkpoint: the model initialises it" in caplog.text
    assert "1 checkpoint key(s) match nothing in LlamaForSequenceClassification and are skipped: lm_head.weight" \
        in caplog.text
    two = run_ranks(_head_on_rank, 2, path=path, seed_by_rank=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for state in [one] + two:
        assert state["score.weight"].shape == (3, 32)
        assert torch.equal(state["score.weight"], one["score.weight"])  # rank 0's initialisation, on every rank
        assert torch.equal(state["model.layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"])
        assert "lm_head.weight" not in state
    assert one["score.weight"].std() > 0
