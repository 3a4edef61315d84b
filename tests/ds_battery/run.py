"""Run one battery script under DeepSpeed or, with its import changed, under offload.

    python run.py {deepspeed,offload} SCRIPT [args...]

For offload the script's imports are changed exactly as the README tells a migrating user, and
nothing else: ``import deepspeed`` becomes ``import offload as deepspeed``, ``import deepspeed.x as y``
becomes ``import offload.x as y``, and ``from deepspeed[.x] import ...`` becomes ``from offload[.x] import ...``.
"""

import os
import re
import sys

impl, script, *argv = sys.argv[1:]
source = open(script).read()
if impl == "offload":
    source = re.sub(r"^import deepspeed$", "import offload as deepspeed", source, flags=re.M)
    source = re.sub(r"^import deepspeed\.", "import offload.", source, flags=re.M)
    source = re.sub(r"^from deepspeed([. ])", r"from offload\1", source, flags=re.M)
sys.argv = [script, *argv]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script})
if impl == "offload":  # the changed imports reached everything: DeepSpeed itself never ran
    assert not [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")], "DeepSpeed was imported"
