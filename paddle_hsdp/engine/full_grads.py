"""A buffer's full-size grads written in place into its reduce-scatter input.

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
:class:`FullGrads` is a part of :class:`~paddle_hsdp.engine.buffer.ShardBuffer` (a
mixin: the buffer's params, layout and dtypes are its own).
"""

from __future__ import annotations

import paddle

from . import master_grad, staging


class FullGrads:
    """The full grads of a :class:`ShardBuffer`, in its grad grid when it has one."""

    grad_grid: paddle.Tensor | None = None
    _arrived: set | None = None  # id(ShardedParam) whose grad reached the grid

    def grads_in_place(self) -> bool:
        """Whether this buffer's full grads can be the reduce input as autograd adds
        them (see the module docstring)."""
        return (self.trainable and self.host is None and not self.main_grads
                and self.compute_dtype == self.grad_reduce_dtype())

    def attach_grad_grid(self) -> None:
        """Before the unit's backward (its parameters gathered): a zeroed grid from the
        pool, every full parameter's ``.grad`` a view of its place in it. A buffer
        that holds one already (micro-steps without a sync accumulate in it) keeps it."""
        if self.grad_grid is not None or not self.grads_in_place() or self.has_full_grads():
            return
        grid = staging.pool.take(self.padded_numel, self.compute_dtype)
        grid.zero_()  # gaps, padding and parameters no grad reaches stay zero
        for sp in self.params:
            if sp.numel:
                sp.attach_full_grad(grid)  # shares, no copy
        self.grad_grid, self._arrived = grid, set()
        staging.pool.grad_bytes += self._grid_nbytes()

    def note_grad_arrived(self, sp) -> None:
        """Paddle's post-accumulation hook of ``sp``'s full parameter fired."""
        if self._arrived is not None:
            self._arrived.add(id(sp))

    def take_grad_grid(self) -> tuple[paddle.Tensor, list[bool]]:
        """The grid as the reduce-scatter's input (the caller gives it back to the pool
        after the wait), and per parameter whether this rank had a grad for it; the
        full grads (views) are released."""
        grid, arrived = self.grad_grid, self._arrived
        self.grad_grid = self._arrived = None
        staging.pool.grad_bytes -= self._grid_nbytes()  # the reduce input in flight now
        present = []
        for sp in self.params:
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
                present.append(id(sp) in arrived)
            master_grad.release_full_grad(sp)
        return grid, present

    def drop_grad_grid(self) -> None:
        """Forget the grads in the grid (a failed backward, ``clear_grad`` with grads
        pending): release the views and give the grid back to the pool."""
        if self.grad_grid is None:
            return
        for sp in self.params:
            master_grad.release_full_grad(sp)
        grid, self.grad_grid, self._arrived = self.grad_grid, None, None
        staging.pool.grad_bytes -= self._grid_nbytes()
        staging.pool.give(grid)

    def _grid_nbytes(self) -> int:
        return self.padded_numel * self.compute_element_size

    def full_grad_nbytes(self) -> int:
        """Full-size grad bytes held: the grid while it holds them (the staging pool's
        figures leave it out meanwhile), else the grads autograd made."""
        if self.grad_grid is not None:
            return self._grid_nbytes()
        return sum(master_grad.full_grad_nbytes(sp) for sp in self.params)
