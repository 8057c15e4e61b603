"""A buffer's shard grads: one flat storage every shard param's ``.grad`` (or, under
Paddle's ``MixPrecisionLayer``, its float32 ``main_grad``) is a view of, kept so when
user code or autograd replaces one, and what reduced grads accumulate in.
:class:`ShardGrads` is a part of :class:`~paddle_hsdp.engine.buffer.ShardBuffer` (a
mixin: the buffer's storage, params and dtypes are its own)."""

from __future__ import annotations

import paddle

from . import master_grad
from .param import ShardedParam
from .registry import registry
from .states import GradState, expect, move


class ShardGrads:
    """The shard grads of a :class:`ShardBuffer`."""

    def grad_flat(self) -> paddle.Tensor:
        """The flat grad storage, every shard param's ``.grad`` a view of it. Grads that
        were released (``clear_grad(set_to_zero=False)``) read as zeros; a grad the user
        replaced by another tensor is copied in."""
        if self.host is not None:
            self.host.settle()  # grads still on their way back from the device
        if self.flat_grad is None:
            self.flat_grad = self._new_storage(self.dtype)
            self._grads_epoch = -1
        self.repoint_grads()
        if self._grads_epoch != registry.storage_epoch:  # once per epoch, as the views
            self._grads_epoch = registry.storage_epoch
            with self.on_host():
                self._attach_grads()
        return self.flat_grad

    def _attach_grads(self) -> None:
        # released by clear_grad(set_to_zero=False), or never made: None
        self._attach_views(self.flat_grad, lambda sp: sp.shard.grad,
                           lambda sp, grad: grad is None, ShardedParam.attach_grad)

    def _attach_views(self, flat, held_of, released, attach) -> None:
        """Make every shard's grad (or main grad: ``held_of`` reads it, ``attach`` sets
        it) a view of its piece of ``flat`` again: a released one reads as zeros (and
        resets the param's grad flags), one the user replaced is copied in."""
        for sp in self.params:
            held = held_of(sp)
            if released(sp, held):
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

    # -------------------------------------------------------------- main grads
    @property
    def main_grads(self) -> bool:
        """Whether Paddle's MixPrecisionLayer covers this buffer (asked afresh each time:
        the wrapper may come after fully_shard)."""
        return self.trainable and master_grad.uses_main_grad(self.params, self.describe)

    def main_grad_flat(self) -> paddle.Tensor:
        """The float32 flat main-grad storage, every shard's ``main_grad`` a view of it.
        A ``main_grad`` that ``MixPrecisionOptimizer.clear_grad(set_to_zero=False)``
        released reads as zeros; one the user replaced is copied in."""
        if self.host is not None:
            self.host.settle()
        if self.flat_main_grad is None:
            self.flat_main_grad = self._new_storage(master_grad.MAIN_GRAD_DTYPE)
            self._main_grads_epoch = -1
        if self._main_grads_epoch != registry.storage_epoch:
            self._main_grads_epoch = registry.storage_epoch
            with self.on_host():
                self._attach_main_grads()
        return self.flat_main_grad

    def _attach_main_grads(self) -> None:
        # released (MixPrecisionOptimizer clears its storage, or sets None), or never
        # made; a 0-row main grad holds no storage: it is released when None, as on the
        # ranks holding rows, so every rank resets the flags alike
        self._attach_views(
            self.flat_main_grad, lambda sp: getattr(sp.shard, "main_grad", None),
            lambda sp, main: main is None or (sp.sub_numel and not main._is_initialized()),
            ShardedParam.attach_main_grad)

    def add_to_grad(self, sp, grad) -> None:
        """Add ``grad`` (in ``sp``'s shard shape) to ``sp``'s piece of the storage grads
        accumulate in (:meth:`acc_flat`). Autograd then adds zeros to the shard's grad,
        or after ``clear_grad()`` replaces it by them (Paddle marks a zeroed grad
        "fake empty"): the next :meth:`grad_flat` makes it a view again, no copy."""
        expect(self.grad_state, (GradState.EMPTY, GradState.REDUCED), "add_to_grad",
               self.describe)
        acc = self.acc_flat()
        piece = sp.piece_of(acc)
        grad = grad.reshape([-1])
        if grad.dtype != acc.dtype:
            grad = grad.astype(acc.dtype)
        if self.host is not None:
            self.host.download(grad, into=piece, add=True)
        else:
            piece.add_(grad)
        self._repoint.add(id(sp))
        move(self, "grad_state", GradState.REDUCED, "add_to_grad")

    def repoint_grads(self) -> None:
        """Shard grads that autograd replaced by zeros after :meth:`add_to_grad` become
        views of the flat grad storage again (which holds their value)."""
        if self._repoint:
            for sp in self.params:
                if id(sp) in self._repoint:
                    sp.attach_grad(self.flat_grad)
            self._repoint.clear()

    def acc_flat(self) -> paddle.Tensor:
        """Where reduced grads accumulate: the main grads under MixPrecisionLayer, else
        the shard grads."""
        return self.main_grad_flat() if self.main_grads else self.grad_flat()

    def has_full_grads(self) -> bool:
        return any(master_grad.has_full_grad(sp) for sp in self.params)

    def grad_reduce_dtype(self):
        """The dtype grads travel in: main grads in float32 unless the policy names a
        ``reduce_dtype``, other grads in ``reduce_dtype``."""
        if self.policy_reduce_dtype is None and self.main_grads:
            return master_grad.MAIN_GRAD_DTYPE
        return self.reduce_dtype
