"""Policies ``fully_shard`` takes, with torch FSDP2's names and fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import paddle

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
    in float32 by :mod:`paddle_hsdp.comm.collectives`.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True
    # paddle_hsdp's: the outer sync (the cross-machine bytes) as blockwise int8 or
    # float8 (e4m3) codes with error feedback, ``outer_compress_block`` values per
    # float32 scale (engine/buffer/outer_compress.py); None: in ``reduce_dtype``
    outer_compress: str | None = None
    outer_compress_block: int = 256

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_floating_dtype(getattr(self, field), field)
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError("MixedPrecisionPolicy(cast_forward_inputs=...) must be True or "
                            f"False, got {self.cast_forward_inputs!r}")
        if self.outer_compress not in OUTER_COMPRESS:
            raise ValueError("MixedPrecisionPolicy(outer_compress=...) must be one of "
                             f"{list(OUTER_COMPRESS)}, got {self.outer_compress!r}")
        block = self.outer_compress_block
        if isinstance(block, bool) or not isinstance(block, int) or block < MIN_BLOCK:
            raise ValueError("MixedPrecisionPolicy(outer_compress_block=...) must be an int "
                             f">= {MIN_BLOCK} (values per float32 scale), got {block!r}")


OUTER_COMPRESS = (None, "int8", "fp8")  # MixedPrecisionPolicy(outer_compress=...)
MIN_BLOCK = 8  # below it the scales outweigh the codes


@dataclass(frozen=True)
class OuterSyncPolicy:
    """How often the outer replicas synchronise (DiLoCo; docs/knobs.md, "Outer sync
    every H steps"). ``every=1`` (the default) is plain HSDP: the grads are averaged
    over the outer group at every step and the outer optimizer fields are unused.
    ``every=H >= 2``: each replica steps its own inner optimizer on grads averaged
    over its inner group only, and every H-th optimizer step the replicas average
    their pseudo-gradient (the params at the last sync minus the params now) and
    apply an outer SGD step, ``lr`` and ``momentum``, Nesterov when ``nesterov``
    (DiLoCo's defaults: 0.7, 0.9, True); every replica then holds the same params
    (engine/diloco.py). ``fragments=F`` (streaming DiLoCo): the units dealt into F
    fragments by size (``diloco.deal_fragments``: the largest first, each into the
    lightest fragment), fragment f synced at the steps where step % H is f H // F, so
    a sync moves about 1/F of the model (at least its largest unit)."""

    every: int = 1
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError("OuterSyncPolicy(every=...) must be an int >= 1 (optimizer "
                             f"steps between outer syncs; 1: plain HSDP), got {every!r}")
        for field, low, high in (("lr", 0.0, None), ("momentum", 0.0, 1.0)):
            value = getattr(self, field)
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad or not (value > low if field == "lr" else low <= value < high):
                allowed = "a number > 0" if field == "lr" else "a number in [0, 1)"
                raise ValueError(f"OuterSyncPolicy({field}=...) must be {allowed}, got "
                                 f"{value!r}")
        fragments = self.fragments
        if isinstance(fragments, bool) or not isinstance(fragments, int) or \
                not 1 <= fragments <= max(every, 1):
            raise ValueError("OuterSyncPolicy(fragments=...) must be an int from 1 to every "
                             f"({every}; fragments synced in turn, each every {every} steps; "
                             f"every >= 2 for more than 1), got {fragments!r}")
        if not isinstance(self.nesterov, bool):
            raise TypeError("OuterSyncPolicy(nesterov=...) must be True or False, got "
                            f"{self.nesterov!r}")

    @property
    def trains_apart(self) -> bool:
        """Whether the replicas step apart between outer syncs (``every >= 2``)."""
        return self.every > 1


OUTER_OPTIMIZER_FIELDS = ("lr", "momentum", "nesterov")  # fsdp_outer_optimizer's keys


def outer_sync_policy_from(every: object, optimizer: object,
                           fragments: object = 1) -> OuterSyncPolicy:
    """The policy that ``fsdp_outer_sync_every``, ``fsdp_outer_optimizer`` (None or a
    mapping of :data:`OUTER_OPTIMIZER_FIELDS`, each optional) and
    ``fsdp_outer_sync_fragments`` name, in a config file or fleet's
    ``sharding_configs`` (errors name neither: the caller says which)."""
    if optimizer is None:
        optimizer = {}
    if not isinstance(optimizer, dict):
        raise ValueError("must be null or a mapping with keys "
                         f"{', '.join(OUTER_OPTIMIZER_FIELDS)}, got {type(optimizer).__name__}")
    unknown = sorted(str(key) for key in optimizer if key not in OUTER_OPTIMIZER_FIELDS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; allowed: "
                         f"{', '.join(OUTER_OPTIMIZER_FIELDS)}")
    return OuterSyncPolicy(every, fragments=fragments,  # type: ignore[arg-type]
                           **optimizer)


FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_floating_dtype(value: object, field: str) -> None:
    """None, or a floating dtype given as a string or a paddle dtype."""
    if value is None:
        return
    name = value if isinstance(value, str) else None
    if isinstance(value, paddle.dtype):
        name = str(value).replace("paddle.", "")
    if name not in FLOATING_DTYPES:
        raise ValueError(f"MixedPrecisionPolicy({field}={value!r}): must be None or a "
                         f"floating dtype, one of {list(FLOATING_DTYPES)} (as a string or "
                         "paddle dtype)")


# Named in every refusal of a Paddle mixed-precision recipe that cannot be right on
# shards: the way to get low-precision compute with float32 grads under paddle_hsdp.
POLICY_HINT = ("For bf16 compute with float32 grads and optimizer state, keep the "
               "parameters float32 and pass fully_shard(..., mp_policy=paddle_hsdp."
               "MixedPrecisionPolicy(param_dtype='bfloat16', reduce_dtype='float32')).")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards, their grads and so the optimizer state in host memory; each unit's
    shard is copied to the device for the all-gather and compute, reduced grads are
    copied back, and the optimizer steps on the host (:mod:`paddle_hsdp.engine.offload`).
    ``pin_memory``: grads come back through pinned staging memory, without blocking.

    On a CPU-only run everything already lives in host memory: the policy is accepted
    and is a no-op (logged once).
    """

    pin_memory: bool = True
    offloads_to_host = True  # class attribute, not a field

    @property
    def offloads(self) -> bool:
        """Whether there is a device to offload from (False on CPU-only runs)."""
        from . import offload  # noqa: PLC0415  (policies sits below the engine's modules)
        return offload.enabled(self)

    def check_supported(self) -> None:
        from .context import context  # noqa: PLC0415  (as offload above)
        if not self.offloads and not context.warned_cpu_offload:
            logger.warning("CPUOffloadPolicy on a CPU-only run: everything is already in "
                           "CPU memory; the policy is a no-op.")
            context.warned_cpu_offload = True
