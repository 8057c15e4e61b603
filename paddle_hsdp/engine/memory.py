"""What the engine holds, for ``memory_report``: the full-size parameter bytes gathered
across units (now and at peak), the peak of full-size grads during backward, and the
report itself (the same figures at every engine event:
``paddle_hsdp.engine.trace.enable(memory=True)``). The running figures live on
``context.memory``, which ``EngineContext.reset`` restarts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from ..hints import expect_layer
from .context import context
from .optimizers import optimizer_state_bytes
from .registry import units_under

if TYPE_CHECKING:
    import paddle


def add_gathered(nbytes: int, units: int) -> None:
    """Full-size parameter bytes (and units) gathered across all units changed by this
    much (``context.memory``: now and at peak)."""
    memory = context.memory
    memory.gathered += nbytes
    memory.units += units
    memory.gathered_peak = max(memory.gathered_peak, memory.gathered)
    memory.units_peak = max(memory.units_peak, memory.units)


class _HoldsFullGrads(Protocol):
    """What :func:`sample_full_grads` reads of a unit (an ``FSDPUnit``, which imports
    this module)."""

    def full_grad_nbytes(self) -> int: ...


def sample_full_grads(units: Iterable[_HoldsFullGrads]) -> None:
    """The most full-size grad bytes alive at once during backward, sampled at every
    post-backward and end of backward while that sampling is on
    (:func:`reset_peak_memory` turns it on: the sampling walks every parameter of the
    root)."""
    memory = context.memory
    if memory.sampling_full_grads:
        memory.full_grads_peak = max(memory.full_grads_peak,
                                     sum(u.full_grad_nbytes() for u in units))


def memory_report(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer | None = None,
                  ) -> dict[str, int]:
    """Bytes the engine holds for ``model`` on this rank, now: local ``shard`` params,
    ``grad`` (shard grads plus any full-size grads alive), ``gathered`` full params;
    ``staging``: what the collectives' staging pool holds, less the grad grids in use,
    which count as the full grads they hold (all models; see engine/staging.py and
    engine/buffer/full_grads.py); ``peak_gathered`` / ``peak_gathered_units``: the most
    full-size param bytes and units gathered at once (all models), and
    ``peak_full_grads``: the most full-size grad bytes alive at a post-backward, an
    early reduction or end of backward, since :func:`reset_peak_memory`. With
    ``optimizer``: ``optimizer``, the bytes of its states (accumulators, master
    weights) for the model's shards on this rank (with ``fsdp_outer_sharding="optim"``
    1/O of HSDP's). The same figures at every engine event:
    ``paddle_hsdp.engine.trace.enable(memory=True)``."""
    expect_layer(model, "memory_report")
    total = {"shard": 0, "grad": 0, "gathered": 0}
    units = units_under(model)
    for unit in units:
        for key, value in unit.held_bytes().items():
            total[key] += value
    memory = context.memory
    total["staging"] = context.staging.staging_bytes
    total["peak_gathered"] = memory.gathered_peak
    total["peak_gathered_units"] = memory.units_peak
    total["peak_full_grads"] = memory.full_grads_peak
    if optimizer is not None:
        total["optimizer"] = optimizer_state_bytes(optimizer, units)
    return total


def reset_peak_memory() -> None:
    """Restart the peaks ``memory_report`` gives; also turns on the sampling of
    full-size grad bytes during backward (``peak_full_grads``)."""
    context.memory.restart_peaks()
    context.memory.sampling_full_grads = True
