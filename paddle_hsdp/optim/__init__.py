"""Optimizers paddle_hsdp ships: :class:`Muon`, with the arguments of Paddle's own
``paddle.optimizer.Muon`` (Paddle after 3.3; 3.3.1 has none). ``paddle_hsdp.Muon`` is
always this one, also where Paddle has its own: it skips the empty shards of matrices
other ranks own, joins tensor-parallel slices and treats a 3-D stack as a batch of
matrices, which Paddle's (read December 2026) does not; Paddle's own, given to the
engine, gets the whole-matrix checks of any ``*Muon*`` class."""

from .muon import MUON_EXCLUDE, Muon, MuonParamInfo, default_should_use_muon, muon_param_info

__all__ = ["MUON_EXCLUDE", "Muon", "MuonParamInfo", "default_should_use_muon",
           "muon_param_info"]
