"""Optimizers paddle_hsdp ships where the installed Paddle has none: :class:`Muon`
(``paddle_hsdp.Muon`` is Paddle's own ``paddle.optimizer.Muon`` when it has one)."""

from .muon import MUON_EXCLUDE, Muon, MuonParamInfo, default_should_use_muon, muon_param_info

__all__ = ["MUON_EXCLUDE", "Muon", "MuonParamInfo", "default_should_use_muon",
           "muon_param_info"]
