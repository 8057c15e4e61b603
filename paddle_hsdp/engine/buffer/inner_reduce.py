"""A buffer's inner reduce-scatter: its full grads, summed over the inner group, each
rank keeping the rows of its shard and adding them to its grad shard. Functions of
the buffer: what is in flight is the caller's :class:`~..pending.PendingReduce`, and
the grad shard's state is :class:`~.shard_grads.ShardGrads`'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle

from ...comm import collectives as comm
from .. import master_grad, trace
from ..context import context
from ..pending import PendingReduce, give_back, release_staging
from ..states import GradState, expect

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


def start(buf: ShardBuffer, async_op: bool = False) -> PendingReduce:
    """Issue the inner reduce-scatter of the full grads and release them.

    The input is the full grads in the full buffer's layout, zeros in its gaps: the
    grad grid autograd accumulated them in (:mod:`.full_grads`), else one concatenation
    of them, so the full grads can be freed as soon as it is issued. A parameter with
    no grad on this rank (unused) contributes zeros: every rank joins the collective
    whatever its data did. :func:`finish` waits and accumulates."""
    # synced grads go back to summed form first (the unit)
    expect(buf.grads.state, (GradState.EMPTY, GradState.REDUCED), "start_reduce_scatter",
           buf.describe)
    trace.record("ready", "reduce_scatter", buf.unit_index)  # full grads complete
    dtype = buf.grads.reduce_dtype()
    staged: list[paddle.Tensor] = []
    try:
        taken = buf.full_grads.take_grid()
        if taken is not None:  # the grads are in the reduce input already
            grid, present = taken
            staged.append(grid)
        else:
            pieces, present = _full_grad_pieces(buf, dtype)
            # one param filling the buffer: its own grad storage is the input
            # (released, kept alive here); more: one concatenation into a staging tensor
            grid = _reduce_input(buf, pieces, dtype, staged) if len(pieces) > 1 \
                else pieces[0]
            del pieces  # the full grads' storage goes now, before the collective runs
        if buf.host is None:
            out = context.staging.take(buf.shard_numel, dtype)
            staged.append(out)
        else:
            out = paddle.empty([buf.shard_numel], dtype=dtype)
        trace.record("issue", "reduce_scatter", buf.unit_index)
        handle = comm.reduce_scatter(out, grid, buf.reduce_group, async_op=True,
                                     what=buf.describe)
    except BaseException:
        give_back(staged)  # nothing was issued (or the issue failed)
        raise
    buf.grads.begin_reduce()
    if not async_op:
        handle.wait()
    return PendingReduce(handle, grid, out, tuple(staged), tuple(present))


def _full_grad_pieces(buf: ShardBuffer, dtype: paddle.dtype
                      ) -> tuple[list[paddle.Tensor], list[bool]]:
    """The full grads as autograd made them (no grad grid), 1-D in the full buffer's
    order with zeros for its gaps, released as they are taken (the pieces keep their
    storage); and per param, whether it had one on this rank (in the params' order).
    The layout's order is the offsets' (owned parameters come after the free ones:
    [Note: owned parameters] in engine/layout.py)."""
    pieces: list[paddle.Tensor] = []
    had: dict[int, bool] = {}
    pos = 0
    for sp in sorted(buf.params, key=lambda sp: sp.slot.full_offset):
        if sp.slot.full_offset > pos:
            pieces.append(paddle.zeros([sp.slot.full_offset - pos], dtype))
        g = master_grad.full_grad(sp)  # .grad, or the hook's main_grad (see there)
        had[id(sp)] = g is not None
        if g is None:  # unused on this rank: zeros, so every rank joins the call
            g = paddle.zeros([sp.numel], dtype)
        elif g.dtype != dtype:
            g = g.astype(dtype)
        if sp.numel:
            pieces.append(g.reshape([-1]))  # a view: the storage outlives the release
        if had[id(sp)]:
            master_grad.release_full_grad(sp)
        pos = sp.slot.full_offset + sp.numel
    if pos < buf.padded_numel:
        pieces.append(paddle.zeros([buf.padded_numel - pos], dtype))
    return pieces, [had[id(sp)] for sp in buf.params]


def _reduce_input(buf: ShardBuffer, pieces: list[paddle.Tensor], dtype: paddle.dtype,
                  staged: list[paddle.Tensor]) -> paddle.Tensor:
    """The ``[I * S]`` reduce-scatter input: ``pieces`` concatenated into a staging
    tensor (every buffer of one shape shares the pool's)."""
    if buf.host is not None:
        return paddle.concat(pieces)
    grid = context.staging.take(buf.padded_numel, dtype)
    staged.append(grid)
    return paddle.concat(pieces, out=grid)


def finish(buf: ShardBuffer, pending: PendingReduce) -> None:
    """Wait for :func:`start`; add the result to the grad shard (one op, in the master
    dtype), or to the main grads under MixPrecisionLayer."""
    expect(buf.grads.state, (GradState.REDUCING,), "finish_reduce_scatter", buf.describe)
    pending.handle.wait()
    trace.record("wait", "reduce_scatter", buf.unit_index)
    acc = buf.grads.acc_flat()  # (a released grad's flags reset here, before the new ones)
    for sp, had in zip(buf.params, pending.present, strict=True):
        sp.grad_here = sp.grad_here or had
    buf.grads.end_reduce()
    out = pending.out
    if buf.host is not None:  # added on the host once the copy is in
        buf.host.download(out, into=acc, add=True)
        release_staging(pending)  # the grid (the download reads out, not pooled)
        return
    if out.dtype != acc.dtype:
        out = out.astype(acc.dtype)
    acc.add_(out)
    release_staging(pending)  # the add is issued: grid and out serve the next call
