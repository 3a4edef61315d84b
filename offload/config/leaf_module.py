"""DeepSpeed's leaf modules (``zero_optimization.leaf_module``): modules gathered whole, never split across units
(offload/zero/plan.py calls them atomic)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import setting

# DeepSpeed 0.19.8's default leaf modules: the sparse MoE blocks whose experts a token picks at run time
LEAF_MODULE_CLASSES = ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                       "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                       "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"]


@dataclass(kw_only=True, slots=True)
class LeafModuleConfig:
    classes: list[str] = setting(
        LEAF_MODULE_CLASSES, "Module classes (qualified, or the class name alone) never split across units: "
                                   "each is gathered whole at its forward, so an MoE block's experts are all "
                                   "there whichever a token picks. Default: DeepSpeed's MoE blocks.")
    names: list[str] = setting([], "Modules, by their qualified name in the model, never split across units.")
    name_suffixes: list[str] = setting([], "Modules whose qualified name ends with one of these, never split "
                                           "across units.")
