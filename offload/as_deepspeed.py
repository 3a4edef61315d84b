"""``import offload.as_deepspeed``: the one line that puts offload's engine behind transformers', accelerate's and
TRL's DeepSpeed paths in this process.

[Note: offload behind the DeepSpeed path]
Those libraries decide "DeepSpeed is here" by two facts: the ``deepspeed`` distribution's metadata (its version,
checked against their minimums) and ``import deepspeed`` finding a module. The switch answers both: a finder first
on ``sys.meta_path`` (offload/stand_in) serves ``deepspeed`` and each ``deepspeed.*`` module they import from
offload's DeepSpeed surface (docs/deepspeed-api.md; the table is offload/stand_in/modules.py), and reports a
``deepspeed`` distribution of version 0.19.8, the DeepSpeed whose surface offload answers. It stands first, so it wins
over a DeepSpeed that is installed too; the log says once which engine runs. A ``deepspeed`` module offload does not
answer fails its import with a ModuleNotFoundError that names it (never the installed DeepSpeed's module mixed in).

Two ways to turn it on, one line each:
- ``import offload.as_deepspeed`` at the top of the script, before transformers, accelerate or TRL is imported
  (they read the metadata once, at their import); every process that runs the script gets it.
- ``offload launch <command>`` (offload/stand_in/launch.py), for a launcher whose own process checks for DeepSpeed
  before starting the script (``accelerate launch`` with a DeepSpeed config): the command runs with
  offload/stand_in/path first on PYTHONPATH, whose ``deepspeed`` package installs the switch in every Python process
  that imports it, and whose metadata is found before any installed DeepSpeed's.
Why a stand-in for the ``deepspeed`` name rather than offload's own Trainer and Accelerator classes: TRL and the
Trainer's subclasses branch on DeepSpeed being enabled (the reference model's preparation, gathering the weights for
generation, the checkpoint calls), and those branches are the ones that keep a model sharded; answering them keeps
every subclass as its authors wrote it.
"""

from offload.stand_in import install

install()
