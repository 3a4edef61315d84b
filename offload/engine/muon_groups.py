"""The config's type Muon: which parameters Muon steps, the param groups it makes, and what it refuses.

DeepSpeed's rule for which half a parameter is in: a parameter the script tagged (``param.use_muon``) is where its
tag says; any other is Muon's when it is a matrix whose name says neither ``embed`` nor ``lm_head``. (DeepSpeed
tags every parameter of two or more dimensions, overwriting a script's tag; torch.optim.Muon takes only 2-D ones,
so here the rest go to AdamW and a 3-D or 4-D parameter tagged for Muon is refused.) Each param group the script
passed splits into its Muon half and its AdamW half, as DeepSpeed splits them: the config's value, then
``muon_lr`` / ``adam_lr``, then the group's own key, the most specific last. Every parameter then carries
``use_muon`` as it was decided, as DeepSpeed marks them (a script reads the mark to log or to build its own groups)."""

from __future__ import annotations

from typing import Any

from torch import nn

from offload.config import Config, ConfigError
from offload.config.fields import resolved
from offload.config.sections import AdamParams
from offload.engine.errors import EngineError
from offload.optim.muon import MuonHyper

MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_steps", "adjust_lr_fn")  # a group may set these
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")  # ... and its AdamW half these


def uses_muon(param: nn.Parameter, name: str) -> bool:
    tag = getattr(param, "use_muon", None)
    if tag is None:
        return param.ndim == 2 and not any(word in name.lower() for word in ("embed", "lm_head"))
    if tag and param.ndim != 2:
        raise EngineError(f"parameter {name or '?'} is tagged use_muon but has shape {tuple(param.shape)}: Muon "
                          "orthogonalises 2-D matrices (as torch.optim.Muon); set its use_muon to False so AdamW "
                          "steps it, or reshape it into a matrix")
    return bool(tag)


def muon_halves(model: nn.Module, source: list[Any], p: AdamParams) -> list[dict[str, Any]]:
    """The param groups of type Muon from the script's parameters or groups (``source``), in DeepSpeed's order:
    each group's Muon half, then its AdamW half (a half with no parameters is left out)."""
    names = {id(q): n for n, q in model.named_parameters()}
    groups = [g for g in source if isinstance(g, dict)]
    loose = [q for q in source if not isinstance(q, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    muon = {"lr": p.lr if p.muon_lr is None else p.muon_lr, "momentum": p.momentum, "weight_decay": p.weight_decay,
            "nesterov": p.nesterov, "ns_steps": p.ns_steps, "adjust_lr_fn": p.adjust_lr_fn, "ns_method": p.ns_method}
    adam = {"lr": p.lr if p.adam_lr is None else p.adam_lr, "betas": tuple(resolved(p.betas)), "eps": p.eps,
            "weight_decay": p.weight_decay}
    torch_muon = MuonHyper()  # torch.optim.Muon's iteration: its coefficients and eps (the config's eps is AdamW's)
    out = []
    for g in groups:
        halves: dict[bool, list[Any]] = {True: [], False: []}
        for q in g["params"]:
            mine = uses_muon(q, names.get(id(q), ""))
            q.use_muon = mine  # DeepSpeed marks each parameter so, and scripts read the mark
            halves[mine].append(q)
        for use_muon, defaults, keys in ((True, muon, MUON_KEYS), (False, adam, ADAM_KEYS)):
            if not halves[use_muon]:
                continue
            settings = {**defaults, **{k: v for k, v in g.items() if k in keys}}
            if use_muon:
                settings |= {"ns_coefficients": torch_muon.ns_coefficients, "eps": torch_muon.eps}
            out.append({**settings, "params": halves[use_muon], "use_muon": use_muon})
    return out


def check_muon(cfg: Config) -> None:
    """Where Muon's state cannot be, refused by name (see [Note: Muon over shards] in offload/optim/muon_pass.py); what
    its schedule cannot be, the schedule refuses (offload/engine/step_schedule.py)."""
    zero = cfg.zero_optimization
    if zero.offload_optimizer.device == "nvme":
        raise ConfigError("zero_optimization.offload_optimizer.device", "Muon's state is stepped on the host or the "
                          "device here, not through NVMe (its first pass reads every unit's momentum at once): "
                          "set it to cpu or none")
