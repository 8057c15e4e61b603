"""A buffer's shard grads: one flat storage every shard param's ``.grad`` (or, under
Paddle's ``MixPrecisionLayer``, its float32 ``main_grad``) is a view of, kept so when
user code or autograd replaces one, and what reduced grads accumulate in. It owns the
grad shard's state within the step (:class:`~..states.GradState`): the collectives
that fill it (:mod:`.inner_reduce`, :mod:`.outer_pieces`) move it through here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import paddle

from .. import master_grad
from ..param import ShardedParam
from ..registry import registry
from ..states import GradState, expect, move

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


class ShardGrads:
    """The shard grads of one :class:`~.shard_buffer.ShardBuffer`."""

    def __init__(self, buf: ShardBuffer):
        self.buf = buf
        self.flat: paddle.Tensor | None = None
        self.flat_main: paddle.Tensor | None = None  # MixPrecisionLayer's (views of it)
        # the registry.storage_epoch at which the grads / main grads were checked
        self._epoch = self._main_epoch = -1
        # id(ShardedParam) of shard grads to make views again, their value kept in the
        # flat storage (add_to_grad)
        self._repoint: set[int] = set()
        # the grad shard within the step; what it was before the reduce-scatter in
        # flight, for a backward that abandons it
        self.state = GradState.EMPTY
        self._before_reduce = GradState.EMPTY
        # with outer sub-shards: whether it holds only this rank's reduced piece (the
        # others zero), as the outer reduce-scatter leaves it
        self.scattered = False

    def describe(self) -> str:
        return self.buf.describe()

    # -------------------------------------------------------------- the state
    def move(self, to: GradState, call: str) -> None:
        move(self, "state", to, call)

    def begin_reduce(self) -> None:
        """An inner reduce-scatter into the grad shard was issued."""
        self._before_reduce = self.state
        self.move(GradState.REDUCING, "start_reduce_scatter")

    def end_reduce(self) -> None:
        """It landed (the caller adds its result): the shard holds summed grads again,
        whole (after a sync the unit brought it back to summed form first)."""
        self.scattered = False
        self.move(GradState.REDUCED, "finish_reduce_scatter")

    def mark_scattered(self, scattered: bool) -> None:
        """The outer reduce-scatter left only this rank's piece (True), or the other
        pieces were zeroed at ``clear_grad`` (False)."""
        self.scattered = scattered

    def abandon_reduce(self) -> None:
        """The reduce-scatter in flight was waited for without using it (a failed
        backward): the grad shard is as before it."""
        if self.state is GradState.REDUCING:
            self.move(self._before_reduce, "abandon_reduce")

    def reset(self, state: GradState) -> None:
        """Error paths and ``clear_grad``: the collectives in flight were waited for (or
        none was) and the grad shard is taken to be in ``state``."""
        self.move(state, "reset_grad_state")

    # -------------------------------------------------------------- storage
    def grad_flat(self) -> paddle.Tensor:
        """The flat grad storage, every shard param's ``.grad`` a view of it. Grads that
        were released (``clear_grad(set_to_zero=False)``) read as zeros; a grad the user
        replaced by another tensor is copied in."""
        buf = self.buf
        if buf.host is not None:
            buf.host.settle()  # grads still on their way back from the device
        if self.flat is None:
            self.flat = buf.storage.new(buf.dtype)
            self._epoch = -1
        flat = self.flat
        self.repoint_grads()
        if self._epoch != registry.storage_epoch:  # once per epoch, as the views
            self._epoch = registry.storage_epoch
            with buf.on_host():
                # released by clear_grad(set_to_zero=False), or never made: None
                self._attach_views(flat, lambda sp: sp.shard.grad,
                                   lambda sp, grad: False, ShardedParam.attach_grad)
        return flat

    def _attach_views(self, flat: paddle.Tensor,
                      held_of: Callable[[ShardedParam], paddle.Tensor | None],
                      released: Callable[[ShardedParam, paddle.Tensor], bool],
                      attach: Callable[[ShardedParam, paddle.Tensor], None]) -> None:
        """Make every shard's grad (or main grad: ``held_of`` reads it, ``attach`` sets
        it) a view of its piece of ``flat`` again: a released one reads as zeros (and
        resets the param's grad flags), one the user replaced is copied in."""
        for sp in self.buf.params:
            held = held_of(sp)
            if held is None or released(sp, held):  # released, or never made
                sp.grad_here = sp.grad_anywhere = False
                if sp.sub_numel:  # (a 0-row shard has no piece to zero)
                    piece = sp.piece_of(flat)
                    paddle.assign(paddle.zeros_like(piece), output=piece)
            elif not sp.views(held, flat):
                if held.dtype != flat.dtype:
                    held = held.astype(flat.dtype)
                paddle.assign(held.reshape([-1]), output=sp.piece_of(flat))
            else:
                continue
            attach(sp, flat)

    @property
    def main_grads(self) -> bool:
        """Whether Paddle's MixPrecisionLayer covers this buffer (asked afresh each time:
        the wrapper may come after fully_shard)."""
        buf = self.buf
        return buf.trainable and master_grad.uses_main_grad(buf.params, buf.describe)

    def main_grad_flat(self) -> paddle.Tensor:
        """The float32 flat main-grad storage, every shard's ``main_grad`` a view of it.
        A ``main_grad`` that ``MixPrecisionOptimizer.clear_grad(set_to_zero=False)``
        released reads as zeros; one the user replaced is copied in."""
        buf = self.buf
        if buf.host is not None:
            buf.host.settle()
        if self.flat_main is None:
            self.flat_main = buf.storage.new(master_grad.MAIN_GRAD_DTYPE)
            self._main_epoch = -1
        flat = self.flat_main
        if self._main_epoch != registry.storage_epoch:
            self._main_epoch = registry.storage_epoch
            with buf.on_host():
                # released (MixPrecisionOptimizer clears its storage, or sets None), or
                # never made; a 0-row main grad holds no storage: it is released when
                # None, as on the ranks holding rows, so every rank resets the flags alike
                self._attach_views(
                    flat, lambda sp: getattr(sp.shard, "main_grad", None),
                    lambda sp, main: bool(sp.sub_numel) and not main._is_initialized(),
                    ShardedParam.attach_main_grad)
        return flat

    def acc_flat(self) -> paddle.Tensor:
        """Where reduced grads accumulate: the main grads under MixPrecisionLayer, else
        the shard grads."""
        return self.main_grad_flat() if self.main_grads else self.grad_flat()

    def add_to_grad(self, sp: ShardedParam, grad: paddle.Tensor) -> None:
        """Add ``grad`` (in ``sp``'s shard shape) to ``sp``'s piece of the storage grads
        accumulate in (:meth:`acc_flat`). Autograd then adds zeros to the shard's grad,
        or after ``clear_grad()`` replaces it by them (Paddle marks a zeroed grad "fake
        empty"): the next :meth:`grad_flat` makes it a view again, no copy."""
        expect(self.state, (GradState.EMPTY, GradState.REDUCED), "add_to_grad",
               self.describe)
        acc = self.acc_flat()
        piece = sp.piece_of(acc)
        grad = grad.reshape([-1])
        if grad.dtype != acc.dtype:
            grad = grad.astype(acc.dtype)
        if self.buf.host is not None:
            self.buf.host.download(grad, into=piece, add=True)
        else:
            piece.add_(grad)
        self._repoint.add(id(sp))
        self.move(GradState.REDUCED, "add_to_grad")

    def repoint_grads(self) -> None:
        """Shard grads that autograd replaced by zeros after :meth:`add_to_grad` become
        views of the flat grad storage again (which holds their value)."""
        if not self._repoint:
            return
        for sp in self.buf.params:
            if id(sp) not in self._repoint:
                continue
            if self.flat is not None:
                sp.attach_grad(self.flat)
            else:  # main grads hold it (MixPrecisionLayer): no .grad, as unsharded
                sp.shard.clear_gradient(False)
        self._repoint.clear()

    def reduce_dtype(self) -> paddle.dtype:
        """The dtype grads travel in: main grads in float32 unless the policy names a
        ``reduce_dtype``, other grads in ``reduce_dtype``."""
        dtypes = self.buf.dtypes
        if dtypes.policy_reduce is None and self.main_grads:
            return master_grad.MAIN_GRAD_DTYPE
        return dtypes.reduce

    def scale(self, scale: float) -> None:
        """Scale the grad shard (or main grads) in place, without a collective."""
        flat = self.acc_flat()
        with self.buf.on_host():
            flat.scale_(scale)

    def relay(self, fulls: list[paddle.Tensor]) -> None:
        """The buffer was laid out anew (:meth:`ShardBuffer.relayout`): the grad storage
        again, from each parameter's full grad, this rank's rows of it (its piece only
        with outer sub-shards, as the outer reduce-scatter leaves it), every shard's
        ``.grad`` a view of it. Not under MixPrecisionLayer's main grads (refused
        before)."""
        buf = self.buf
        flat = paddle.zeros([buf.shard_numel], buf.dtype)
        for sp, full in zip(buf.params, fulls, strict=True):
            sp.cut_into(full, flat, sub=True)
        self.flat = flat
        self._epoch = registry.storage_epoch
        self._repoint.clear()
        for sp in buf.params:
            sp.attach_grad(flat)
        self.scattered = buf.parts > 1

    def flats(self) -> list[paddle.Tensor]:
        """The grad storages that exist (grads, main grads)."""
        return [f for f in (self.flat, self.flat_main) if f is not None]
