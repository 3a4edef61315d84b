"""``engine.compile()``: DeepSpeed's call, compiling each unit's blocks, and what dynamo made of them.

A mixin of ``Engine`` (offload/engine/core.py). DeepSpeed compiles its engine's whole module
(``engine.compile(backend, compile_kwargs)``), or rewrites it with DeepCompile's passes
(``schedule``); offload compiles what FSDP2 users compile, each block the units are cut at,
with the gathers and releases outside the graphs (offload/zero/compiled.py).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from offload.engine.errors import EngineError
from offload.zero.compiled import CompileReport, compile_anchors, compiled_modules, split_blocks
from offload.zero.runtime import ZeroRuntime
from offload.zero.unit import Unit

logger = logging.getLogger("offload.engine")


class Compiling:
    """``compile``, ``is_compiled`` and ``compile_report``, with DeepSpeed's names where it has them."""

    module: nn.Module
    units: list[Unit]
    runtime: ZeroRuntime

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None) -> None:
        """Compile every unit's anchor modules in place with ``torch.compile(backend=..., **compile_kwargs)``; the
        model's own forward around them (and the engine's hooks) stays eager. Idempotent for compiled modules."""
        if schedule is not None:
            raise EngineError("engine.compile(schedule=...) names DeepCompile's passes, which offload does not run: "
                              "it compiles each unit's blocks with torch.compile; drop schedule")
        options = dict(compile_kwargs or {})
        if "backend" in options:
            raise EngineError("engine.compile: give the backend as backend=, not inside compile_kwargs")
        anchors = [a for u in self.units for a in u.plan.anchors]
        split = split_blocks(self.module, anchors)
        if split:
            logger.warning("engine.compile: the units are cut inside %d block(s) (%s%s), so those are compiled unit "
                           "by unit, torch's own layers left eager: for one graph per block compile the blocks before "
                           "offload.initialize (block.compile(); each is then one unit), or raise "
                           "offload.unit_bytes to a block's size", len(split), ", ".join(split[:2]),
                           " ..." if len(split) > 2 else "")
        done = compile_anchors(self.module, anchors, backend, options)
        logger.info("engine.compile: %d module(s) compiled with backend %r%s", len(done), backend,
                    f" ({', '.join(done[:3])}{' ...' if len(done) > 3 else ''})" if done else "")

    @property
    def is_compiled(self) -> bool:
        return bool(compiled_modules(self.module))

    def compile_report(self) -> CompileReport:
        """The graphs, graph breaks (with their reasons) and recompiles after the first step since the engine
        started (dynamo's process-wide counters)."""
        return self.runtime.compiles.report()
