"""The CPU optimizer: a native fused Adam/AdamW, as an Optimizer and as a flat-buffer step."""

from offload.optim.adam import AdamHyper, adam_step
from offload.optim.cpu_adam import CPUAdam

__all__ = ["AdamHyper", "CPUAdam", "adam_step"]
