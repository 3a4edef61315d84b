"""What a param group's step reads: Adam's hyperparameters (Lion's, Adagrad's), Muon's, or a torch optimizer's own
(one type for every schedule that hands them on)."""

from __future__ import annotations

from offload.optim.adam import AdamHyper
from offload.optim.generic import GenericHyper
from offload.optim.muon import MuonHyper

Hyper = AdamHyper | MuonHyper | GenericHyper
