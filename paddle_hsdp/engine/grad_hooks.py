"""Hooks on parameters' grads: the early reduction of a buffer whose every parameter
has this backward's grad (units whose post-backward does not fire), and grads that
reach a shard parameter itself (a penalty on ``model.parameters()``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle

from . import master_grad
from .context import context
from . import memory
from .param import ShardedParam
from .unit import FSDPUnit


class _GradHook:
    """A grad hook's callable, which :meth:`disarm` empties (``unit.hooks.remove()``,
    paddle_hsdp.forget). Paddle holds tensor hooks in C++, where Python's collector
    cannot see a cycle through them: a hook that kept its parameter (so its unit and
    model) would keep a forgotten model alive for good."""

    __slots__ = ("fn", "sp")

    def __init__(self, fn: Callable[..., Any], sp: ShardedParam):
        self.fn: Callable[..., Any] = fn
        self.sp: ShardedParam | None = sp

    def __call__(self, *args: Any) -> Any:
        sp = self.sp
        return None if sp is None else self.fn(sp, *args)

    def disarm(self) -> None:
        """Do nothing from now on, and hold nothing."""
        self.sp = None


def _armed(unit: FSDPUnit, fn: Callable[..., Any], sp: ShardedParam) -> _GradHook:
    hook = _GradHook(fn, sp)
    unit.hooks.grads.append(hook)
    return hook


def watch_grads(unit: FSDPUnit) -> None:
    """Register :func:`_on_grad_accumulated` on every trainable parameter of ``unit``
    (once: Paddle 3.3 returns no handle to remove it by)."""
    for buf in unit.buffers:
        if buf.trainable:
            for sp in buf.params:
                sp.full._register_backward_hook(_armed(unit, _on_grad_accumulated, sp))


def watch_shard_grads(unit: FSDPUnit) -> None:
    """Register :func:`_on_shard_grad` on every trainable shard param of ``unit`` (once
    the unit is sharded)."""
    for buf in unit.buffers:
        if buf.trainable:
            for sp in buf.params:
                sp.shard.register_hook(_armed(unit, _on_shard_grad, sp))


@paddle.no_grad()
def _on_shard_grad(sp, grad):
    """A grad that reaches a shard param itself, not through its unit's gathered full
    param: a loss term computed from ``model.parameters()`` while the unit is sharded
    (``wd * sum((p ** 2).sum() for p in model.parameters())``). The engine adds it,
    scaled, to the storage its sync reduces (:meth:`FSDPUnit.add_direct_grad`) and
    hands autograd zeros: after ``clear_grad()`` Paddle would not add a grad into the
    shard's grad but replace it, and the flat grad storage would miss it."""
    sp.buffer.owner.add_direct_grad(sp, grad)
    return paddle.zeros_like(grad)


@paddle.no_grad()
def _on_grad_accumulated(sp, *_) -> None:
    """Paddle's post-accumulation hook of a full parameter: its grad for this backward
    is complete (every use of it is accumulated). Used by units whose post-backward
    does not fire (no input requires grad: the root, an embedding unit): once every
    parameter of one of their buffers has its grad, that buffer is reduce-scattered at
    once instead of at the end of backward. The root's final norm and untied head
    (their own buffer, see unit.buffer_groups) are so reduced right after their
    backward, while the layers' backward runs; the embedding's buffer at the end.

    Every rank takes this path alike when every rank runs the same units and the
    parameters such a unit holds get a grad on every rank or on none (the condition of
    docs/engine.md); ``set_reduce_grads_at_end_of_backward(True)`` turns it off with
    the per-unit reduction. Owners of tied params a borrower uses still wait for the
    end of backward; so does every unit when ``requires_gradient_sync`` is False."""
    buf = sp.buffer
    buf.full_grads.note_arrived(sp)  # (its grad grid cannot tell: every .grad is a view)
    unit = buf.owner
    if (context.backward.depth == 0 or buf.full_grads.reduced_early or unit.reduced_in_backward
            or unit.pending_calls or unit.borrowed_by
            or not unit.controls.reduce_grads_in_backward
            or not unit.controls.requires_gradient_sync
            or not master_grad.has_full_grad(sp)):
        return  # its post-backward reduces it, or the end of backward does
    root = unit.root()
    if root is None or root not in context.backward.roots_in_backward:
        return
    if not buf.full_grads.complete(sp) or context.backward.hook_errors:
        return
    try:
        memory.sample_full_grads(root.units)
        unit.reduce_buffer_early(buf)
    except BaseException as e:
        # Paddle 3.3 does not carry an exception out of this hook (the next node of the
        # backward fails with an unrelated message): keep it for the end of backward,
        # which abandons the backward and raises it (hooks._then_post_backward).
        context.backward.hook_errors.append(e)
