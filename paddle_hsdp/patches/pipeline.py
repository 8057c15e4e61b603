"""HSDP inside Paddle's pipeline schedule: a sharded ``PipelineLayer``'s forward runs
through its hooks.

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
"""

from __future__ import annotations

from paddle import nn
from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

from .patching import replace

_installed = False
_CALLS = "_hsdp_calls_in_progress"


def _patch_pipeline_layer() -> None:
    cls = pp_layers.PipelineLayer
    original_forward = cls.forward

    def __call__(self, *args, **kwargs):
        calls = self.__dict__
        calls[_CALLS] = calls.get(_CALLS, 0) + 1
        try:
            return nn.Layer.__call__(self, *args, **kwargs)
        finally:
            calls[_CALLS] -= 1

    def forward(self, *args, **kwargs):
        if "_hsdp_unit_" in self.__dict__ and not self.__dict__.get(_CALLS):
            return self(*args, **kwargs)  # a direct call (PipelineParallel): the hooks run
        return original_forward(self, *args, **kwargs)

    replace(cls, "__call__", __call__,
            "counts calls in progress, so a direct forward call can be told apart")
    replace(cls, "forward", forward,
            "PipelineParallel calls forward directly: on an HSDP unit it goes through the "
            "hooks, so the stage is one root and syncs once per step")


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_pipeline_layer()
    _installed = True
