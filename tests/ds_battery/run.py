"""Run one battery script under DeepSpeed or, with its import changed, under offload.

    python run.py {deepspeed,offload} SCRIPT [args...]

For offload the script's source is changed exactly as the README tells a migrating user:
``import deepspeed`` becomes ``import offload as deepspeed`` and ``from deepspeed.x`` becomes
``from offload.x``; nothing else.
"""

import os
import sys

impl, script, *argv = sys.argv[1:]
source = open(script).read()
if impl == "offload":
    source = source.replace("import deepspeed\n", "import offload as deepspeed\n").replace("from deepspeed.",
                                                                                           "from offload.")
sys.argv = [script, *argv]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script})
