"""The cases tests/test_trl.py runs in processes forked from its zygote (tests/zygote.py), where offload's DeepSpeed
switch was imported before transformers, accelerate and TRL: one function per script a user would write, each
returning what the test compares. Everything is built here: a small Llama-shaped model, a word-level tokenizer and
the data sets (no hub access)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
WORDS = 120  # w0..w119, then the special tokens

# DeepSpeed's ZeRO-3 with parameters and optimizer state on the host, "auto" where transformers fills it in
ZERO3_OFFLOAD: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "stage3_gather_16bit_weights_on_model_save": True},
}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({"<pad>": 120, "<eos>": 121, "<bos>": 122, "<unk>": 123})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=120,
                         eos_token_id=121, bos_token_id=122)
    return LlamaForCausalLM(config)


def _words(n: int, generator: torch.Generator) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=generator))


def texts(rows: int = 48) -> Any:
    from datasets import Dataset
    g = torch.Generator().manual_seed(1)
    return Dataset.from_dict({"text": [_words(12, g) for _ in range(rows)]})


def preferences(rows: int = 48) -> Any:
    """Prompt, chosen and rejected; each completion starts with a space, so the prompt's tokens are a prefix of the
    prompt and completion's."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(2)
    return Dataset.from_dict({"prompt": [_words(6, g) for _ in range(rows)],
                              "chosen": [" " + _words(5, g) for _ in range(rows)],
                              "rejected": [" " + _words(5, g) for _ in range(rows)]})


# [the order of construction] Each case builds its model before its trainer's arguments. Arguments with a ZeRO-3
# DeepSpeed config make transformers initialise a model built after them module by module under GatheredParameters
# (transformers' initialize_weights_zero3), which draws the random weights in another order than plain construction:
# under DeepSpeed as under offload. A plain run beside it would then start from other weights (a Llama classifier
# does; the causal LM happens not to). Users load checkpoints, where the order does not matter.


def _common(out: Path, ds: dict[str, Any] | None, steps: int, **kw: Any) -> dict[str, Any]:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=steps,
                learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", seed=0, disable_tqdm=True, bf16=False,
                deepspeed=copy.deepcopy(ds) if ds is not None else None)
    base.update(kw)
    return base


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _engine_name(model: Any) -> str:
    return f"{type(model).__module__}.{type(model).__name__}"


def sft(rank: int, world: int, out: str, ds: dict[str, Any] | None, steps: int = 20,
        resume: str | None = None, **kw: Any) -> dict[str, Any]:
    """TRL's SFTTrainer as its docs write it; ``ds`` is the DeepSpeed config (None: plain accelerate)."""
    from trl import SFTConfig, SFTTrainer
    model = llama()
    args = SFTConfig(**_common(Path(out), ds, steps, **kw), max_length=32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=texts(), processing_class=tokenizer())
    trainer.train(resume_from_checkpoint=resume)
    return {"losses": _losses(trainer), "engine": _engine_name(trainer.model_wrapped),
            "steps": [h["step"] for h in trainer.state.log_history if "loss" in h]}


def dpo(rank: int, world: int, out: str, ds: dict[str, Any] | None, steps: int = 20) -> dict[str, Any]:
    """TRL's DPOTrainer with an explicit reference model (the policy's copy), which its DeepSpeed branch prepares
    with ``deepspeed.initialize(model=...)``: what the reference holds on this rank is reported by tier."""
    from trl import DPOConfig, DPOTrainer
    policy = llama()
    reference = llama()
    reference.load_state_dict(policy.state_dict())
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    args = DPOConfig(**_common(Path(out), ds, steps))
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=preferences(),
                         processing_class=tokenizer())
    trainer.train()
    ref = trainer.ref_model
    summary = ref.memory_summary() if hasattr(ref, "memory_summary") else None
    return {"losses": _losses(trainer), "engine": _engine_name(trainer.model_wrapped), "reference": _engine_name(ref),
            "reference_training": bool(getattr(ref, "training", True)), "reference_summary": summary,
            "reference_full_bytes": full,
            "reference_local": sum(p.numel() * p.element_size() for p in ref.parameters())}


def subclassed_trainer(rank: int, world: int, out: str, ds: dict[str, Any] | None, steps: int = 20) -> dict[str, Any]:
    """A transformers.Trainer subclass that overrides ``training_step`` and ``compute_loss`` as TRL's trainers do
    (its own loss; a count kept per step), run unchanged."""
    from transformers import Trainer, TrainingArguments

    class Counting(Trainer):
        calls = 0

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            labels = inputs.pop("labels")
            logits = model(**inputs).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
            return (loss, logits) if return_outputs else loss

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            Counting.calls += 1
            return super().training_step(model, inputs, num_items_in_batch)

    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": t, "labels": t, "attention_mask": torch.ones_like(t)}
            for t in torch.randint(0, WORDS, (48, 12), generator=g)]
    model = llama()
    args = TrainingArguments(**_common(Path(out), ds, steps, gradient_accumulation_steps=2))
    trainer = Counting(model=model, args=args, train_dataset=rows)
    trainer.train()
    return {"losses": _losses(trainer), "engine": _engine_name(trainer.model_wrapped), "calls": Counting.calls}


def switch_answers(rank: int, world: int) -> dict[str, Any]:
    """What transformers, accelerate and TRL see of DeepSpeed in a process with the switch, and how a name offload
    does not answer fails."""
    import importlib.metadata

    import accelerate.utils
    import deepspeed  # offload's, by the switch the zygote imported first
    import transformers.integrations
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import offload.zero

    answers: dict[str, Any] = {
        "version": importlib.metadata.version("deepspeed"), "module_version": deepspeed.__version__,
        "transformers_sees": transformers.integrations.is_deepspeed_available(),
        "accelerate_sees": accelerate.utils.is_deepspeed_available(),
        "offloads": bool(getattr(deepspeed, "__offload__", False)),
        "initialize": deepspeed.initialize.__module__, "cpu_adam": DeepSpeedCPUAdam.__module__,
        "zero_init": issubclass(deepspeed.zero.Init, offload.zero.Init), "status": [s.name for s in ZeroParamStatus],
        "file": deepspeed.__file__,
    }
    try:
        import deepspeed.moe.layer  # noqa: F401
    except ModuleNotFoundError as e:
        answers["missing_module"] = str(e)
    try:
        deepspeed.runtime.pipe  # noqa: B018
    except AttributeError as e:
        answers["missing_name"] = str(e)
    return answers


def save_tiny(rank: int, world: int, out: str) -> str:
    """The small Llama and its tokenizer as a Hugging Face checkpoint directory (what GRPO's reference model and
    ``from_pretrained`` under ZeRO-3 load)."""
    llama().save_pretrained(out)
    tokenizer().save_pretrained(out)
    return out


def digit_reward(completions: list[str], **_: Any) -> list[float]:
    """A reward that reads the completion's words (so equal rewards mean equal completions, near enough)."""
    return [sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit()) / 10 for c in completions]


def grpo(rank: int, world: int, out: str, ds: dict[str, Any] | None, checkpoint: str, gather: bool = True,
         steps: int = 20) -> dict[str, Any]:
    """TRL's GRPOTrainer from a checkpoint directory, with a reference model (beta > 0, built from the same
    directory, under ZeRO-3 by ``from_pretrained`` inside ``zero.Init``) and a reward function; sampling at
    temperature 1. Returns the logged gradient norms and every completion generated."""
    from trl import GRPOConfig, GRPOTrainer
    seen: list[list[str]] = []

    def reward(completions: list[str], **kw: Any) -> list[float]:
        seen.append(list(completions))
        return digit_reward(completions)

    g = torch.Generator().manual_seed(4)
    from datasets import Dataset
    data = Dataset.from_dict({"prompt": [_words(4, g) for _ in range(48)]})
    args = GRPOConfig(**_common(Path(out), ds, steps), num_generations=2, max_completion_length=6, beta=0.1,
                      ds3_gather_for_generation=gather)
    trainer = GRPOTrainer(model=checkpoint, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer())
    trainer.train()
    return {"grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "completions": seen, "engine": _engine_name(trainer.model_wrapped),
            "reference": _engine_name(trainer.ref_model)}


def zero3_from_pretrained(rank: int, world: int, checkpoint: str) -> list[str]:
    """``from_pretrained`` as transformers runs it under a ZeRO-3 DeepSpeed config (inside ``zero.Init``, each
    loaded weight gathered with ``modifier_rank=0``), then ``initialize``: the parameters that differ from the
    checkpoint's (none, when it works)."""
    import deepspeed
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    config = {**ZERO3_OFFLOAD, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": world, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - transformers reads it through a weak reference
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    saved = load_file(str(Path(checkpoint) / "model.safetensors"))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return [n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), saved[n])]


def reward_model(rank: int, world: int, out: str, ds: dict[str, Any] | None, steps: int = 20) -> dict[str, Any]:
    """TRL's RewardTrainer on a Llama-shaped sequence classifier (one score), over chosen and rejected pairs."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=120,
                         eos_token_id=121, bos_token_id=122, num_labels=1)
    model = LlamaForSequenceClassification(config)  # before the config: see [the order of construction] below
    args = RewardConfig(**_common(Path(out), ds, steps), max_length=32)
    trainer = RewardTrainer(model=model, args=args, train_dataset=preferences(), processing_class=tokenizer())
    trainer.train()
    return {"losses": _losses(trainer), "engine": _engine_name(trainer.model_wrapped)}


def refused_config(rank: int, world: int, out: str, zero: dict[str, Any]) -> dict[str, Any]:
    """SFT with a DeepSpeed config whose zero_optimization offload refuses: what is raised, and how far training
    got before it."""
    from offload.config import ConfigError
    ds = {**ZERO3_OFFLOAD, "zero_optimization": {**ZERO3_OFFLOAD["zero_optimization"], **zero}}
    from trl import SFTConfig, SFTTrainer
    model = llama()
    trainer = SFTTrainer(model=model, args=SFTConfig(**_common(Path(out), ds, 4), max_length=32),
                         train_dataset=texts(), processing_class=tokenizer())
    try:
        trainer.train()
    except ConfigError as e:
        return {"error": str(e), "steps": trainer.state.global_step}
    return {"error": None, "steps": trainer.state.global_step}
