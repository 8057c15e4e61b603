"""A buffer's inner all-gather: its flat shard (or grad shard) from every inner rank
into one full flat buffer, each full parameter a view of it. Functions of the buffer:
what is in flight is the caller's :class:`~..pending.PendingGather`, nothing here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle
from paddle import _C_ops

from ...comm import collectives as comm
from ...comm import gather_tags
from .. import trace
from ..context import context
from ..pending import PendingGather, give_back, release_staging
from ..registry import registry

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


def gather_full(buf: ShardBuffer, grads: bool = False,
                compute: bool = False) -> list[paddle.Tensor]:
    """All-gather in the inner group and wait; return each parameter's full tensor
    (see :func:`start`)."""
    registry.storage_may_have_changed()  # off the hot path: user code ran before
    return finish(buf, start(buf, grads, compute))


def start(buf: ShardBuffer, grads: bool = False, compute: bool = False,
          async_op: bool = False) -> PendingGather:
    """Issue the all-gather of this rank's shard (or, with ``grads=True``, of its grad
    shard as it is now) into a new full flat buffer. ``compute=True``: gather in the
    policy's ``param_dtype``. With ``async_op`` it returns at once on NCCL (the
    collective runs on the communication stream); :func:`finish` waits.

    The flat shard is sent as it is (cast once when the gather dtype differs). A short
    tag travels beside it in a second, tiny all-gather (see
    :mod:`paddle_hsdp.comm.gather_tags`): ranks that pair up different all-gathers raise
    instead of computing on each other's rows. It cannot ride in the shard's own slots
    as it once did: a parameter that straddles two ranks' segments must be contiguous
    in the output.

    The output is not from the staging pool: the full parameters are views of it for as
    long as the unit is unsharded, and a view autograd saved may outlive the reshard, so
    the storage must not serve another unit's gather meanwhile."""
    purpose = "grads" if grads else ("compute" if compute else "params")
    staged: list[paddle.Tensor] = []  # from the staging pool, given back after the wait
    if grads:
        send = buf.grads.acc_flat()  # float32 main grads travel as they are
        if buf.grads.scattered:  # each outer rank holds its reduced piece only
            send = buf.pieces.outer_gather(send, what="the synced grad pieces")
        base = send.dtype
    else:
        buf.pieces.ensure_rebuilt()
        buf.storage.repair_views()
        send, base = buf.storage.raw, buf.dtype
    dtype = buf.dtypes.gather if compute else base
    tag = tags = tag_handle = None
    try:
        if send.dtype != dtype:
            send = _cast_for_sending(buf, send, dtype, staged)
        if buf.host is not None:
            send = buf.host.upload(send)  # a device copy; the host shard stays as is
        if gather_tags.can_tag(base) and gather_tags.can_tag(dtype):
            # a view of a table already in this dtype on this place: no copy per call
            tag = gather_tags.make_tag(buf.inner, buf.unit_index, buf.index, purpose,
                                       buf.describe, dtype, send.place)
            tags = context.staging.take(buf.inner_size * gather_tags.TAG_NUMEL, dtype)
            staged.append(tags)
            tag_handle = comm.all_gather_into(tags, tag, buf.inner, async_op=True,
                                              what=buf.describe, counted_as="all_gather_tags")
        out = paddle.empty([buf.padded_numel], dtype=dtype)
        trace.record("issue", "all_gather", buf.unit_index)
        handle = comm.all_gather_into(out, send, buf.inner, async_op=True, what=buf.describe)
    except BaseException:
        if tag_handle is not None:
            comm.settle([tag_handle])
        give_back(staged)  # nothing was issued (or the issue failed): not in flight
        raise
    if not async_op:
        handle.wait()
    # send and out stay referenced until the wait: an async collective reads and
    # writes them on the communication stream.
    return PendingGather(handle, send, out, tag, compute, tuple(staged), tag_handle, tags)


def _cast_for_sending(buf: ShardBuffer, send: paddle.Tensor, dtype: paddle.dtype,
                      staged: list[paddle.Tensor]) -> paddle.Tensor:
    """``send`` in ``dtype``: cast into a staging tensor (Paddle 3.3's public cast has no
    output argument; ``_C_ops.cast`` does). Offloaded: cast on the host (fewer bytes to
    copy), into a new tensor the upload reads on its own terms."""
    if buf.host is not None:
        with buf.on_host():
            return send.astype(dtype)
    into = context.staging.take(comm.numel_of(send), dtype)
    staged.append(into)
    # (Paddle's stubs give _C_ops.cast no out argument; the op takes one)
    _C_ops.cast(send, dtype, out=into)  # type: ignore[call-overload,misc]
    return into


def finish(buf: ShardBuffer, pending: PendingGather) -> list[paddle.Tensor]:
    """Wait for :func:`start`, check the tags, and return each parameter's full tensor:
    a view of the gathered buffer (cast once when the compute dtype differs from the
    gather dtype)."""
    pending.handle.wait()
    trace.record("wait", "all_gather", buf.unit_index)
    if pending.tag_handle is not None and pending.tags is not None \
            and pending.tag is not None:
        pending.tag_handle.wait()
        tags = pending.tags.reshape([buf.inner_size, gather_tags.TAG_NUMEL])
        gather_tags.check(tags, pending.tag, buf.inner)  # same dtype and place
    out = pending.out
    if pending.compute and buf.dtypes.compute != out.dtype:
        out = out.astype(buf.dtypes.compute)
    # the tag check is issued: its tensors (and the send copy) can serve the next
    # collective (engine/staging.py says why that is safe on NCCL)
    release_staging(pending)
    return [sp.full_of(out) for sp in buf.params]
