"""One of tests/trl_cases.py's scripts as a user runs it under a launcher (``offload launch accelerate launch
--config_file ... train.py <case> <out>``): the DeepSpeed config comes from the launcher's, none is in the script.
Each rank writes what the case returned to <out>/rank<N>.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for trl_cases

import trl_cases  # noqa: E402

case, out = sys.argv[1], Path(sys.argv[2])
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
result = getattr(trl_cases, case)(rank, world, out=str(out / "run"), ds=None)
(out / f"rank{rank}.json").write_text(json.dumps(result))
