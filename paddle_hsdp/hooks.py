"""When units gather, reshard and reduce: forward hooks, pre-backward, end of backward.

* Forward pre-hook: gather the unit (and the owners of tied params it borrows).
* Forward post-hook: wrap the outputs in :class:`_PreBackward` (an identity whose
  backward fires before the unit's own backward ops, since they consume its output
  grads), then reshard per policy.
* Pre-backward: gather again if the unit was resharded after forward.
* End of backward: Paddle 3.3 has no queue-callback, so :func:`install` wraps
  ``core.eager.run_backward`` (what ``Tensor.backward`` and ``paddle.autograd.backward``
  call) and ``run_partial_grad`` (``paddle.grad``). After the engine returns, every root whose backward ran reduce-scatters the
  grads of all its units, in one fixed order (reverse registration), and reshards
  them. A fixed order taken by every rank, with zeros for params that got no grad,
  is what makes unused params and rank-dependent control flow inside a unit safe.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .unit import FSDPUnit

# Units whose forward is running, outermost first. A forward that raised leaves stale
# entries; the next unit not contained in any of them is a root and clears them.
_active: list[FSDPUnit] = []
_roots_in_backward: list["RootState"] = []
_installed = False


class RootState:
    """The units under a root unit, collected lazily at its first forward."""

    def __init__(self, root: FSDPUnit, all_units: list[FSDPUnit]):
        subtree = set(id(m) for m in root.module.sublayers(include_self=True))
        self.root = root
        self.units = [u for u in all_units if id(u.module) in subtree]

    def post_backward(self) -> None:
        for unit in reversed(self.units):
            unit.reduce_scatter_grads()
        for unit in reversed(self.units):
            unit.pins = 0
            unit.reshard()


class _PreBackward(PyLayer):
    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        _on_pre_backward(ctx.unit)
        return grads if len(grads) > 1 else grads[0]


def _on_pre_backward(unit: FSDPUnit) -> None:
    for owner in unit.borrowed:
        owner.unshard()
    unit.unshard()
    root_state = getattr(unit, "root_state", None)
    if root_state is not None and root_state not in _roots_in_backward:
        _roots_in_backward.append(root_state)


def _wrap_outputs(unit: FSDPUnit, outputs):
    """Route every grad-requiring output tensor through :class:`_PreBackward`."""
    flat, rebuild = _flatten(outputs)
    idx = [i for i, t in enumerate(flat)
           if isinstance(t, paddle.Tensor) and not t.stop_gradient]
    if not idx:
        return outputs
    wrapped = _PreBackward.apply(unit, *[flat[i] for i in idx])
    if len(idx) == 1:
        wrapped = (wrapped,)
    for i, t in zip(idx, wrapped):
        flat[i] = t
    return rebuild(flat)


def _flatten(obj):
    if isinstance(obj, paddle.Tensor):
        return [obj], lambda f: f[0]
    if isinstance(obj, (list, tuple)):
        parts = [_flatten(o) for o in obj]
        sizes = [len(p[0]) for p in parts]

        def rebuild(flat):
            out, i = [], 0
            for (_, rb), n in zip(parts, sizes):
                out.append(rb(flat[i:i + n]))
                i += n
            return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
        return [t for p in parts for t in p[0]], rebuild
    if isinstance(obj, dict):
        keys = list(obj)
        flat, rb = _flatten([obj[k] for k in keys])
        return flat, lambda f: type(obj)(zip(keys, rb(f)))
    return [obj], lambda f: f[0]


def _subtree_ids(unit: FSDPUnit) -> frozenset:
    ids = getattr(unit, "_subtree_ids", None)
    if ids is None:
        ids = unit._subtree_ids = frozenset(id(m) for m in unit.module.sublayers())
    return ids


def register_unit_hooks(unit: FSDPUnit, all_units: list[FSDPUnit]) -> None:
    def pre_forward(module, inputs):
        if not any(id(unit.module) in _subtree_ids(a) for a in _active):
            _active.clear()  # whatever a forward that raised left behind
            unit.is_root = True
            if getattr(unit, "root_state", None) is None:
                unit.root_state = RootState(unit, all_units)
            for u in unit.root_state.units:
                u.pins = 0  # pins a failed forward left raised
        _active.append(unit)
        for owner in unit.borrowed:
            owner.unshard()
            owner.pins += 1
        unit.unshard()

    def post_forward(module, inputs, outputs):
        if unit in _active:
            _active.remove(unit)
        grad_on = paddle.is_grad_enabled()
        for owner in unit.borrowed:
            owner.pins -= 1
            if owner.should_reshard_after_forward() or not grad_on:
                owner.reshard()
        if grad_on:
            outputs = _wrap_outputs(unit, outputs)
        if unit.should_reshard_after_forward() or not grad_on:
            unit.reshard()
        return outputs

    unit.module.register_forward_pre_hook(pre_forward)
    unit.module.register_forward_post_hook(post_forward)


def run_post_backward() -> None:
    """Finish the backward that just ran (see the module docstring)."""
    while _roots_in_backward:
        _roots_in_backward.pop(0).post_backward()


def install() -> None:
    """Wrap the autograd entry point once so the end of every backward is seen."""
    global _installed
    if _installed:
        return
    from paddle.base import core

    # run_backward serves Tensor.backward and paddle.autograd.backward; paddle.grad
    # goes through run_partial_grad.
    for name in ("run_backward", "run_partial_grad"):
        if hasattr(core.eager, name):
            setattr(core.eager, name, _then_post_backward(getattr(core.eager, name)))
    _installed = True


def _then_post_backward(original):
    def run(*args, **kwargs):
        try:
            result = original(*args, **kwargs)
        except BaseException:
            _roots_in_backward.clear()  # no collectives after a failed backward
            raise
        run_post_backward()
        return result

    return run
