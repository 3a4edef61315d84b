#!/usr/bin/env python3
"""Same as `offload tune-nvme` (the logic lives in offload/bench/tune.py)."""

import sys

from offload.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["tune-nvme", *sys.argv[1:]]))
