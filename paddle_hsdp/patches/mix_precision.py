"""Paddle's master-grad optimizer wrapper over HSDP shards.

``MixPrecisionOptimizer`` (``paddle.distributed.fleet.utils.mix_precision_utils``) steps
through ``_inner_opt._apply_optimize``, which :mod:`.optim` already hooks, on the
shards' ``main_grad`` that the engine fills (:mod:`paddle_hsdp.engine.master_grad`).
Its ``clear_grad`` zeroes or releases ``main_grad`` without calling the inner
optimizer's ``clear_grad``, so it would skip what :mod:`.optim`'s ``clear_grad`` patch
does: drop full-size grads a deferred reduce-scatter still holds and end the step's
sync state. :func:`install` adds that.
"""

from __future__ import annotations

import functools
from typing import Any

from paddle.distributed.fleet.utils import mix_precision_utils

from ..engine.optimizers import sharded_params_of, units_of_shards
from .patching import replace

_installed = False


def _patch_clear_grad() -> None:
    cls = mix_precision_utils.MixPrecisionOptimizer
    original = cls.clear_grad

    @functools.wraps(original)
    def clear_grad(self: mix_precision_utils.MixPrecisionOptimizer, *args: Any,
                   **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for unit in units_of_shards(sharded_params_of(self)):
            unit.drop_pending_grads()
        return result

    replace(cls, "clear_grad", clear_grad,
            "also drop full-size grads a deferred reduce-scatter still holds")


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_clear_grad()
    _installed = True
