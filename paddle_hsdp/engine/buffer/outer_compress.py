"""The compressed outer sync (``MixedPrecisionPolicy(outer_compress="int8")``, or
``"fp8"``): the grad shard crosses the outer group as blockwise int8 (float8 e4m3)
codes and float32 scales (:mod:`paddle_hsdp.comm.quantize`) instead of an all-reduce in
``reduce_dtype``.

An int8 sum cannot be reduced in int8, and gloo has no all-to-all or reduce-scatter,
so each rank quantises its whole grad shard, one all-gather gives every rank every
replica's message, and each rank dequantises and adds them in rank order in float32:
every replica gets the same bits. With outer sub-shards (HFSDP) each rank adds only
its own piece. Per rank that sends ``(O - 1) (n + 4 n / B)`` bytes for an ``n``-value
shard in blocks of ``B``, where the float32 ring all-reduce sends ``2 (O - 1) / O 4 n``:
a quarter of it at ``O = 2`` (plus the scales), as much at ``O = 8``
(docs/across-machines.md, "Compressed outer all-reduce").

**Error feedback.** What this rank's quantisation lost (``x - dequantised(x)``, float32,
one value per shard element) is added to its next sync's grads before quantising, so
the error does not accumulate: over any number of steps the sum of what was sent
differs from the sum of the true grads by one step's residual. The residual is this
rank's own (its data's), kept beside the grad shard in :class:`OuterPieces`, and
committed only when the sync lands: a sync that is abandoned (a failed backward)
leaves it as it was, and the grads are sent again. Checkpoints do not hold it: a
loaded run starts from a zero residual (the first step after a load sends its grads
without the last residual: one step's rounding, at most ``scale / 2`` per value); so
does a buffer laid out anew (``ShardBuffer.relayout``: a whole-matrix optimizer's first
step), whose residual would sit at the old positions.

Accumulation: grads accumulate unquantised in the grad shard; only the step's sync
quantises. A sync undone (``unsync``: more grads after an early sync) brings the
summed, dequantised grads back, and the next sync quantises them again with the
residual of the first: the running sum stays exact up to one residual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import paddle

from ...comm import collectives as comm
from ...comm import quantize

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer

logger = logging.getLogger("paddle_hsdp")
_warned_degrees: set[int] = set()  # outer degrees the costly-compression warning named


def bytes_against_float32(outer: int, block: int) -> float:
    """What the compressed sync sends per rank over what a float32 ring all-reduce
    would: ``(O - 1)(1 + 4 / B)`` bytes a value against ``8 (O - 1) / O``."""
    return outer * (1 + 4 / block) / 8


def _warn_if_costlier(outer: int, block: int, kind: str) -> None:
    """Once per outer degree and process: an all-gather of every replica's message grows
    with the replicas, so from about 8 of them it sends more than float32 would (a
    fault-tolerant job's live outer group may grow there after fully_shard)."""
    ratio = bytes_against_float32(outer, block)
    if ratio >= 1 and outer not in _warned_degrees:
        _warned_degrees.add(outer)
        logger.warning(
            "paddle_hsdp: outer_compress=%r over %d replicas sends %.2fx the bytes of a "
            "float32 outer all-reduce (each rank gathers every replica's message); below "
            "about 8 replicas it sends less. Drop outer_compress (or use reduce_dtype="
            "'bfloat16') at this outer degree.", kind, outer, ratio)



def counted_as(kind: str) -> str:
    """The comm counter's op for the compressed sync: ``all_reduce_int8`` / ``_fp8``."""
    return f"all_reduce_{kind}"


@dataclass
class PendingCompressed:
    handle: comm.Handle
    message: paddle.Tensor  # this rank's packed codes and scales (kept until the wait)
    gathered: paddle.Tensor  # every rank's message, rank order
    residual: paddle.Tensor  # this sync's quantisation error, committed at the landing
    numel: int  # values sent (the grad shard's)
    out: paddle.Tensor  # the grad shard it lands in
    scatter: bool  # HFSDP: only this rank's piece lands
    kind: str  # the codes: "int8" or "fp8"


def start(buf: ShardBuffer, values: paddle.Tensor, flat: paddle.Tensor, scatter: bool,
          async_op: bool, on_thread: bool) -> PendingCompressed:
    """Quantise ``values`` (the grad shard, or its device copy) plus the residual and
    issue the all-gather of the message over the outer group."""
    block, kind = buf.pieces.compress_block, buf.pieces.compress
    if kind is None:
        raise AssertionError(f"{buf.describe()}: a compressed outer sync without outer_compress")
    _warn_if_costlier(buf.outer.nranks, block, kind)
    numel = comm.numel_of(values)
    padded = quantize.padded_numel(numel, block)
    x = values.reshape([-1]).astype("float32")
    if padded > numel:
        x = paddle.concat([x, paddle.zeros([padded - numel], dtype="float32")])
    residual = buf.pieces.residual
    if residual is not None:
        x = x + residual
    codes, scales = quantize.quantize(x, block, kind)
    new_residual = x - quantize.dequantize(codes, scales, block, kind)
    message = quantize.pack(codes, scales)
    gathered = paddle.empty([buf.outer.nranks * comm.numel_of(message)], dtype="int8")
    handle = comm.all_gather_into(gathered, message, buf.outer, async_op=True,
                                  what=buf.describe, counted_as=counted_as(kind),
                                  on_thread=on_thread)
    if not async_op:
        handle.wait()
    return PendingCompressed(handle, message, gathered, new_residual, numel, flat, scatter,
                             kind)


def finish(buf: ShardBuffer, pending: PendingCompressed, lo: int = 0,
           hi: int | None = None) -> paddle.Tensor:
    """Wait, commit the residual and return the float32 sum of every replica's values
    ``[lo, hi)`` (default: all)."""
    pending.handle.wait()
    buf.pieces.residual = pending.residual
    padded = comm.numel_of(pending.residual)
    return quantize.sum_of_messages(pending.gathered, buf.outer.nranks, padded,
                                    buf.pieces.compress_block, lo,
                                    pending.numel if hi is None else hi, pending.kind)
