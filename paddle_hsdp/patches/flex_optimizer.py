"""``paddle.optimizer.AdamW.sharded_state_dict``, for optimizers over HSDP shards.

PaddleFormers' trainer saves through ``optimizer.sharded_state_dict(model_sd)``; Paddle's
own would describe each shard as a whole tensor. The patched method gives
:func:`paddle_hsdp.engine.flex.optimizer_sharded_state_dict` (rows at their global
offsets) when the optimizer holds HSDP shards; every other optimizer keeps Paddle's.
"""

from __future__ import annotations

import paddle

from ..engine.flex import optimizer_sharded_state_dict
from ..engine.optimizers import optimizer_params
from ..engine.registry import managed_param
from .patching import replace


def install() -> None:
    """``optimizer.sharded_state_dict(model_sd)`` (what PaddleFormers' trainer calls)
    gives :func:`~paddle_hsdp.engine.flex.optimizer_sharded_state_dict` for an optimizer
    over HSDP shards; other optimizers keep Paddle's own."""
    original = paddle.optimizer.AdamW.sharded_state_dict
    if getattr(original, "_hsdp", False):
        return

    def sharded_state_dict(self: paddle.optimizer.AdamW, model_sharded_state_dict: dict,
                           ) -> dict:
        if any(managed_param(p) is not None for p in optimizer_params(self)):
            return optimizer_sharded_state_dict(self, model_sharded_state_dict)
        return original(self, model_sharded_state_dict)

    vars(sharded_state_dict)["_hsdp"] = True  # the mark install() looks for (setattr's)
    sharded_state_dict.__doc__ = original.__doc__
    replace(paddle.optimizer.AdamW, "sharded_state_dict", sharded_state_dict,
            "shards as rows at their global offsets for flex_checkpoint")
