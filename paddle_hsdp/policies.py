"""Policies ``fully_shard`` takes, with torch FSDP2's names and fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """All-gather and compute in ``param_dtype``; reduce grads in ``reduce_dtype``
    (default: ``param_dtype``); cast the unit's outputs to ``output_dtype``; cast
    floating inputs to ``param_dtype`` when ``cast_forward_inputs``. Shards, their
    grads and the optimizer state stay in the parameters' dtype (float32 masters).

    On CPU Paddle has no bfloat16/float16 matmul: parameters gathered in those dtypes
    are computed in float32 there, with their low-precision rounding kept; the
    all-gather still moves ``param_dtype`` bytes. float16 reductions on gloo are staged
    in float32 by :mod:`paddle_hsdp.comm`.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


_warned_cpu_offload = False


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards, their grads and optimizer state in CPU memory and copy each unit to
    the device for compute.

    On a CPU-only Paddle build everything already lives in CPU memory: the policy is
    accepted and is a no-op (logged once). On a device build it is not implemented yet
    and raises, rather than silently keeping everything on the device.
    """

    pin_memory: bool = True

    def check_supported(self) -> None:
        global _warned_cpu_offload
        import paddle

        if paddle.get_device().startswith("cpu"):
            if not _warned_cpu_offload:
                logger.warning("CPUOffloadPolicy on a CPU-only run: everything is already "
                               "in CPU memory; the policy is a no-op.")
                _warned_cpu_offload = True
            return
        raise NotImplementedError(
            "CPUOffloadPolicy on a device build is not implemented yet: pass "
            "offload_policy=None (or OffloadPolicy()) to keep shards on the device.")
