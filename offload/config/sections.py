"""The sections of a DeepSpeed-format config, with DeepSpeed's defaults.

Each field's doc, default and rules are here and nowhere else; ``offload config
docs`` renders them (docs/CONFIG.md). Every key has one status (``Support``):
honoured (code outside this package reads it; a test finds the reader), ``NO_EFFECT``
with a one-line reason (reported when set), or ``REFUSED`` (an error when set, because
ignoring it would change training or memory). A section's ``inert()`` names the keys
its other values make pointless (fp16 settings with fp16 off), reported the same way.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from .fields import AUTO as AUTO_VALUE
from .fields import Auto, ConfigError, Support, section, setting
from .leaf_module import LeafModuleConfig

NO_EFFECT = Support.NO_EFFECT
REFUSED = Support.REFUSED

KiB, MiB, GiB = 2**10, 2**20, 2**30


# --------------------------------------------------------------------------- precision

_PINNED = ("offload pins exactly the host buffers that host-device copies use when the compute device is a GPU, "
           "and nothing on a CPU.")
_PIPELINED = "the NVMe optimizer step always reads ahead and writes behind through buffer_count buffers."
_UNITS_ARE_BUCKETS = ("units are the buckets: each unit is gathered and reduced whole; size them with "
                      "offload.unit_bytes.")
_NO_ZEROPP = "ZeRO++ and MiCS are not implemented; leave the key out."
_FP16_SETTINGS = ("auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                  "consecutive_hysteresis", "min_loss_scale")

@dataclass(kw_only=True, slots=True)
class FP16Config:
    enabled: bool | Auto = setting(False, "Train with fp16 compute copies, fp32 master weights and loss scaling.",
                                   auto=True)
    auto_cast: bool = setting(False, "Cast floating-point tensors in the forward's inputs to fp16 before the model "
                                     "sees them (fp16 only).")
    loss_scale: float = setting(0.0, "Static loss scale; 0 selects dynamic loss scaling.", ge=0)
    initial_scale_power: int = setting(16, "Dynamic scaling starts at 2**initial_scale_power.", ge=0, le=126)
    loss_scale_window: int = setting(1000, "Overflow-free steps before the dynamic scale doubles.", ge=1)
    hysteresis: int = setting(2, "Overflows tolerated before the dynamic scale halves.", ge=1)
    consecutive_hysteresis: bool = setting(False, "Refill hysteresis after every overflow-free step.")
    min_loss_scale: float = setting(1.0, "The dynamic scale never drops below this.", gt=0)
    fp16_master_weights_and_grads: bool = setting(
        False, "Keep master weights in fp16.", support=REFUSED, note="Master weights are always fp32.")

    def inert(self) -> dict[str, str]:
        if self.enabled is True or self.enabled is AUTO_VALUE:
            return {}
        return {name: "fp16 is not enabled" for name in _FP16_SETTINGS}


@dataclass(kw_only=True, slots=True)
class BF16Config:
    enabled: bool | Auto = setting(False, "Train with bf16 compute copies and fp32 master weights (no loss "
                                          "scaling).", auto=True)
    immediate_grad_update: bool = setting(False, "DeepSpeed's bf16 optimizer option.", support=NO_EFFECT,
                                          note="each unit's gradient is reduced and handed to the optimizer as "
                                               "soon as backward finishes it.")
    bf16_optimizer_states: bool = setting(False, "DeepSpeed's: Adam's moments held in bf16 (2 bytes each instead of "
                                                 "4; arithmetic in fp32, stored rounded to nearest even), on every "
                                                 "tier; the same as offload.optimizer_state.moments \"bf16\".")
    bf16_master_weights_and_grads: bool = setting(
        False, "DeepSpeed's: the master weights held in bf16, rounded to nearest even (2 bytes instead of 4). Updates "
               "smaller than half a bf16 unit of a weight are lost, so long runs at small learning rates stall; "
               "offload.optimizer_state.master \"bf16-stochastic\" rounds them stochastically instead. The same as "
               "offload.optimizer_state.master \"bf16\"; gradients still accumulate in fp32.")


# --------------------------------------------------------------------------- optimizer

MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


@dataclass(kw_only=True, slots=True)
class AdamParams:
    lr: float | Auto = setting(1e-3, "Learning rate (the peak rate when a scheduler warms up to it).", ge=0, auto=True)
    betas: tuple[float, float] | Auto = setting((0.9, 0.999), "Adam's (beta1, beta2).", ge=0, lt=1, auto=True)
    eps: float | Auto = setting(1e-8, "Added to the denominator for numerical stability.", gt=0, auto=True)
    weight_decay: float | Auto = setting(0.0, "Weight decay: decoupled (AdamW) or L2, see adam_w_mode.", ge=0,
                                         auto=True)
    adam_w_mode: bool = setting(True, "Decoupled weight decay. DeepSpeed's type Adam defaults to it too; "
                                      "set false (with type Adam) for L2 weight decay.")
    bias_correction: bool = setting(True, "Adam's bias correction of the moments.")
    amsgrad: bool = setting(False, "AMSGrad variant.", support=REFUSED, note="Use amsgrad: false.")
    torch_adam: bool = setting(False, "DeepSpeed: use torch's Adam instead of its own.", support=NO_EFFECT,
                               note="offload always runs its native Adam, which matches torch's within rounding.")
    fused: bool | None = setting(None, "torch's fused Adam switch.", support=NO_EFFECT,
                                 note="offload's Adam is always one fused pass per shard.")
    # type Muon's (the hidden matrices' Muon; the other parameters' AdamW takes the keys above)
    momentum: float = setting(0.95, "Muon's momentum (type Muon).", ge=0, lt=1)
    nesterov: bool = setting(True, "Muon's Nesterov blend of gradient and momentum (type Muon).")
    ns_steps: int = setting(5, "Muon's Newton-Schulz iterations (type Muon).", ge=1, le=99)
    adjust_lr_fn: str = setting("original", "How Muon scales a matrix's step by its shape, as torch.optim.Muon: "
                                            "original, sqrt(max(1, rows / cols)); match_rms_adamw, 0.2 sqrt(max(rows, "
                                            "cols)) (type Muon).", choices=MUON_ADJUST_LR)
    muon_lr: float | None = setting(None, "DeepSpeed's: the Muon groups' lr (null: lr) (type Muon).", ge=0)
    adam_lr: float | None = setting(None, "DeepSpeed's: the lr of the groups AdamW steps beside Muon (null: lr) "
                                          "(type Muon).", ge=0)
    ns_method: str = setting("standard", "DeepSpeed's choice of Newton-Schulz iteration (type Muon), kept in each Muon "
                                         "group as DeepSpeed keeps it. offload runs torch.optim.Muon's (bf16, "
                                         "ns_steps of them), DeepSpeed's 'standard'; its 'gram' (fp16, restarted) is "
                                         "not offered.", choices=("standard",))

# torch.optim's other elementwise optimizers, by name as DeepSpeed takes them: stepped by their own code
# (offload/optim/generic.py), their params handed to the class as they are
TORCH_TYPES = ("SGD", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
OPTIMIZER_TYPES = ("Adam", "AdamW", "Lion", "Adagrad", "Muon") + TORCH_TYPES
ONE_STATE_TYPES = ("Lion", "Adagrad")  # one state buffer beside the master (offload/optim/one_state.py)
RULE_TYPES = ONE_STATE_TYPES + ("Muon",)  # the types whose update is not Adam's
# a rule (AdamHyper.rule, Muon's, a torch optimizer's) -> how messages name it
RULE_NAMES = {t.lower(): t for t in RULE_TYPES} | {"torch": "a torch optimizer"}
# DeepSpeed's other config types: each refused by name, with why and what to use instead
_LAMB = ("scales each parameter's update by its whole weight's norm over its whole update's (a trust ratio), which "
         "offload's elementwise host kernels do not compute: use Lion or AdamW (or pass your own elementwise torch "
         "optimizer)")
_ONE_BIT = ("compresses the gradients' all-reduce to 1 bit with error feedback, which offload does not have: it "
            "reduces gradients exactly; type \"Adam\" takes the same params without the compression")
_MUP = ("{0} is mup's: build mup.{0}(model.parameters(), ...) in your script and pass it to "
        "initialize(optimizer=...): it is a torch.optim.{1} with each group's learning rate scaled by its width, "
        "which offload runs as such")
REFUSED_TYPES = (("Lamb", f"LAMB {_LAMB}"), ("OneBitLamb", f"1-bit LAMB {_ONE_BIT}; and LAMB {_LAMB}"),
                 ("OneBitAdam", f"1-bit Adam {_ONE_BIT}"), ("ZeroOneAdam", f"0/1 Adam {_ONE_BIT}"),
                 ("MuAdam", _MUP.format("MuAdam", "Adam")), ("MuAdamW", _MUP.format("MuAdamW", "AdamW")),
                 ("MuSGD", _MUP.format("MuSGD", "SGD")))
# the keys only type Muon reads (another type given one off its default is refused by name)
MUON_ONLY = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "muon_lr", "adam_lr", "ns_method")


def _optimizer_params_type(parsed: dict[str, Any]) -> Any:
    """AdamParams for offload's own types; a torch.optim type's keyword arguments as they are."""
    return dict[str, Any] if parsed.get("type") in TORCH_TYPES else AdamParams


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    type: str = setting("AdamW", "Adam, AdamW, Lion, Adagrad or Muon (case-insensitive), with DeepSpeed's "
                                 "parameters (Lion: lr, betas, weight_decay; Adagrad: lr, eps, default 1e-10 as "
                                 "DeepSpeed's, weight_decay; Muon: torch.optim.Muon on the 2-D matrices not named "
                                 "embed or lm_head, or as each parameter's use_muon says, AdamW on the rest), each "
                                 "on offload's own kernels; or, as DeepSpeed takes any torch.optim class by name, "
                                 "one of torch.optim's other elementwise optimizers, its params the class's own "
                                 "keyword arguments, stepped by its own code. For another optimizer leave this "
                                 "section out and pass your own. DeepSpeed's LAMB, 1-bit and mup types are refused "
                                 "with what to use instead.", choices=OPTIMIZER_TYPES,
                        refused_choices=REFUSED_TYPES)
    params: Any = section(AdamParams, "Optimizer hyperparameters (a torch.optim type's: its keyword arguments).",
                          hint_from=_optimizer_params_type)

    @property
    def rule(self) -> str:
        """The update this type runs (AdamHyper.rule, or muon): adam for Adam and AdamW, else its own."""
        if self.type in TORCH_TYPES:
            return "torch"
        return self.type.lower() if self.type in RULE_TYPES else "adam"

    def __post_init__(self) -> None:
        if self.type in TORCH_TYPES and not isinstance(self.params, dict):
            self.params = {}  # the section left out: the class's own defaults

    def check(self, path: str) -> None:
        if self.type in TORCH_TYPES:
            return  # the class checks its own keyword arguments (offload/engine/initialize.py)
        if self.type != "Muon":
            defaults = AdamParams()
            for key in MUON_ONLY:
                if getattr(self.params, key) != getattr(defaults, key):
                    raise ConfigError(f"{path}.params.{key}", f"is Muon's; type {self.type} has none: leave it out")
        if self.type in ONE_STATE_TYPES and not self.params.bias_correction:
            raise ConfigError(f"{path}.params.bias_correction", f"is Adam's; {self.type} has none: leave it out")
        if self.type == "AdamW" and not self.params.adam_w_mode:
            raise ConfigError(f"{path}.params.adam_w_mode",
                              "false contradicts type 'AdamW'; use type 'Adam' for L2 weight decay")


# --------------------------------------------------------------------------- scheduler

@dataclass(kw_only=True, slots=True)
class WarmupLRParams:
    warmup_min_lr: float | Auto = setting(0.0, "Learning rate at step 0.", ge=0, auto=True)
    warmup_max_lr: float | Auto | None = setting(None, "Learning rate reached at the end of warmup (null: the "
                                                       "optimizer's lr, as DeepSpeed's WarmupLR).", ge=0, auto=True)
    warmup_num_steps: int | Auto = setting(1000, "Steps of warmup.", ge=0, auto=True)
    warmup_type: str = setting("log", "Warmup curve.", choices=("log", "linear"))
    last_batch_iteration: int = setting(-1, "Step to resume the schedule from (-1: start).", ge=-1)


@dataclass(kw_only=True, slots=True)
class WarmupDecayLRParams(WarmupLRParams):
    # DeepSpeed's WarmupDecayLR keeps 0.001 as the peak when none is given (its WarmupLR takes the optimizer's lr)
    warmup_max_lr: float | Auto = setting(1e-3, "Learning rate reached at the end of warmup.", ge=0, auto=True)
    total_num_steps: int | Auto | None = setting(None, "Total steps; the rate decays linearly to 0 at this step. "
                                                       "Required.",
                                                 ge=1, auto=True)

    def check(self, path: str) -> None:
        _check_total_steps(self.total_num_steps, self.warmup_num_steps, path)


@dataclass(kw_only=True, slots=True)
class WarmupCosineLRParams:
    total_num_steps: int | Auto | None = setting(None, "Total steps of the schedule. Required.", ge=1, auto=True)
    warmup_min_ratio: float = setting(0.0, "Warmup starts at this fraction of the optimizer's lr.", ge=0, le=1)
    warmup_num_steps: int | Auto = setting(1000, "Steps of warmup.", ge=0, auto=True)
    cos_min_ratio: float = setting(1e-4, "The cosine decays to this fraction of the optimizer's lr.", ge=0, le=1)
    warmup_type: str = setting("log", "Warmup curve.", choices=("log", "linear"))
    last_batch_iteration: int = setting(-1, "Step to resume the schedule from (-1: start).", ge=-1)

    def check(self, path: str) -> None:
        _check_total_steps(self.total_num_steps, self.warmup_num_steps, path)


def _check_total_steps(total: Any, warmup: Any, path: str) -> None:
    """total_num_steps is required; a warmup longer than it runs as DeepSpeed runs it (the schedule warns when it
    is built: offload/optim/lr_schedules.py)."""
    if total is None:
        raise ConfigError(f"{path}.total_num_steps", "is required by this scheduler type (a whole number of steps)")


@dataclass(kw_only=True, slots=True)
class OneCycleParams:
    cycle_min_lr: float | None = setting(None, "The cycle's lower learning rate (where it starts and ends). Required.",
                                         ge=0)
    cycle_max_lr: float | None = setting(None, "The cycle's upper learning rate, reached at its middle. Required.",
                                         ge=0)
    decay_lr_rate: float = setting(0.0, "After the cycle: lr = cycle_min_lr / (1 + rate x decay steps).", ge=0)
    cycle_first_step_size: int = setting(2000, "Steps of the rising half of the cycle.", ge=1)
    cycle_second_step_size: int | None = setting(None, "Steps of the falling half (null: as the rising one).", ge=1)
    cycle_first_stair_count: int = setting(0, "Stairs in the rising half (0: continuous).", ge=0)
    cycle_second_stair_count: int | None = setting(None, "Stairs in the falling half (null: as the rising one).",
                                                   ge=0)
    decay_step_size: int = setting(0, "Steps per decay interval after the cycle (0: no decay).", ge=0)
    cycle_momentum: bool = setting(True, "Cycle Adam's beta1 inversely to the rate, between cycle_max_mom and "
                                         "cycle_min_mom; as DeepSpeed's, beta2 is then 0.99.")
    cycle_min_mom: float = setting(0.8, "beta1 at the cycle's middle.", ge=0, lt=1)
    cycle_max_mom: float = setting(0.9, "beta1 where the cycle starts and ends.", ge=0, lt=1)
    decay_mom_rate: float = setting(0.0, "After the cycle: beta1 = cycle_max_mom x (1 + rate x decay steps).", ge=0)
    last_batch_iteration: int = setting(-1, "Step to resume the schedule from (-1: start).", ge=-1)

    def check(self, path: str) -> None:
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if getattr(self, key) is None:
                raise ConfigError(f"{path}.{key}", "is required by OneCycle (a learning rate)")


@dataclass(kw_only=True, slots=True)
class LRRangeTestParams:
    lr_range_test_min_lr: float = setting(1e-3, "The rate the test starts from.", ge=0)
    lr_range_test_step_size: int = setting(2000, "Steps per interval of the rate's growth.", ge=1)
    lr_range_test_step_rate: float = setting(1.0, "Growth: lr = min_lr x (1 + rate x intervals).", ge=0)
    lr_range_test_staircase: bool = setting(False, "Grow in whole intervals (a staircase), not continuously.")
    last_batch_iteration: int = setting(-1, "Step to resume the schedule from (-1: start).", ge=-1)


SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


def _scheduler_params_type(parsed: dict[str, Any]) -> Any:
    return SCHEDULER_PARAMS.get(parsed.get("type", "WarmupLR"), WarmupLRParams)


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    type: str = setting("WarmupLR", "Learning-rate schedule, stepped once per optimizer step.",
                        choices=tuple(SCHEDULER_PARAMS))
    params: Any = section(None, "Schedule parameters; which keys depends on type.", hint_from=_scheduler_params_type)

    def __post_init__(self) -> None:
        if self.params is None:
            self.params = SCHEDULER_PARAMS.get(self.type, WarmupLRParams)()

    def check(self, path: str) -> None:
        check = getattr(self.params, "check", None)
        if check is not None:
            check(f"{path}.params")


# --------------------------------------------------------------------------- ZeRO

DEVICES = ("none", "cpu", "nvme")


def check_nvme_path(nvme_path: str | None, device: str, path: str) -> None:
    """An nvme offload needs a directory we can create swap files in (created at initialize if missing)."""
    if device != "nvme":
        return
    if not nvme_path:
        raise ConfigError(f"{path}.nvme_path", "is required with device 'nvme': a directory on the NVMe drive "
                                                "for swap files")
    target = os.path.abspath(os.path.expanduser(nvme_path))
    probe = target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{path}.nvme_path", f"{nvme_path!r} is not a directory ({probe!r} is a file); "
                                                "point it at a directory on the NVMe drive")
    try:
        # Creating a file is the only honest test: os.access says yes to root on read-only mounts.
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        what = "directory" if probe == target else f"nearest existing parent {probe!r}"
        raise ConfigError(f"{path}.nvme_path", f"{nvme_path!r} is not writable (creating a file in the {what} "
                                                f"failed: {e.strerror}); choose a directory this user can write "
                                                "to") from None


@dataclass(kw_only=True, slots=True)
class OffloadParamConfig:
    device: str = setting("none", "Where the 16-bit parameter shards live between uses: none (accelerator), cpu or "
                                  "nvme.",
                          choices=DEVICES)
    nvme_path: str | None = setting(None, "Directory for parameter swap files (device nvme).")
    pin_memory: bool = setting(True, "Use pinned host buffers for the shards (faster host-device copies).",
                               support=NO_EFFECT, note=_PINNED)
    buffer_count: int = setting(5, "Host buffers used to stage parameters read from NVMe.", ge=1)
    buffer_size: int = setting(100_000_000, "Elements per staging buffer; must hold the largest unit's shard.", ge=1)
    max_in_cpu: int = setting(1_000_000_000, "Parameter elements kept in host memory when device is nvme.", ge=0)

    def check(self, path: str) -> None:
        check_nvme_path(self.nvme_path, self.device, path)

    def inert(self) -> dict[str, str]:
        return {} if self.device == "nvme" else dict.fromkeys(
            ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"), f"parameters are not on NVMe (device "
                                                                        f"{self.device!r})")


@dataclass(kw_only=True, slots=True)
class OffloadOptimizerConfig:
    device: str = setting("none", "Where the fp32 master weights, Adam state and gradient accumulator live, "
                                  "and so where the step runs: none (accelerator), cpu or nvme.", choices=DEVICES)
    nvme_path: str | None = setting(None, "Directory for optimizer-state swap files (device nvme).")
    pin_memory: bool = setting(True, "Use pinned host buffers for optimizer state.", support=NO_EFFECT,
                               note=_PINNED)
    buffer_count: int = setting(4, "Pinned buffers that pipeline the optimizer step's NVMe reads and writes.", ge=1)
    pipeline_read: bool = setting(False, "Read sub-group i+1 from NVMe while the step runs on sub-group i.",
                                  support=NO_EFFECT, note=_PIPELINED)
    pipeline_write: bool = setting(False, "Write sub-group i-1 to NVMe while the step runs on sub-group i.",
                                   support=NO_EFFECT, note=_PIPELINED)
    fast_init: bool = setting(False, "Initialise NVMe optimizer state without a round trip through the accelerator.",
                              support=NO_EFFECT, note="NVMe optimizer state is always written straight from host "
                                                      "memory, never through the accelerator.")
    ratio: float | Auto = setting(
        1.0, "Fraction of the optimizer state that is offloaded (DeepSpeed's meaning); the rest, the units the "
             "next forward needs first, stays on the compute device and is stepped there. auto: as much as the "
             "device budget (or half the memory free at start, after the resident state and gathers, corrected "
             "on a GPU by the first step's peak: offload.auto_refit) holds, in that order; the rest offloaded. "
             "Beside offloaded parameters those units' shards stay on the device too, and auto homes the next "
             "units' shards there with the room left.",
        ge=0, le=1, auto=True)
    super_offload: bool = setting(False, "DeepSpeed's SuperOffload: the CPU optimizer step overlapped with "
                                         "backward, speculated and validated.", support=NO_EFFECT,
                                  note="offload's host step already overlaps backward where nothing global gates "
                                       "it (offload.overlap_step) and speculates where asked "
                                       "(offload.speculative_step); the values are the same either way.")
    cpuadam_cores_perc: float | None = setting(
        None, "Fraction of this process's physical cores the host's optimizer step runs on (DeepSpeed's "
              "SuperOffload share, 0.8 there by default); read as offload.cpu_threads = max(1, floor(fraction x "
              "cores)). null: offload.cpu_threads decides.", ge=0, le=1)

    def check(self, path: str) -> None:
        check_nvme_path(self.nvme_path, self.device, path)

    def inert(self) -> dict[str, str]:
        return {} if self.device == "nvme" else dict.fromkeys(
            ("nvme_path", "buffer_count"), f"the optimizer state is not on NVMe (device {self.device!r})")


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    stage: int = setting(0, "ZeRO stage: 0 data parallel, 1 shards optimizer state, 2 also gradients, "
                            "3 also parameters.", ge=0, le=3)
    contiguous_gradients: bool = setting(True, "Copy gradients into one contiguous buffer as they are produced.",
                                         support=NO_EFFECT, note="each unit's gradients are always taken as one "
                                                                 "contiguous flat buffer.")
    reduce_scatter: bool = setting(True, "Reduce gradients with reduce-scatter rather than all-reduce.",
                                   support=NO_EFFECT, note="stages 1-3 always reduce-scatter and stage 0 all-reduces; "
                                                           "the values are the same either way.")
    reduce_bucket_size: int | Auto = setting(500_000_000, "Elements reduced at once. auto: hidden_size**2.",
                                             ge=1, auto=True, support=NO_EFFECT, note=_UNITS_ARE_BUCKETS)
    allgather_partitions: bool = setting(True, "Stages 1-2: all-gather updated partitions (vs. broadcast).",
                                         support=NO_EFFECT, note="updated partitions are always all-gathered.")
    allgather_bucket_size: int = setting(500_000_000, "Stages 1-2: elements all-gathered at once.", ge=1,
                                         support=NO_EFFECT, note=_UNITS_ARE_BUCKETS)
    overlap_comm: bool | None = setting(None, "Overlap gradient reduction with backward. null: true for stage 3, "
                                              "false otherwise (DeepSpeed's default).")
    load_from_fp32_weights: bool = setting(True, "Restore master weights from the checkpoint's fp32 copy; false "
                                                 "rebuilds them from its compute-dtype weights (rounded).")
    elastic_checkpoint: bool = setting(False, "DeepSpeed's elastic checkpoint format.", support=NO_EFFECT,
                                       note="every checkpoint loads into any world size and ZeRO stage.")
    offload_param: OffloadParamConfig = section(OffloadParamConfig, "Stage 3: where parameter shards live.")
    offload_optimizer: OffloadOptimizerConfig = section(OffloadOptimizerConfig, "Where optimizer state lives and the "
                                                                                "step runs.")
    sub_group_size: int | Auto = setting(
        AUTO_VALUE, "Elements per optimizer-step sub-group (the unit of the pipelined NVMe step; the step's NVMe "
                    "buffers each hold the largest). auto: 2e7 with the state on NVMe (a sub-group is one unit, so "
                    "the buffers stay small whatever the model's size), else 1e9 (DeepSpeed's default).",
        ge=1, auto=True)
    stage3_prefetch_bucket_size: int | Auto = setting(
        50_000_000, "Elements of parameters prefetched ahead of use. auto: 0.9 * hidden_size**2.",
        ge=0, auto=True, aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: int | Auto = setting(
        100_000, "Parameters with at most this many elements stay whole between uses (from the first step on), "
                 "and units as small stay gathered. auto: 10 * hidden_size.",
        ge=0, auto=True, aliases=("param_persistence_threshold",))
    stage3_model_persistence_threshold: int = setting(
        2**63 - 1, "Cap on the elements kept whole by stage3_param_persistence_threshold, counted in unit order.",
        ge=0, aliases=("model_persistence_threshold",))
    stage3_max_live_parameters: int = setting(1_000_000_000, "Most parameter elements gathered at once.",
                                              ge=0, aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = setting(1_000_000_000, "Keep a gathered parameter if it is reused within this "
                                                            "many elements.", ge=0, aliases=("max_reuse_distance",),
                                             support=NO_EFFECT,
                                             note="a unit is released after its last use in forward and gathered "
                                                  "again, ahead of use, by the prefetcher for backward.")
    stage3_gather_16bit_weights_on_model_save: bool = setting(
        False, "save_16bit_model gathers the full 16-bit weights.",
        aliases=("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"))
    stage3_module_granularity_threshold: int = setting(0, "DeepSpeed's leaf-module grouping threshold.", ge=0,
                                                       aliases=("module_granularity_threshold",),
                                                       support=NO_EFFECT, note="units are sized by offload.unit_bytes.")
    leaf_module: LeafModuleConfig = section(LeafModuleConfig, "Modules gathered whole, never split across units "
                                                              "(DeepSpeed's leaf modules; offload.atomic_modules "
                                                              "adds to them).")
    stage3_allgather_sequential: bool = setting(
        False, "DeepSpeed's one-parameter-at-a-time all-gather.", aliases=("allgather_sequential",),
        support=NO_EFFECT, note="each unit is gathered by one all-gather of its flat buffer, unit by unit in the "
                                "prefetch order.")
    stage3_use_all_reduce_for_fetch_params: bool = setting(
        False, "DeepSpeed's all-reduce in place of the parameters' all-gather.",
        aliases=("use_all_reduce_for_fetch_params",), support=NO_EFFECT,
        note="units are gathered with all-gather; the values are the same either way.")
    compute_grad_norm: bool = setting(True, "Report the global gradient norm (get_global_grad_norm, the "
                                            "Trainer's grad_norm); false: None, as DeepSpeed answers. Clipping "
                                            "needs the norm.")
    parameter_alignment: int | None = setting(
        None, "DeepSpeed's alignment of each parameter's start in the flat buffer, in bytes.", ge=1,
        support=REFUSED, note="offload lays a unit's parameters end to end, each at a multiple of its own element "
                              "size; padding them to a larger alignment is not implemented: leave the key out.")
    enable_sanity_checks: bool = setting(False, "DeepSpeed's ZeRO-3 parameter-status checks.", support=NO_EFFECT,
                                         note="offload checks every unit's state transition always "
                                              "(offload/zero/unit.py).")
    save_muon_momentum_buffer_in_memory: bool = setting(
        False, "DeepSpeed's Muon momentum kept in device memory.", support=NO_EFFECT,
        note="offload's Muon keeps its momentum where the optimizer state lives (offload_optimizer.device).")
    zenflow: dict[str, Any] | None = setting(
        None, "DeepSpeed's ZenFlow (the important gradient columns stepped now, the rest later).", support=REFUSED,
        note="ZenFlow steps most of each matrix from gradients several steps old, which changes the values; "
             "offload's delayed update (offload.delayed_update) overlaps the host's step with the next forward "
             "and backward by stepping whole gradients one step late instead: use it, or leave zenflow out.")
    zeropp_loco_param: dict[str, Any] | None = setting(None, "ZeRO++ LoCo gradient compression.", support=REFUSED,
                                                       note=_NO_ZEROPP)
    ignore_unused_parameters: bool = setting(True, "Tolerate trainable parameters that receive no gradient in a step "
                                                   "(stepped with a zero gradient, as DeepSpeed does: weight decay "
                                                   "and the moments still move them, unlike torch.optim); false "
                                                   "makes step() an error naming them.")
    round_robin_gradients: bool = setting(False, "Stage 1-2 gradient copy ordering.", support=NO_EFFECT,
                                          note="gradients go to the optimizer unit by unit as backward finishes them.")
    use_multi_rank_bucket_allreduce: bool = setting(True, "DeepSpeed's bucketed all-reduce switch.", support=NO_EFFECT,
                                                    note=_UNITS_ARE_BUCKETS)
    memory_efficient_linear: bool = setting(True, "DeepSpeed's linear-layer memory optimisation.", support=NO_EFFECT,
                                            note="offload does not replace torch's linear layers.")
    pipeline_loading_checkpoint: bool = setting(False, "DeepSpeed's pipelined checkpoint loading.", support=NO_EFFECT,
                                                note="checkpoints are always read unit by unit, streamed.")
    override_module_apply: bool = setting(True, "DeepSpeed's module.apply override.", support=NO_EFFECT,
                                          note="offload does not patch Module.apply; build under offload.zero.Init "
                                               "and initialise weights in the modules' constructors.")
    log_trace_cache_warnings: bool = setting(False, "DeepSpeed's trace-cache warnings.", support=NO_EFFECT,
                                             note="a changed module order is followed silently (the prefetch trace "
                                                  "is re-recorded).")
    legacy_stage1: bool = setting(False, "DeepSpeed's legacy stage 1.", support=REFUSED, note="Use stage 1.")
    zero_hpz_partition_size: int = setting(1, "ZeRO++ hierarchical partitioning.", ge=1, support=REFUSED,
                                           note=_NO_ZEROPP)
    zero_quantized_weights: bool = setting(False, "ZeRO++ quantized weights.", support=REFUSED, note=_NO_ZEROPP)
    zero_quantized_nontrainable_weights: bool = setting(False, "ZeRO++ quantized frozen weights.", support=REFUSED,
                                                        note=_NO_ZEROPP)
    zero_quantized_gradients: bool = setting(False, "ZeRO++ quantized gradients.", support=REFUSED, note=_NO_ZEROPP)
    mics_shard_size: int = setting(-1, "MiCS sharding.", ge=-1, support=REFUSED,
                                   note="Shard over the whole data-parallel group (leave it out).")
    mics_hierarchical_params_gather: bool = setting(False, "MiCS hierarchical gather.", support=REFUSED,
                                                    note="Shard over the whole data-parallel group (leave it out).")

    @property
    def overlap_comm_effective(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def placement_words(self) -> str:
        """Where the parameters and the optimizer state live, in words ("none" means the compute device)."""
        def where(device: str, path: str | None) -> str:
            return {"none": "the device", "cpu": "the host"}.get(device, f"NVMe ({path})")
        state = where(self.offload_optimizer.device, self.offload_optimizer.nvme_path)
        ratio = self.offload_optimizer.ratio
        if self.offload_optimizer.device != "none" and ratio != 1.0:
            state += (" (the device keeps as much as it holds: offload_optimizer.ratio auto)" if isinstance(ratio, Auto)
                      else f" ({1 - ratio:g} of it stays on the device: offload_optimizer.ratio {ratio:g})")
        return (f"parameters on {where(self.offload_param.device, self.offload_param.nvme_path)}, optimizer state "
                f"on {state}")

    def check(self, path: str) -> None:
        if self.offload_param.device != "none" and self.stage < 3:
            raise ConfigError(f"{path}.offload_param.device",
                              f"parameter offload needs stage 3 (got stage {self.stage}); set stage 3, or use "
                              "offload_optimizer alone with stages 1-2")
        if self.offload_optimizer.device != "none" and self.stage < 1:
            raise ConfigError(f"{path}.offload_optimizer.device",
                              "optimizer offload needs stage 1, 2 or 3 (got stage 0); set stage 2 for classic "
                              "ZeRO-Offload")


# --------------------------------------------------------------------------- aio

@dataclass(kw_only=True, slots=True)
class AioConfig:
    block_size: int = setting(8 * MiB, "Bytes per I/O request; a multiple of 4096 (O_DIRECT). DeepSpeed's default is "
                                       "1 MiB; offload's is what `offload tune-nvme` measured best here.",
                              ge=4096, le=1 * GiB)
    queue_depth: int = setting(16, "Requests kept in flight (DeepSpeed's default: 8).", ge=1, le=32768)
    intra_op_parallelism: int = setting(1, "I/O threads per operation.", ge=1, le=1024, aliases=("thread_count",))
    single_submit: bool = setting(False, "Submit requests one at a time instead of in batches.", support=NO_EFFECT,
                                  note="io_uring keeps queue_depth requests in flight and submits as slots free up; "
                                       "the thread engine has no submission step.")
    overlap_events: bool = setting(True, "Overlap submission with completion reaping.", support=NO_EFFECT,
                                   note="a reaper thread always collects completions while requests are submitted.")
    use_gds: bool = setting(False, "GPUDirect Storage.", support=NO_EFFECT,
                            note="reads and writes go through host memory.")

    def check(self, path: str) -> None:
        if self.block_size % 4096:
            raise ConfigError(f"{path}.block_size", f"{self.block_size} is not a multiple of 4096, which O_DIRECT I/O "
                                                    f"needs; try {max(4096, self.block_size // 4096 * 4096)}")


# --------------------------------------------------------------------------- other DeepSpeed sections

_POOLED = "saved inputs held in host memory already go to buffers reused step after step."


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = setting(False, "Each rank of the model-parallel group (offload.checkpointing."
                                                 "configure) keeps 1/W of every saved input; all-gathered before "
                                                 "the recompute.")
    contiguous_memory_optimization: bool = setting(False, "Copy saved activations into one buffer.",
                                                   support=NO_EFFECT, note=_POOLED)
    cpu_checkpointing: bool = setting(False, "Keep saved block inputs in host memory (within offload.budgets.host), "
                                             "copied back ahead of each recompute.")
    number_checkpoints: int | None = setting(None, "Checkpoints per contiguous buffer.", ge=1, support=NO_EFFECT,
                                             note=_POOLED)
    synchronize_checkpoint_boundary: bool = setting(False, "Synchronise the device at each checkpoint boundary.")
    profile: bool = setting(False, "Log the time of each step's checkpointed forwards and recomputes.")


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    enabled: bool = setting(False, "Write training metrics with this monitor.")
    output_path: str = setting("", "Where the monitor writes.")
    job_name: str = setting("DeepSpeedJobName", "Run name.")


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    enabled: bool = setting(False, "Log training metrics to Weights & Biases.")
    group: str | None = setting(None, "W&B group.")
    team: str | None = setting(None, "W&B team.")
    project: str = setting("deepspeed", "W&B project.")


@dataclass(kw_only=True, slots=True)
class FlopsProfilerConfig:
    enabled: bool = setting(False, "Profile FLOPs of one step.")
    recompute_fwd_factor: float = setting(0.0, "Forward recompute factor.", ge=0)
    profile_step: int = setting(1, "Step to profile.", ge=0)
    module_depth: int = setting(-1, "Depth of the module report.", ge=-1)
    top_modules: int = setting(1, "Modules listed.", ge=0)
    detailed: bool = setting(True, "Per-module detail.")
    output_file: str | None = setting(None, "Report file (stdout if null).")


@dataclass(kw_only=True, slots=True)
class CommsLoggerConfig:
    enabled: bool = setting(False, "Log collective calls.")
    verbose: bool = setting(False, "Log every call.")
    prof_all: bool = setting(True, "Profile all collectives.")
    debug: bool = setting(False, "Include caller names.")
    prof_ops: list[str] | None = setting(None, "Only these collectives.")


@dataclass(kw_only=True, slots=True)
class DataTypesConfig:
    grad_accum_dtype: str | None = setting(None, "Dtype of the gradient accumulator.", choices=("fp32", "fp16", "bf16"),
                                           support=NO_EFFECT, note="gradients accumulate in fp32 wherever the "
                                                                   "optimizer state lives.")


_COMPILED_UNITS = ("engine.compile() compiles each unit's blocks with torch.compile, the gathers outside the graphs "
                   "(docs/compile.md); DeepCompile's passes are not run.")


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    deepcompile: bool = setting(False, "DeepSpeed: engine.compile() runs DeepCompile's passes (ZeRO-3 in the graph).",
                                support=NO_EFFECT, note=_COMPILED_UNITS)
    free_activation: bool = setting(False, "DeepCompile: free activations early.", support=NO_EFFECT,
                                    note="autograd frees each saved activation as backward uses it.")
    offload_activation: bool = setting(False, "DeepCompile: offload activations.", support=NO_EFFECT,
                                       note="activation_checkpointing.cpu_checkpointing keeps saved block inputs in "
                                            "host memory.")
    offload_opt_states: bool = setting(False, "DeepCompile: offload the optimizer states.", support=NO_EFFECT,
                                       note="zero_optimization.offload_optimizer homes the state; "
                                            "offload.stream_state steps host-homed state on the device.")
    double_buffer: bool = setting(True, "DeepCompile: double-buffer the all-gathers.", support=NO_EFFECT,
                                  note="the prefetcher gathers ahead within stage3_prefetch_bucket_size.")
    symmetric_memory: bool = setting(False, "DeepCompile: symmetric memory for the collectives.", support=NO_EFFECT,
                                     note=_COMPILED_UNITS)
    dump_graphs: bool = setting(False, "DeepCompile: write its graphs.", support=NO_EFFECT,
                                note="engine.compile_report() counts the graphs; TORCH_LOGS=graph_code prints them.")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    tag_validation: str = setting("Warn", "Check that all ranks save under the same tag: Warn logs a mismatch and "
                                          "saves under rank 0's tag, Fail raises before anything is written.",
                                  choices=("Ignore", "Warn", "Fail"))
    load_universal: bool = setting(False, "Load DeepSpeed's universal checkpoint format.", support=REFUSED,
                                   note="offload reads its own checkpoints, which load into any world size already.")
    use_node_local_storage: bool = setting(False, "Each node writes to local storage.", support=NO_EFFECT,
                                           note="every rank writes its own files under save_dir, which must be shared.")
    parallel_write: dict[str, Any] | None = setting(None, "DeepSpeed's pipeline-parallel write options.",
                                                    support=NO_EFFECT, note="there is no pipeline parallelism.")


# --------------------------------------------------------------------------- ours

@dataclass(kw_only=True, slots=True)
class BudgetsConfig:
    device: int | None = setting(None, "Bytes of accelerator memory offload may use (null: what is free at start).",
                                 ge=0, size=True)
    host: int | None = setting(None, "Bytes of pinned host memory in the pool (null: sized from the model).",
                               ge=0, size=True)
    nvme: int | None = setting(None, "Bytes of swap files under nvme_path (null: the free space there).",
                               ge=0, size=True)


@dataclass(kw_only=True, slots=True)
class DelayedUpdateConfig:
    warmup_steps: int | None = setting(
        None, "Opt-in delayed parameter update (ZeRO-Offload's DPU), which changes results by design: after this many "
              "exact steps, each step's Adam runs on a worker while the next forward and backward use the "
              "parameters from before it, and its new parameters are applied at the next step() (one step late). "
              "null: off. Needs ZeRO stage 3 with the optimizer state and parameters off NVMe.", ge=0)


@dataclass(kw_only=True, slots=True)
class HostMallocConfig:
    mmap_threshold: int | None = setting(
        None, "Fix glibc's mmap threshold (bytes; it caps at 32 MiB): allocations this large or larger get their own "
              "mapping, returned to the system when freed, so RSS tracks the live memory the budgets bound instead "
              "of drifting above it. Process-wide, so off unless set (null); `offload train` sets 128KiB.",
        ge=0, le=32 * MiB, size=True)


@dataclass(kw_only=True, slots=True)
class OptimizerStateConfig:
    master: str = setting("fp32", "How the master weights are held: fp32 (PyTorch's, the default: every step as "
                                  "torch's AdamW); 16+16 (the fp32 master exactly, as the bf16 weights the forward "
                                  "reads, rounded to nearest with ties away from zero, and a 16-bit low half); "
                                  "bf16 (rounded to nearest even, DeepSpeed's "
                                  "bf16_master_weights_and_grads: small updates are lost); bf16-stochastic "
                                  "(rounded stochastically: updates kept in expectation). A bf16 master needs "
                                  "bf16.enabled.", choices=("fp32", "16+16", "bf16", "bf16-stochastic"))
    moments: str = setting("fp32", "How the optimizer's state buffers are held (Adam's two moments; Lion's momentum "
                                   "and Adagrad's sum, one buffer each): fp32, or bf16 (arithmetic in fp32, stored "
                                   "rounded to nearest even: 2 bytes a buffer an element instead of 4; a bf16 "
                                   "Adagrad sum stops growing where a step's squared gradient is under 2**-9 of it). "
                                   "Muon and torch's other optimizers take fp32 only.", choices=("fp32", "bf16"))
    seed: int = setting(0, "The stochastic rounding's seed (each rank, step and unit draws its own stream from it, so "
                           "a resumed run rounds as the run that never stopped).", ge=0)


@dataclass(kw_only=True, slots=True)
class CheckpointsConfig:
    keep_last: int | None = setting(None, "Keep only the newest N training checkpoints in a save directory: after each "
                                          "save is published (and `latest` names it), the older ones beyond N are "
                                          "removed, never the one `latest` names and never one being written "
                                          "(null: keep every one, as DeepSpeed does). offload.hf.Trainer saves each "
                                          "checkpoint in a checkpoint-N folder of its own, which "
                                          "TrainingArguments.save_total_limit rotates.", ge=1)


@dataclass(kw_only=True, slots=True)
class OffloadExtConfig:
    checkpoints: CheckpointsConfig = section(CheckpointsConfig, "Training checkpoints (engine.save_checkpoint).")
    optimizer_state: OptimizerStateConfig = section(OptimizerStateConfig, "The optimizer state in fewer bytes "
                                                    "(docs/performance.md, \"the state in fewer bytes\", says when "
                                                    "each format suits).")
    budgets: BudgetsConfig = section(BudgetsConfig, "Hard byte budgets per tier; sizes may be written \"24GiB\".")
    host_malloc: HostMallocConfig = section(HostMallocConfig, "The C library's allocator (glibc).")
    unit_bytes: int = setting(64 * MiB, "Target bytes of a ZeRO-3 unit (parameters gathered and released together).",
                              ge=4096, size=True)
    aio_engine: str = setting("auto", "Swap I/O engine: auto (io_uring where the kernel allows, else threads), "
                                      "io_uring or threads.", choices=("auto", "io_uring", "threads"))
    cpu_threads: int | None = setting(None, "Threads for the CPU optimizer step (null: the physical cores the "
                                            "process may use).", ge=1)
    host_prefetch: str = setting("auto", "Whether the host's Adam prefetches its streams in software: auto (measured "
                                         "on this CPU, with and without, the first time a CPU model runs, and kept "
                                         "in the user's cache directory: on only where it is more than 3% faster), "
                                         "on or off. Changes no value.", choices=("auto", "on", "off"))
    overlap_step: str = setting("auto", "on: when nothing global gates the update (no gradient clipping, no fp16), "
                                        "each host-resident shard's Adam runs during the last micro-batch's "
                                        "backward as soon as its gradient lands; off: always step after backward; "
                                        "auto: on (on a GPU too: the Adam runs on the landing worker, beside "
                                        "backward).",
                                choices=("auto", "on", "off"))
    early_step: str = setting("auto", "on: engine.step() returns once the update is decided (norm, clipping, fp16 "
                                      "skip) and Adam runs on a worker thread in unit order while the next forward "
                                      "begins, each unit waiting only for its own shard (exact; needs ZeRO stage "
                                      "3; with the optimizer state or parameters on NVMe their reads and writes "
                                      "run beside the next forward too, and a state transfer failing then loses "
                                      "the step (a parameter write is redone from its master), so auto leaves that "
                                      "step whole); off: the step finishes before step() returns; auto: on where "
                                      "the compute device is a GPU and nothing of the model is on NVMe.",
                              choices=("auto", "on", "off"))
    speculative_step: str = setting("auto", "on: when gradient clipping or fp16 makes the update wait for the global "
                                             "norm, each host-resident shard's Adam still runs during the last "
                                             "micro-batch's backward as its gradient lands, with clip factor 1, into "
                                             "a second slot of its state; after backward the slot is kept when "
                                             "clipping did not fire and recomputed with the real factor when it did "
                                             "(bitwise the ordinary step either way; the second slot takes 12 bytes "
                                             "per host-resident parameter from the host budget); off: step after "
                                             "backward; auto: only the NVMe sub-groups (their swap files have the "
                                             "second slot), and only after a step whose clipping did not fire: "
                                             "their I/O then hides under backward (host sub-groups measured "
                                             "slower on a 2-core CPU, Adam and backward sharing the cores; on an "
                                             "H200 6% faster kept but 37% slower recomputed, so \"on\" suits a "
                                             "run whose clipping rarely fires).",
                                    choices=("auto", "on", "off"))
    auto_refit: bool = setting(True, "With offload_optimizer.ratio auto on a GPU and no device budget: after the "
                                     "first step, move the optimizer state of more units (the next forward's "
                                     "first) to the device, as far as the step's measured peak leaves room (5% "
                                     "of the device's memory, at least 1 GiB, kept free for allocator slack and "
                                     "longer batches); false: keep the start-up plan, which leaves half the "
                                     "memory free at start to the activations.")
    stream_state: float | Auto = setting(
        AUTO_VALUE, "Of the optimizer state offloaded (offload_optimizer.device cpu, or nvme: read into the step's "
                    "host buffers first, stepped inside the step's pass, which then returns only once done), the "
                    "share (the units the next forward needs first, after those whose state stays on the device) "
                    "that the compute device steps each step, its state read up over the bus and written back, "
                    "beside the host's Adam on the rest (exact: the same update); its gradients stay on the device. "
                    "auto: the share "
                    "that makes the fastest step at the rates measured at start-up (the host's Adam, the bus each "
                    "way, the device's memory) within the device's room, with offload_optimizer.ratio auto's share "
                    "chosen beside it; none where no rates are measured (a CPU device, NVMe state, the delayed "
                    "update). 0: the host steps all of it. No effect on a CPU compute device, whose memory is the "
                    "host's.", ge=0, le=1, auto=True)
    delayed_update: DelayedUpdateConfig = section(DelayedUpdateConfig, "The delayed parameter update (opt-in).")
    accumulate_on_device: bool = setting(True, "With gradient accumulation and the optimizer offloaded, keep each "
                                               "unit's fp32 gradient sum on the device while room allows (the device "
                                               "budget, or half the memory free at start, after the resident state "
                                               "and gathers) and bring it over once per step; false: add every "
                                               "micro-batch's gradient up on the host, leaving that device memory to "
                                               "activations.")
    checkpoint_blocks: bool = setting(False, "Checkpoint every transformer block (its _no_split_modules, or the "
                                             "repeated modules of its longest ModuleList): forward keeps only each "
                                             "block's input, backward recomputes the block (activation_checkpointing "
                                             "says where the inputs live).")
    atomic_modules: list[str] | None = setting(
        None, "Module class names never split across units: modules whose forward reads a child's parameters "
              "without calling the child (torch's MultiheadAttention and Transformer layers, and a Hugging Face "
              "model's _no_split_modules, are always atomic).")


