"""``paddle.jit.to_static``: refused on a sharded model, at the call.

A sharded model's forward hooks gather its parameters with collectives and swap them
into the modules; dynamic-to-static cannot trace that, and used to fail at the first
call with an ``UnboundLocalError`` from inside the all-gather tags. The refusal names
the way that works: train in dynamic mode, and convert an unsharded copy loaded from
``full_state_dict`` for export. Anything not sharded converts as before.
"""

from __future__ import annotations

import functools
from typing import Any

import paddle
import paddle.jit.api as jit_api

from ..engine.registry import registry
from .patching import replace

_installed = False


def _sharded_layer_of(target: object) -> paddle.nn.Layer | None:
    """The sharded Layer ``target`` is (or whose bound method it is), else None."""
    layer = getattr(target, "__self__", target)
    if isinstance(layer, paddle.nn.Layer) and registry.units_under(layer):
        return layer
    return None


def install() -> None:
    global _installed
    if _installed:
        return
    original = jit_api.to_static

    @functools.wraps(original)
    def to_static(function: Any = None, *args: Any, **kwargs: Any) -> Any:
        layer = _sharded_layer_of(function) if function is not None else None
        if layer is not None:
            raise NotImplementedError(
                f"paddle.jit.to_static on a model sharded by fully_shard "
                f"({type(layer).__name__}) is not supported: its forward gathers the "
                "parameters with collectives, which dynamic-to-static cannot trace. Train "
                "in dynamic mode; to export, load paddle_hsdp.full_state_dict(model) into "
                "an unsharded copy of the model and convert that.")
        return original(function, *args, **kwargs)

    why = "refused on sharded models at the call (it failed inside the all-gather tags)"
    replace(jit_api, "to_static", to_static, why)
    replace(paddle.jit, "to_static", to_static, why)
    _installed = True
