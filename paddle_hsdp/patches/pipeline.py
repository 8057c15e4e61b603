"""HSDP inside Paddle's pipeline schedule: a sharded ``PipelineLayer``'s forward runs
through its hooks, and a ``PipelineLayer`` whose stages disagree with fleet's groups is
refused.

``PipelineParallel`` (``fleet.distributed_model`` with ``pp_degree > 1``) calls
``self._layers.forward(...)``, not ``self._layers(...)``: the forward hooks of a
``fully_shard`` unit on the ``PipelineLayer`` never run. Its parameters (the stage's
embedding or head) were then gathered by each sub-module's own call and every block
became a root of its own, each predicting the step's last backward on its own: under
1F1B (forwards and backwards interleaved) some buffers ran their outer all-reduce
twice a step (measured: 5 for 3 buffers). So ``PipelineLayer.forward``, called directly
on a sharded ``PipelineLayer``, goes through ``__call__``: the stage is one root, its
units are gathered and prefetched in forward order, and each buffer's outer all-reduce
runs once per step. Unsharded ``PipelineLayer``\\ s, and calls made through
``__call__``, are untouched (a per-instance count of the ``__call__``\\ s in progress
tells the two apart, kept right by ``try``/``finally`` when a forward raises).

A ``PipelineLayer`` built without ``topology=`` makes its own, data-major one; when
fleet's groups put another axis (sharding, mp) inside the pipeline axis, its stages
disagree with fleet's, so ranks of different stages share a sharding group and pair
different collectives (a mismatch error, a hang, or broadcasts that overwrite one
stage's weights with another's). ``PipelineLayer.__init__`` refuses that, naming
``topology``, on every rank alike (the whole rank -> stage map is compared) and before
any of HSDP's collectives.
"""

from __future__ import annotations

import functools
from typing import Any

from paddle import nn
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

from .patching import replace

_installed = False
_CALLS = "_hsdp_calls_in_progress"


def _patch_pipeline_layer() -> None:
    cls = pp_layers.PipelineLayer
    original_forward = cls.forward

    def __call__(self: pp_layers.PipelineLayer, *args: Any, **kwargs: Any) -> Any:
        calls = self.__dict__
        calls[_CALLS] = calls.get(_CALLS, 0) + 1
        try:
            return nn.Layer.__call__(self, *args, **kwargs)
        finally:
            calls[_CALLS] -= 1

    def forward(self: pp_layers.PipelineLayer, *args: Any, **kwargs: Any) -> Any:
        if "_hsdp_unit_" in self.__dict__ and not self.__dict__.get(_CALLS):
            return self(*args, **kwargs)  # a direct call (PipelineParallel): the hooks run
        return original_forward(self, *args, **kwargs)

    replace(cls, "__call__", __call__,
            "counts calls in progress, so a direct forward call can be told apart")
    replace(cls, "forward", forward,
            "PipelineParallel calls forward directly: on an HSDP unit it goes through the "
            "hooks, so the stage is one root and syncs once per step")


def check_stages(layer: pp_layers.PipelineLayer) -> None:
    """Refuse a ``PipelineLayer`` whose rank -> stage map is not fleet's (see above)."""
    hcg = fleet_topology._HYBRID_PARALLEL_GROUP
    if hcg is None or hcg.get_pipe_parallel_world_size() <= 1:
        return
    fleet_topo = hcg.topology()
    if layer._topo.world_size() != fleet_topo.world_size():
        raise ValueError(
            f"PipelineLayer(topology=...): a topology of {layer._topo.world_size()} ranks, "
            f"fleet.init's has {fleet_topo.world_size()}. Pass "
            "topology=fleet.get_hybrid_communicate_group().topology().")
    for rank in range(fleet_topo.world_size()):
        mine, fleets = layer._topo.get_coord(rank).pipe, fleet_topo.get_coord(rank).pipe
        if mine != fleets:
            raise ValueError(
                f"PipelineLayer(topology=...): its stages disagree with fleet.init's "
                f"pipeline groups (rank {rank} is stage {mine} here, stage {fleets} in "
                "fleet's), so ranks of different stages would share a sharding group. Pass "
                "topology=fleet.get_hybrid_communicate_group().topology().")


def _patch_pipeline_layer_init() -> None:
    cls = pp_layers.PipelineLayer
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: pp_layers.PipelineLayer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        check_stages(self)

    replace(cls, "__init__", __init__,
            "refuse stages that disagree with fleet's pipeline groups (no topology= given)")


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_pipeline_layer()
    _patch_pipeline_layer_init()
    _installed = True
