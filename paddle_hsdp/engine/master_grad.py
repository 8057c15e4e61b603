"""Paddle's master-grad wrappers over HSDP shards: ``MixPrecisionLayer``'s ``main_grad``.

``paddle.distributed.fleet.utils.mix_precision_utils.MixPrecisionLayer(model)`` gives
every parameter a ``main_grad`` attribute (None) and a grad hook that moves each grad
autograd hands it into a float32 ``main_grad`` (adding to what is there) and leaves
``param.grad`` None; ``MixPrecisionOptimizer`` steps on ``main_grad`` only and its
``clear_grad`` zeroes it. Under HSDP the optimizer holds shards, which autograd never
gives a grad (the engine reduces the full parameters' grads into flat buffers), so the
engine does the hook's job at the one place where a shard's grad is made:

* a buffer whose parameters carry the marker (a ``main_grad`` attribute, on the shard or
  on the full parameter) accumulates its reduce-scattered grads, and runs its outer
  all-reduce, in one float32 flat tensor whose pieces are the shards' ``main_grad``;
  the shards' ``.grad`` stay None, as the hook leaves them;
* wrapped after ``fully_shard``, the hooks sit on the shards and never fire; the full
  parameters' ``.grad`` are reduced as always;
* wrapped before, the hooks sit on the full parameters and take every grad into the
  full parameter's ``main_grad`` (float32, accumulated over micro-steps when the
  reduction is deferred); the reduce-scatter reads it from there and releases it.

Main grads travel in float32 (the reduce-scatter and the outer all-reduce), as
Paddle's data-parallel reduction of ``main_grad`` does, unless the unit's
``MixedPrecisionPolicy`` names a ``reduce_dtype``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import paddle

from .policies import POLICY_HINT
from .registry import param_path

if TYPE_CHECKING:
    from .param import ShardedParam

MAIN_GRAD_DTYPE = paddle.float32  # what MixPrecisionLayer's hook accumulates in


def marked(sp: ShardedParam) -> bool:
    """Whether MixPrecisionLayer covered this parameter (its shard, once made, or its
    full one)."""
    return hasattr(sp.full, "main_grad") or hasattr(getattr(sp, "shard", None), "main_grad")


def uses_main_grad(params: Sequence[ShardedParam], describe: Callable[[], str]) -> bool:
    """Whether a buffer of trainable ``params`` accumulates into ``main_grad``. A buffer
    is one collective, so its parameters must agree: a wrapper over part of a unit is
    refused (the same on every rank, since every rank wraps the same modules)."""
    flags = [marked(sp) for sp in params]
    if any(flags) and not all(flags):
        wrapped = next(param_path(sp) for sp, f in zip(params, flags, strict=True) if f)
        bare = next(param_path(sp) for sp, f in zip(params, flags, strict=True) if not f)
        raise NotImplementedError(
            f"MixPrecisionLayer covers '{wrapped}' but not '{bare}', which travel in one "
            f"collective ({describe()}): wrap the whole model (or every fully_shard unit "
            f"whole) in MixPrecisionLayer, before or after fully_shard. {POLICY_HINT}")
    return bool(flags) and flags[0]


def full_grad(sp: ShardedParam) -> paddle.Tensor | None:
    """The full-size grad of ``sp`` this backward produced: the full parameter's
    ``main_grad`` when the wrapper's hook sits on it (wrapped before ``fully_shard``),
    else its ``.grad``; None when it got none."""
    grad, main = sp.full.grad, getattr(sp.full, "main_grad", None)
    if main is None:
        return grad
    return main if grad is None else main + grad.astype(main.dtype)


def has_full_grad(sp: ShardedParam) -> bool:
    return sp.full.grad is not None or getattr(sp.full, "main_grad", None) is not None


def full_grad_nbytes(sp: ShardedParam) -> int:
    return sum(sp.numel * g.element_size() for g in (sp.full.grad,
                                                     getattr(sp.full, "main_grad", None))
               if g is not None)


def release_full_grad(sp: ShardedParam) -> None:
    """Drop the full-size grad (the hook makes a new ``main_grad`` at the next grad)."""
    sp.full.clear_gradient(False)
    if getattr(sp.full, "main_grad", None) is not None:
        sp.full.main_grad = None
