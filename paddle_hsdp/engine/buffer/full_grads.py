"""A buffer's full-size grads written in place into its reduce-scatter input, and
which of them this backward completed (its early reduction).

At a unit's pre-backward each trainable buffer takes a zeroed ``[I * S]`` tensor from
the staging pool (the *grad grid*) and makes every full parameter's ``.grad`` a view of
its place in it, in the full buffer's layout. Paddle 3.3 adds a new grad into an
existing ``.grad`` in place (the storage is kept; checked for float32, float64 and
bfloat16), so when the unit's backward ends the grid *is* the reduce-scatter's input:
no full grad of its own per parameter, no concatenation, no second layer-size tensor.

Whether a parameter got a grad this backward can no longer be read from ``.grad is
None``: :func:`~paddle_hsdp.engine.grad_hooks._on_grad_accumulated` (Paddle's
post-accumulation hook) records each arrival. A grad that is no longer a view of the
grid when the reduction starts (user code replaced or released it, or Paddle replaced
a grad marked "fake empty" by ``clear_gradient(set_to_zero=True)`` before sharding) is
copied in or zeroed there, so the reduction never misses one.

A buffer keeps the earlier path (grads as autograd makes them, concatenated at the
reduction) when the grid cannot hold its grads as they are: offloaded shards, Paddle's
``MixPrecisionLayer`` (grads move into ``main_grad``), a ``reduce_dtype`` other than
the compute dtype, or full grads already present when the backward starts (made
without a grid and kept, e.g. by micro-steps without a sync). A tied parameter gets
its grid too: Paddle accumulates a leaf's grad once, when the grads of all its uses
are in, which is after its own unit's pre-backward.

A unit whose post-backward does not fire reduces a buffer as soon as every parameter
of it has this backward's grad (:class:`~..states.EarlyReduce`: collecting, then
reduced early, until the backward ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle

from .. import master_grad
from ..context import context
from ..param import ShardedParam
from ..states import EarlyReduce, move

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


class FullGrads:
    """The full grads of one :class:`~.shard_buffer.ShardBuffer`, in its grad grid when
    it has one."""

    def __init__(self, buf: ShardBuffer):
        self.buf = buf
        self.grid: paddle.Tensor | None = None
        self._arrived: set[int] = set()  # id(ShardedParam) whose grad reached the grid
        # this backward: the params whose grad is complete (by id), and whether the
        # buffer was reduced before the end of backward
        self._ready: set[int] = set()
        self.early = EarlyReduce.COLLECTING

    def describe(self) -> str:
        return self.buf.describe()

    def in_place(self) -> bool:
        """Whether this buffer's full grads can be the reduce input as autograd adds
        them (see the module docstring)."""
        buf = self.buf
        return (buf.trainable and buf.host is None and not buf.grads.main_grads
                and buf.dtypes.compute == buf.grads.reduce_dtype())

    def attach_grid(self) -> None:
        """Before the unit's backward (its parameters gathered): a zeroed grid from the
        pool, every full parameter's ``.grad`` a view of its place in it. A buffer that
        holds one already (micro-steps without a sync accumulate in it) keeps it."""
        if self.grid is not None or not self.in_place() or self.present():
            return
        buf = self.buf
        grid = context.staging.take(buf.padded_numel, buf.dtypes.compute)
        grid.zero_()  # gaps, padding and parameters no grad reaches stay zero
        for sp in buf.params:
            if sp.numel:
                sp.attach_full_grad(grid)  # shares, no copy
        self.grid = grid
        self._arrived.clear()
        context.staging.grad_bytes += self._grid_nbytes()

    def note_arrived(self, sp: ShardedParam) -> None:
        """Paddle's post-accumulation hook of ``sp``'s full parameter fired."""
        if self.grid is not None:
            self._arrived.add(id(sp))

    def take_grid(self) -> tuple[paddle.Tensor, list[bool]] | None:
        """The grid as the reduce-scatter's input (the caller gives it back to the pool
        after the wait), and per parameter whether this rank had a grad for it; the
        full grads (views) are released. None without a grid."""
        grid = self.grid
        if grid is None:
            return None
        self.grid = None
        context.staging.grad_bytes -= self._grid_nbytes()  # the reduce input in flight now
        present = []
        for sp in self.buf.params:
            grad = sp.full.grad
            if not sp.numel:
                present.append(False)
            elif grad is None:  # released since it was attached: no grad this backward
                sp.full_of(grid).zero_()
                present.append(False)
            elif not sp.full_grad_is_view_of(grid):  # replaced: copied in
                paddle.assign(grad.astype(grid.dtype), output=sp.full_of(grid))
                present.append(True)
            else:
                present.append(id(sp) in self._arrived)
            master_grad.release_full_grad(sp)
        self._arrived.clear()
        return grid, present

    def drop_grid(self) -> None:
        """Forget the grads in the grid (a failed backward, ``clear_grad`` with grads
        pending): release the views and give the grid back to the pool."""
        grid = self.grid
        if grid is None:
            return
        for sp in self.buf.params:
            master_grad.release_full_grad(sp)
        self.grid = None
        self._arrived.clear()
        context.staging.grad_bytes -= self._grid_nbytes()
        context.staging.give(grid)

    def _grid_nbytes(self) -> int:
        return self.buf.padded_numel * self.buf.dtypes.compute_size

    def nbytes(self) -> int:
        """Full-size grad bytes held: the grid while it holds them (the staging pool's
        figures leave it out meanwhile), else the grads autograd made."""
        if self.grid is not None:
            return self._grid_nbytes()
        return sum(master_grad.full_grad_nbytes(sp) for sp in self.buf.params)

    def present(self) -> bool:
        """Whether any parameter holds a full-size grad."""
        return any(master_grad.has_full_grad(sp) for sp in self.buf.params)

    # -------------------------------------------------------------- early reduction
    def complete(self, sp: ShardedParam) -> bool:
        """``sp``'s grad for this backward is complete: whether every parameter's is."""
        self._ready.add(id(sp))
        return len(self._ready) >= len(self.buf.params)

    @property
    def reduced_early(self) -> bool:
        return self.early is EarlyReduce.REDUCED

    def mark_reduced_early(self) -> None:
        move(self, "early", EarlyReduce.REDUCED, "reduce_buffer_early")

    def end_backward(self) -> None:
        """The backward ended (or failed): collect again from none."""
        self._ready.clear()
        move(self, "early", EarlyReduce.COLLECTING, "end_backward")
