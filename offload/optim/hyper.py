"""What a param group's step reads: Adam's hyperparameters (Lion's, Adagrad's), Muon's, or a torch optimizer's own
(one type for every schedule that hands them on), and which of the slot's moment buffers each update keeps."""

from __future__ import annotations

from offload.optim.adam import AdamHyper
from offload.optim.generic import GenericHyper, GenericStep
from offload.optim.muon import MuonHyper
from offload.optim.one_state import ONE_STATE_HELD
from offload.store.state_format import MOMENTS

Hyper = AdamHyper | MuonHyper | GenericHyper


def held_moments(update: str, generic: GenericStep | None = None) -> tuple[str, ...]:
    """The moment buffers ``update`` (OptimizerChoice.update) keeps: Adam's and Muon's both (Muon's second holds
    its orthogonalised update), Lion's and Adagrad's one, a torch optimizer's as many as its groups' state has
    tensors (by its name alone, unprobed: both)."""
    if update in ONE_STATE_HELD:
        return ONE_STATE_HELD[update]
    if update == "torch" and generic is not None:
        return MOMENTS[:max(len(layout.tensors) for layout in generic.layouts)]
    return MOMENTS
