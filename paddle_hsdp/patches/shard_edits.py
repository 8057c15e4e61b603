"""``Tensor.set_value`` / ``Tensor.copy_`` on an HSDP shard mark its buffer edited.

With outer sub-shards (``fsdp_outer_sharding="optim"``) a shard parameter is this rank's
piece of its buffer, and an edit of it must reach the other replicas before the next
forward reads their pieces ([Note: edits under outer sub-shards] in engine/buffer/outer_pieces.py).
Paddle's in-place ops bump a tensor's inplace version, which the buffer compares, but
these two write the tensor's memory without bumping it (an EMA swap, weights loaded by
hand), so they say so here. Other tensors keep Paddle's methods unchanged, at the cost
of one attribute lookup.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import paddle

from .patching import replace

_installed = False


def _marking(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: paddle.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        sp = getattr(self, "_hsdp_sharded_param", None)
        if sp is not None and sp.buffer is not None:
            sp.buffer.pieces.note_edit()
        return result
    return method


def install() -> None:
    global _installed
    if _installed:
        return
    for name in ("set_value", "copy_"):
        replace(paddle.Tensor, name, _marking(getattr(paddle.Tensor, name)),
                "an HSDP shard written without an inplace-version bump marks its buffer "
                "edited, so outer replicas rebuild from the edit")
    _installed = True
