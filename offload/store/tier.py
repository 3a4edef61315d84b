"""The tiers a rank's state lives on: one vocabulary for parameter homes, optimizer sub-groups and budgets.

Code compares tiers by identity (``tier is Tier.NVME``). The config names them in its own
words (offload_param.device and offload_optimizer.device: "none", "cpu", "nvme"); those
stay strings where the config is read, and become a tier where one is decided
(offload/store/placement.py, ``place_sub_groups``). A tier's ``value`` is its name in
text and results ("device", "host", "nvme": logs, memory summaries, `offload estimate`,
bench records), so what is printed and written is keyed as it always was.

A leaf: nothing from offload, so the budgets (offload/store/budget.py) can name tiers too.
"""

from __future__ import annotations

import enum


class Tier(enum.Enum):
    """Where a piece of state lives. A plain Enum, not a str one: comparing a tier with a string is never
    silently true, so the two vocabularies cannot mix again."""

    DEVICE = "device"  # the compute device's memory (host memory itself when the compute device is the CPU)
    HOST = "host"  # host memory
    NVME = "nvme"  # a swap file on NVMe, read into host buffers for use
