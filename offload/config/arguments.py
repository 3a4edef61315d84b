"""DeepSpeed's command-line arguments, as ``deepspeed.add_config_arguments(parser)`` adds them: a script that parses
them keeps working after ``import offload as deepspeed``, and its ``args.deepspeed_config`` is the config file the
engine reads (``initialize(args=args)``)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's group of arguments (``--deepspeed``, ``--deepspeed_config``, and the old ``--deepscale``
    names) to ``parser`` and return it."""
    group = parser.add_argument_group("DeepSpeed", "the engine's config, as DeepSpeed's scripts pass it")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="a flag for the script's own use; the engine does not read it")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the JSON config the engine reads (initialize(args=args))")
    group.add_argument("--deepscale", default=False, action="store_true", help="the old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="the old name of --deepspeed_config")
    return parser
