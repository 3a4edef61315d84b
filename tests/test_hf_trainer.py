"""offload.hf.Trainer: Hugging Face's Trainer on the engine trains as plain transformers.Trainer does (same losses,
gradient norms and learning rates with clipping and accumulation on), saves a model from_pretrained loads, resumes
exactly from its checkpoints, and resolves a DeepSpeed config's "auto" values as Hugging Face's integration does."""

import contextlib
import copy
import json
import logging

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from test_pretrained import save, tiny  # noqa: E402

import offload.hf  # noqa: E402
from offload.hf.ds_config import ConfigMismatch, resolve  # noqa: E402
from offload.machine.launch import run_ranks  # noqa: E402

DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
      "train_batch_size": "auto",
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
      "offload": {"unit_bytes": 8192}}


def data(rows=16, seq=16, vocab=128):
    torch.manual_seed(0)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, vocab, (rows, seq))]


def arguments(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                max_grad_norm=1.0, num_train_epochs=1, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, seed=0, lr_scheduler_type="linear", warmup_steps=1, dataloader_drop_last=True,
                disable_tqdm=True, per_device_eval_batch_size=2)
    base.update(kw)
    return transformers.TrainingArguments(**base)


@contextlib.contextmanager
def _trainer_log():
    """The lines transformers' Trainer logs at INFO (its library logger does not propagate to pytest's)."""
    lines: list[str] = []
    log = logging.getLogger(transformers.Trainer.__module__)
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def logged(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_trains_as_the_plain_trainer_does(tmp_path, checkpointing):
    path = save(tiny("llama"), tmp_path / "ckpt")
    # transformers' own recompute, through the engine's hooks; renamed activation_checkpointing in transformers 5.2x
    renamed = "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
    kw = {"activation_checkpointing" if renamed else "gradient_checkpointing": checkpointing}
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref", **kw), train_dataset=data())
    released = {**DS, "zero_optimization": {**DS["zero_optimization"], "stage3_param_persistence_threshold": 0}}
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "ours", **kw),
                              offload_config=released, train_dataset=data())
    counts = []
    for trainer in (ref, ours):  # what the Trainer logs of the model: the whole count, parameters released or not
        with _trainer_log() as lines:
            trainer.train()
        counts.append([line for line in lines if "Number of trainable parameters" in line])
    assert counts[0] == counts[1] and len(counts[0]) == 1
    assert len(logged(ours)) == 4
    assert logged(ours) == pytest.approx(logged(ref), rel=1e-6)
    assert logged(ours, "grad_norm") == pytest.approx(logged(ref, "grad_norm"), rel=1e-5)
    assert logged(ours, "learning_rate") == pytest.approx(logged(ref, "learning_rate"))
    assert ours.engine.global_steps == 4


def test_torch_compile_compiles_each_block_and_trains_as_the_plain_compiled_trainer(tmp_path):
    """torch_compile=True: the plain Trainer compiles the whole model; ours compiles each decoder layer under the
    engine (its gathers outside the graphs), to the same losses, without a graph break or a recompile."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    kw = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    torch._dynamo.reset()
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref", **kw), train_dataset=data())
    ref.train()
    torch._dynamo.reset()
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "ours", **kw),
                              offload_config=DS, train_dataset=data())
    ours.train()
    assert logged(ours) == pytest.approx(logged(ref), rel=1e-5)
    report = ours.engine.compile_report()
    assert report.compiled == ("model.layers.0", "model.layers.1", "model.norm")  # the RMSNorm is a unit too
    assert report.graph_breaks == 0 and report.recompiles == 0, report.summary()


def test_a_second_train_runs_as_the_plain_trainers_second_does(tmp_path):
    """A later train() gets a fresh schedule over its steps and Adam's state goes on, as in the plain Trainer (the
    engine's finished schedule would train at lr 0); arguments the engine was built for cannot change."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref"), train_dataset=data())
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "ours"),
                              offload_config=DS, train_dataset=data())
    for _ in range(2):
        ref.train()
        ours.train()
    assert logged(ours) == pytest.approx(logged(ref), rel=1e-6)
    assert logged(ours, "learning_rate") == pytest.approx(logged(ref, "learning_rate"))
    assert max(logged(ours, "learning_rate")) == pytest.approx(1e-3)
    assert ours.engine.global_steps == 8
    ours.args.gradient_accumulation_steps = 1
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(gradient_accumulation_steps\) 2 -> 1; "
                                         r"keep them, or build a new Trainer"):
        ours.train()


def test_a_config_without_batch_or_clipping_keys_follows_the_arguments(tmp_path, caplog):
    """The Trainer's loop decides the micro-batch and the accumulation: a config that leaves them out trains as the
    plain Trainer does (an engine at its defaults of one would step at every micro-batch), twice over; and clips
    at max_grad_norm as the plain Trainer does, saying so (DeepSpeed would clip at its default, 1.0)."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    bare = {"zero_optimization": DS["zero_optimization"], "offload": DS["offload"]}
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref", max_grad_norm=0.05), train_dataset=data())
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=bare,
                              args=arguments(tmp_path / "ours", max_grad_norm=0.05), train_dataset=data())
    for _ in range(2):
        ref.train()
        with caplog.at_level("WARNING", logger="offload.hf"):
            ours.train()
        assert logged(ours) == pytest.approx(logged(ref), rel=1e-6)
        assert logged(ours, "learning_rate") == pytest.approx(logged(ref, "learning_rate"))
    assert min(logged(ref, "grad_norm")) > 0.05  # clipping fired on every step
    assert "no gradient_clipping, so gradients are clipped at max_grad_norm=0.05" in caplog.text
    assert ours.engine.global_steps == 8 and ours.engine.config.gradient_accumulation_steps == 2
    assert ours.engine.config.gradient_clipping == 0.05


def test_a_second_train_restarts_the_configs_schedule(tmp_path):
    path = save(tiny("gpt2"), tmp_path / "ckpt")
    config = {**DS, "scheduler": {"type": "WarmupCosineLR",
                                  "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "run"),
                                 offload_config=config, train_dataset=data())
    trainer.train()
    first = logged(trainer, "learning_rate")
    trainer.train()
    assert logged(trainer, "learning_rate") == pytest.approx(first)  # the cosine starts again from the base rate
    assert first[-1] < max(first)


def test_save_model_writes_what_from_pretrained_loads(tmp_path):
    path = save(tiny("gpt2"), tmp_path / "ckpt")
    trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "run"),
                                 offload_config=DS, train_dataset=data())
    trainer.train()
    trainer.save_model(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    expected = trainer.engine.full_state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert not torch.equal(expected["transformer.h.0.mlp.c_fc.weight"],
                           transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()[
                               "transformer.h.0.mlp.c_fc.weight"])  # it trained


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    path = save(tiny("llama"), tmp_path / "ckpt")

    def trainer(out, **kw):
        return offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=DS,
                                  args=arguments(tmp_path / out, **kw), train_dataset=data(rows=24))
    straight = trainer("straight", save_strategy="steps", save_steps=2)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / "offload").is_dir() and (checkpoint / "model.safetensors").is_file()
    second = trainer("resumed")
    second.train(resume_from_checkpoint=str(checkpoint))
    assert len(logged(straight)) == 6
    # The resumed history keeps the checkpoint's first two steps and adds the four it ran: the whole run's.
    assert logged(second) == pytest.approx(logged(straight), rel=1e-6)
    assert logged(second, "learning_rate") == pytest.approx(logged(straight, "learning_rate"))
    assert second.engine.global_steps == 6


def _train_on_rank(rank, world, path, out, offloaded):
    import torch
    import transformers

    import offload.hf
    torch.manual_seed(0)
    rows = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (32, 16))]
    args = arguments(out)
    if offloaded:
        trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=args, offload_config=DS,
                                     train_dataset=rows)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return logged(trainer), logged(trainer, "grad_norm"), trainer.evaluate(rows[:8])["eval_loss"]


def test_trains_as_the_plain_trainer_does_at_w2(tmp_path):
    path = save(tiny("llama"), tmp_path / "ckpt")
    ref = run_ranks(_train_on_rank, 2, path=path, out=str(tmp_path / "ref"), offloaded=False)
    ours = run_ranks(_train_on_rank, 2, path=path, out=str(tmp_path / "ours"), offloaded=True)
    assert len(ours[0][0]) == 4
    for (loss, norm, evaluated), (ref_loss, ref_norm, ref_evaluated) in zip(ours, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert evaluated == pytest.approx(ref_evaluated, rel=1e-5)


# ----------------------------------------------------------------- "auto", as Hugging Face resolves it


def test_auto_values_are_filled_from_the_arguments_key_for_key(tmp_path):
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}},
              "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    args = arguments(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=4, max_grad_norm=0.5,
                     learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-7, weight_decay=0.1,
                     warmup_steps=5)
    model = tiny("llama", hidden=32)
    out = resolve(config, args, model, num_training_steps=50)
    assert out["train_micro_batch_size_per_gpu"] == 3 and out["gradient_accumulation_steps"] == 4
    assert out["train_batch_size"] == 12 and out["gradient_clipping"] == 0.5
    assert out["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 5,
                                          "total_num_steps": 50}
    assert out["bf16"]["enabled"] is False and out["fp16"]["enabled"] is False
    assert out["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert out["zero_optimization"]["stage3_param_persistence_threshold"] == 320
    assert config["gradient_clipping"] == "auto"  # the caller's config is left as it was


def test_a_value_that_contradicts_the_arguments_is_refused_naming_both(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigMismatch) as e:
        resolve(config, arguments(tmp_path, max_grad_norm=0.3), tiny("llama"), 10)
    message = str(e.value)
    assert "- ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=2" in message
    assert "- ds gradient_clipping=1.0 vs hf max_grad_norm=0.3" in message
    assert "optimizer.params.lr" not in message  # it agrees
    assert resolve({}, arguments(tmp_path, bf16=True), tiny("llama"), 10)["bf16"] == {"enabled": True}  # as accelerate
    assert resolve({"zero_optimization": {"stage": 3}}, arguments(tmp_path, max_grad_norm=0), tiny("llama"), 10) == \
        {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    # absent keys stay absent, but for the batch the Trainer's loop decides (and clipping, when the Trainer clips)


def test_deepspeed_and_auto_find_batch_size_in_the_arguments_are_refused(tmp_path):
    path = save(tiny("llama"), tmp_path / "ckpt")
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    with pytest.raises(ValueError, match="drop deepspeed= from the arguments"):
        args = arguments(tmp_path / "run")
        args.deepspeed = str(tmp_path / "ds.json")
        offload.hf.Trainer(model=offload.hf.meta_model(path), args=args, offload_config=DS)
    with pytest.raises(ValueError, match="auto_find_batch_size is not supported .* set per_device_train_batch_size"):
        offload.hf.Trainer(model=offload.hf.meta_model(path), offload_config=DS,
                           args=arguments(tmp_path / "run", auto_find_batch_size=True))


def test_an_epoch_that_ends_mid_accumulation_steps_as_the_plain_trainer_does(tmp_path):
    """10 batches an epoch, 3 per step: the fourth step of each epoch has one batch, as in transformers."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    kw = dict(gradient_accumulation_steps=3, num_train_epochs=2)
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref", **kw), train_dataset=data(rows=20))
    ref.train()
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=DS,
                              args=arguments(tmp_path / "ours", **kw), train_dataset=data(rows=20))
    ours.train()
    assert len(logged(ours)) == 8 and ours.engine.global_steps == 8
    assert logged(ours) == pytest.approx(logged(ref), rel=1e-6)
    assert logged(ours, "grad_norm") == pytest.approx(logged(ref, "grad_norm"), rel=1e-5)


def test_the_shipped_trainer_config_resolves_with_default_arguments(tmp_path):
    from conftest import REPO

    from offload.config import Config
    raw = json.loads((REPO / "configs" / "zero3_cpu_offload_hf.json").read_text())
    resolved = resolve(raw, arguments(tmp_path), tiny("llama"), num_training_steps=100)
    cfg = Config.load(resolved).resolve(world_size=1, hidden_size=32)
    assert cfg.auto_paths() == [] and cfg.train_micro_batch_size_per_gpu == 2
    assert cfg.gradient_clipping == 1.0 and cfg.optimizer.params.lr == 1e-3
    assert cfg.scheduler is None  # the Trainer's own lr_scheduler_type runs


def test_evaluate_predict_and_generate_run_through_the_engine_as_the_plain_trainer_does(tmp_path):
    """After training: the evaluation loss, predict's logits, and greedy generation (a cache growing token by
    token, each forward gathering every unit) equal the plain Trainer's model, and leave the engine's state as it
    was (the same evaluation after them)."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    ref = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               args=arguments(tmp_path / "ref"), train_dataset=data(), eval_dataset=data(rows=6))
    before = ref.evaluate()["eval_loss"]
    ref.train()
    ours = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=arguments(tmp_path / "ours"),
                              offload_config=DS, train_dataset=data(), eval_dataset=data(rows=6))
    assert ours.evaluate()["eval_loss"] == pytest.approx(before, rel=1e-6)  # before train(): the engine built for it
    ours.train()
    assert logged(ours) == pytest.approx(logged(ref), rel=1e-6)
    loss = ours.evaluate()["eval_loss"]
    assert loss == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-6)
    got, expected = ours.predict(data(rows=6)), ref.predict(data(rows=6))
    assert got.predictions.shape == expected.predictions.shape == (6, 16, 128)
    assert got.predictions == pytest.approx(expected.predictions, rel=1e-5, abs=1e-5)
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)
    prompt = data(rows=2, seq=5)
    prompt = torch.stack([row["input_ids"] for row in prompt])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    generated = ours.model.generate(prompt, **kw)
    assert generated.shape == (2, 17)
    assert torch.equal(generated, ref.model.generate(prompt, **kw))
    assert ours.evaluate()["eval_loss"] == loss  # bitwise: nothing of the engine's state moved


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_engine(tmp_path):
    """The best checkpoint's whole engine state, as DeepSpeed's integration loads it: the weights alone would leave
    the fp32 masters at the last step, so evaluating and a later train() would disagree."""
    from safetensors.torch import load_file
    path = save(tiny("llama"), tmp_path / "ckpt")
    args = arguments(tmp_path / "run", eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, args=args, offload_config=DS,
                                 train_dataset=data(), eval_dataset=data(rows=4))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-4")  # the highest eval loss: an early step's
    saved = load_file(f"{best}/model.safetensors")
    state = trainer.engine.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())


@pytest.mark.parametrize("kw, message", [
    ({"fsdp": "full_shard"}, "fsdp: offload shards the model itself"),
    ({"bf16_full_eval": True}, "bf16_full_eval/fp16_full_eval: casting the model for evaluation"),
    ({"optim": "sgd"}, "optim='sgd': the engine runs Adam/AdamW only"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
     "lr_scheduler_type='reduce_lr_on_plateau' steps on an evaluation metric"),
], ids=["fsdp", "full_eval", "optim", "plateau"])
def test_arguments_the_engine_cannot_honour_are_refused_by_name(tmp_path, kw, message):
    path = save(tiny("llama"), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"cannot honour these TrainingArguments:\n- " + message):
        offload.hf.Trainer(model=offload.hf.meta_model(path), args=arguments(tmp_path / "run", **kw),
                           offload_config=DS)


def test_model_init_is_refused_and_overridden_arguments_are_named(tmp_path, caplog):
    path = save(tiny("llama"), tmp_path / "ckpt")
    args = arguments(tmp_path / "run")
    args._n_gpu = 4  # what one process sees on a 4-GPU machine without torchrun (the plain Trainer: DataParallel)
    with pytest.raises(ValueError, match="4 GPUs visible to one process: .* torchrun --nproc-per-node 4"):
        offload.hf.Trainer(model=offload.hf.meta_model(path), args=args, offload_config=DS)
    with pytest.raises(ValueError, match="model_init= is not supported: the engine is built once"):
        offload.hf.Trainer(model_init=lambda: offload.hf.meta_model(path), args=arguments(tmp_path / "run"),
                           offload_config=DS)
    config = {**DS, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with caplog.at_level("WARNING", logger="offload.hf"):
        offload.hf.Trainer(model=offload.hf.meta_model(path), args=arguments(tmp_path / "run", optim="sgd"),
                           offload_config=config)
    assert "its optimizer/scheduler sections are used" in caplog.text and "optim='sgd'" in caplog.text


def test_the_worked_example_fine_tunes_under_torchrun(tmp_path):
    """examples/finetune_hf.py on two ranks: a local Llama checkpoint with its tokenizer, saved and loadable."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from test_pretrained import tiny_tokenizer

    from offload.commands.demo import TEXT
    path = save(tiny("llama", vocab=128), tmp_path / "ckpt")
    tiny_tokenizer(TEXT).save_pretrained(path)
    (tmp_path / "corpus.txt").write_text(TEXT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(REPO / "examples" / "finetune_hf.py"), "--model", str(path),
                          "--data", str(tmp_path / "corpus.txt"), "--config",
                          str(REPO / "configs" / "zero3_cpu_offload_hf.json"), "--out", str(tmp_path / "out"),
                          "--block", "16", "--batch", "2", "--lr", "1e-3"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final", dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not torch.equal(final.state_dict()["model.norm.weight"], start.state_dict()["model.norm.weight"])
    assert (tmp_path / "out" / "final" / "tokenizer.json").is_file()


def _resume_on_rank(rank, world, path, out, resume):
    import torch

    import offload.hf
    torch.manual_seed(0)
    rows = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (48, 16))]
    trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=DS,
                                 args=arguments(out, save_strategy="steps", save_steps=2), train_dataset=rows)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(f"{out}/final")
    return logged(trainer)


def test_checkpoints_resume_and_save_at_w2(tmp_path):
    """Every rank takes part in saving (weights gathered unit by unit, the engine's checkpoint) and resuming."""
    path = save(tiny("llama"), tmp_path / "ckpt")
    straight = run_ranks(_resume_on_rank, 2, path=path, out=str(tmp_path / "a"), resume=None)
    resumed = run_ranks(_resume_on_rank, 2, path=path, out=str(tmp_path / "b"),
                        resume=str(tmp_path / "a" / "checkpoint-4"))
    assert len(straight[0]) == 6
    for a, b in zip(straight, resumed):
        assert b == pytest.approx(a, rel=1e-6)  # the resumed history: the checkpoint's 4 steps, then 2 more
    final_a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final", dtype=torch.float32)
    final_b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final", dtype=torch.float32)
    for key, value in final_a.state_dict().items():
        assert torch.equal(value, final_b.state_dict()[key]), key


AUTO_CASES = [
    # every key Hugging Face fills, all "auto"
    {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
     "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
     "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                               "weight_decay": "auto"}},
     "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
     "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                           "stage3_param_persistence_threshold": "auto"}},
    # numbers that agree, numbers that do not, keys absent, stage 2 (no stage-3 sizes filled)
    {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.7,
     "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.999], "eps": "auto"}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1, "warmup_num_steps": 3}},
     "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}},
    {"train_batch_size": 24, "fp16": {"enabled": True}, "zero_optimization": {"stage": 3}},
]


@pytest.mark.parametrize("case", range(len(AUTO_CASES)))
def test_auto_resolution_is_hugging_faces_own_where_deepspeed_is_installed(tmp_path, case):
    """The same configs through transformers' HfTrainerDeepSpeedConfig (which needs deepspeed to import): the
    same values filled, and a mismatch exactly where it finds one (`./dev.sh deepspeed` runs this)."""
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    args = arguments(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=4, max_grad_norm=0.7,
                     learning_rate=5e-4, weight_decay=0.05, warmup_steps=4)
    model = tiny("llama", hidden=48)
    theirs = HfTrainerDeepSpeedConfig(copy.deepcopy(AUTO_CASES[case]))  # it may fill the dict it is given
    theirs.trainer_config_process(args)
    try:
        theirs.trainer_config_finalize(args, model, 40)
        their_error = None
    except ValueError as e:
        their_error = str(e)
    try:
        ours, our_error = resolve(AUTO_CASES[case], args, model, 40), None
    except ConfigMismatch as e:
        ours, our_error = None, str(e)
    if their_error is None:
        assert our_error is None and ours == theirs.config
    else:
        assert our_error is not None
        assert [line for line in our_error.splitlines() if line.startswith("- ds ")] == \
            [line for line in their_error.splitlines() if line.startswith("- ds ")]


STOPPED_TRAINER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
path, out, at, resume = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "resume"
import torch
import offload.hf
from offload.engine.core import Engine
from test_hf_trainer import DS, arguments, logged
calls = []
backward = Engine.backward
def signalled(self, loss, *args, **kwargs):
    calls.append(1)
    if len(calls) == at:
        os.kill(os.getpid(), signal.SIGTERM)  # inside the step's second micro-batch
    return backward(self, loss, *args, **kwargs)
Engine.backward = signalled
torch.manual_seed(0)
rows = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (24, 16))]
trainer = offload.hf.Trainer(model=offload.hf.meta_model(path), weights=path, offload_config=DS,
                             args=arguments(out), train_dataset=rows)
trainer.train(resume_from_checkpoint=True if resume else None)
print("LOSSES", json.dumps(logged(trainer)))
"""


def test_a_sigterm_stops_the_trainer_after_its_step_with_a_checkpoint_that_resumes(tmp_path):
    """save_strategy "no", and still a checkpoint of the step the signal stopped: the Trainer's loop saves it and
    the process exits 143; train(resume_from_checkpoint=True) then goes on as the run that never stopped. Each run
    is a process of its own, forked from a zygote that imported transformers and offload once (tests/zygote.py)."""
    from conftest import REPO
    from zygote import Zygote

    script = tmp_path / "stopped_trainer.py"
    script.write_text(STOPPED_TRAINER)
    zygote = Zygote(["transformers", "offload.hf", "test_hf_trainer"], env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        def run(out, at, resume):
            ran, = zygote.script(script, str(REPO / "tests"), str(path), str(out), str(at),
                                 "resume" if resume else "start", cwd=tmp_path, timeout=600)
            return ran

        path = save(tiny("llama"), tmp_path / "ckpt")
        straight = run(tmp_path / "straight", 0, False)
        assert straight.code == 0, straight.output[-3000:]
        stopped = run(tmp_path / "out", 6, False)  # backward calls 5 and 6 make step 3
        assert stopped.code == 143, stopped.output[-3000:]
        said = f"offload.hf.Trainer: stopped by SIGTERM after step 3; saved checkpoint {tmp_path / 'out'}/checkpoint-3;"
        assert said in stopped.output, stopped.output[-2000:]
        assert (tmp_path / "out" / "checkpoint-3" / "offload" / "latest").read_text() == "global_step3"
        resumed = run(tmp_path / "out", 0, True)
        assert resumed.code == 0, resumed.output[-3000:]
    finally:
        zygote.close()
    losses = [json.loads(r.output.split("LOSSES ")[-1].splitlines()[0]) for r in (straight, resumed)]
    assert len(losses[0]) == 6 and losses[1] == pytest.approx(losses[0], rel=1e-6)
