"""Optimizers paddle_hsdp ships where the installed Paddle has none: :class:`Muon`
(``paddle_hsdp.Muon`` is Paddle's own ``paddle.optimizer.Muon`` when it has one)."""

from .muon import MUON_EXCLUDE, Muon, default_should_use_muon

__all__ = ["MUON_EXCLUDE", "Muon", "default_should_use_muon"]
