"""offload standing in for DeepSpeed: the finder that serves ``deepspeed`` and its modules from offload's DeepSpeed
surface and reports a ``deepspeed`` distribution (see [Note: offload behind the DeepSpeed path] in
offload/as_deepspeed.py, the switch a script imports). Importing this package changes nothing; ``install()`` does."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from offload.stand_in.modules import DEEPSPEED_VERSION, MODULES, fill

log = logging.getLogger("offload")

PATH = Path(__file__).resolve().parent / "path"  # what `offload launch` puts first on PYTHONPATH (launch.py)
# The distribution the switch reports, as one metadata file (a legacy egg-info that importlib.metadata reads whole):
# a wheel build drops every folder named *.dist-info inside a package (scikit-build-core does), and this is the file
# that `offload launch`'s PYTHONPATH and the finder below both serve.
_METADATA = PATH / f"deepspeed-{DEEPSPEED_VERSION}.egg-info"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        fill(module)


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Serves ``deepspeed`` and its modules from offload, and reports the ``deepspeed`` distribution."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname not in MODULES:
            raise ModuleNotFoundError(
                f"{fullname} is DeepSpeed's and offload does not answer it: offload stands in for DeepSpeed in this "
                "process (offload.as_deepspeed); docs/deepspeed-api.md lists what it answers. Without the switch, "
                "an installed DeepSpeed runs instead", name=fullname)
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        if fullname == "deepspeed":  # deepspeed.__file__, which scripts read to find DeepSpeed's folder: the stand-in's
            spec.origin, spec.has_location = str(PATH / "deepspeed" / "__init__.py"), True
        return spec

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") == "deepspeed":
            yield importlib.metadata.PathDistribution(_METADATA)


_FINDER = DeepSpeedFinder()


def installed() -> bool:
    return _FINDER in sys.meta_path


def install() -> None:
    """Put the finder first (idempotent). A ``deepspeed`` imported before it is DeepSpeed's own: refused, since the
    two cannot be mixed in one process."""
    if installed():
        return
    existing = sys.modules.get("deepspeed")
    if existing is not None and not getattr(existing, "__offload__", False):
        raise ImportError("DeepSpeed was imported before offload.as_deepspeed: put `import offload.as_deepspeed` "
                          "first in the script (before transformers, accelerate, TRL or deepspeed), or start it "
                          "under `offload launch`")
    if not _METADATA.is_file():  # what transformers reads first: without it they fail obscurely
        raise ImportError(f"offload's install lacks {_METADATA}, the deepspeed distribution the switch reports: "
                          "reinstall offload (`pip install .` from its source ships it)")
    sys.meta_path.insert(0, _FINDER)
    importlib.invalidate_caches()
    try:
        theirs = next(d for d in importlib.metadata.distributions(name="deepspeed")
                      if getattr(d, "_path", None) != _METADATA)
        also = f"; the installed DeepSpeed {theirs.version} is not used"
    except StopIteration:
        also = ""
    from offload.version import __version__
    log.warning("offload %s stands in for DeepSpeed %s: transformers', accelerate's and TRL's DeepSpeed paths run on "
             "offload's engine%s", __version__, DEEPSPEED_VERSION, also)


def module(name: str) -> types.ModuleType:
    """A fresh ``deepspeed`` module of that name, as the switch serves it (the PYTHONPATH package stands one in for
    itself while its own import is under way, so this does not go through ``sys.modules``)."""
    install()
    spec = _FINDER.find_spec(name)
    assert spec is not None and spec.loader is not None
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    return made
