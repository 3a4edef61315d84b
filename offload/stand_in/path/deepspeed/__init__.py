"""``deepspeed``, answered by offload: this directory goes first on PYTHONPATH (``offload launch``), so that a
launcher and every process it starts find it before any DeepSpeed installed, and the package metadata beside it says
DeepSpeed 0.19.8 to the version checks of transformers, accelerate and TRL. Importing it installs offload's switch and
stands the switch's ``deepspeed`` module in for this one ([Note: offload behind the DeepSpeed path] in
offload/as_deepspeed.py)."""

import sys

__offload__ = True  # this stand-in is offload's, not an installed DeepSpeed

from offload.stand_in import install, module  # noqa: E402

install()
sys.modules[__name__] = module("deepspeed")
