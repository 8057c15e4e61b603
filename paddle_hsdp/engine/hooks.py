"""When units gather, reshard and reduce: forward hooks, pre/post-backward, end of backward.

* Forward pre-hook: a root first checks every unit's parameters
  (:meth:`FSDPUnit.check_params`), so a refusal comes before any collective of the
  forward; then gather the unit (and the owners of tied params it borrows), then
  prefetch the next units in forward order; cast floating inputs per the
  mixed-precision policy; wrap grad-requiring inputs in a :class:`_BackwardHook` that
  runs the post-backward.
* Forward post-hook: wrap the outputs in a :class:`_BackwardHook` that runs the
  pre-backward (it fires before the unit's own backward ops, since they consume its
  output grads), cast outputs, then reshard per policy. A root's forward run without
  grad or in eval mode then reads the all-gather tags' device-side flags
  (:func:`paddle_hsdp.comm.gather_tags.raise_pending`): no optimizer step follows.
* Pre-backward: gather again if the unit was resharded after forward; prefetch the
  next units in backward order.
* Post-backward (the hook on the inputs: fires once the grads of the unit's inputs
  exist, i.e. after the ops that read its parameters): reduce-scatter and reshard, so a
  ZeRO-3 backward holds about one unit gathered at a time. Units other units borrow
  from (tied params) wait for the end of backward.
* Grad accumulated (:mod:`~paddle_hsdp.engine.grad_hooks`): a unit whose post-backward
  does not fire (the root, an embedding unit) reduce-scatters a buffer as soon as every
  parameter of it has its grad.
* End of backward: Paddle 3.3 has no queue-callback, so :func:`install` wraps
  ``core.eager.run_backward`` (what ``Tensor.backward`` and ``paddle.autograd.backward``
  call) and ``run_partial_grad`` (``paddle.grad``). After the engine returns, every
  root whose backward ran reduce-scatters what its units have not reduced yet (and
  grads that arrived after a unit's reduction), in one fixed order (reverse
  registration), and reshards them. A fixed order taken by every rank, with
  zeros for params that got no grad, is what makes unused params and rank-dependent
  control flow inside a unit safe for the grad reduction. The pre-backward gather of a
  resharded unit still needs the unit's outputs to take part in backward on every rank
  (a unit that returns only non-differentiable tensors on some ranks would make those
  ranks skip that all-gather). A backward nested in another (reentrant activation
  recompute) is part of the outer one; forwards run inside a backward never start a
  root and do not reshard (their backward follows at once). A failure of an early
  reduction inside the autograd engine is kept and raised when the backward returns
  (Paddle does not carry it out of the grad hook).

[Note: engine work without autograd] A parameter's ``.grad`` has ``stop_gradient=False``
in Paddle 3.3, and the hooks run while grad mode is on, so every op the engine applies
to grads (a reduce-scatter input's concatenation into a staging grid, views of it)
would record autograd nodes, chained onto the staging tensors the pool keeps for the
whole run: the resident set grew ~110 KB per step here, outside Paddle's tensor
allocator. Every hook that touches grads runs under ``paddle.no_grad()``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import paddle
from paddle.autograd import PyLayer
from paddle.base import core

from ..comm import gather_tags
from . import trace
from .outer_sync import OuterSyncSchedule
from .context import context
from .dtypes import compute_dtype_of
from .registry import registry
from . import memory
from .reductions import drop_pending_reduces, finish_transferred_reduces, wait_pending_reduces
from .unit import FSDPUnit



class RootState:
    """The units under a root unit, collected lazily at its first forward, and the order
    their forwards ran in (recorded on the first iteration; prefetch follows it)."""

    def __init__(self, root: FSDPUnit, all_units: list[FSDPUnit]):
        subtree = set(id(m) for m in root.module.sublayers(include_self=True))
        self.root = root
        self.units = [u for u in all_units if id(u.module) in subtree]
        self.forward_order: list[FSDPUnit] = []
        self.recording = True
        self.outer_sync = OuterSyncSchedule()  # outer syncs issued during backward

    def record(self, unit: FSDPUnit) -> None:
        if self.recording and unit not in self.forward_order:
            self.forward_order.append(unit)

    def neighbours(self, unit: FSDPUnit, count: int, backward: bool) -> list[FSDPUnit]:
        if self.recording or unit not in self.forward_order or count <= 0:
            return []
        i = self.forward_order.index(unit)
        if backward:
            return self.forward_order[max(0, i - count):i][::-1]
        return self.forward_order[i + 1:i + 1 + count]

    def post_backward(self) -> None:
        """End of backward: reduce the units whose post-backward did not reduce them
        (inputs that need no grad, owners of tied params, reduction deferred to the end
        of backward), and units whose grads arrived after their post-backward, in one
        fixed order (reverse registration). Of a unit some of whose buffers were
        reduced early, the rest (and early ones that got more grads since)."""
        self.recording = False
        memory.sample_full_grads(self.units)
        for unit in reversed(self.units):
            early = any(b.full_grads.reduced_early for b in unit.buffers)
            if early and not unit.reduced_in_backward:
                unit.reduce_rest()
            elif not unit.reduced_in_backward or (
                    unit.controls.requires_gradient_sync and unit.has_full_grads()):  # late grads
                unit.post_backward()
            _reset_backward(unit)
        wait_pending_reduces()  # shard grads are complete when backward returns
        for unit in self.units:  # ... and views of the flat storage (add_to_grad)
            for buf in unit.buffers:
                buf.grads.repoint_grads()
        for unit in reversed(self.units):
            unit.clear_pins()
            if unit.controls.reshard_after_backward:
                unit.reshard()
        # the rest issued, all waited: grads are final
        self.outer_sync.end_backward(self.root.mesh.fsdp_group(False), [
            buf for unit in self.units for buf in unit.buffers if buf.trainable])
        trace.record("backward", "end", self.root.index)


def _alias(tensors):
    """New tensor objects sharing the inputs' memory. Returning the inputs themselves
    makes Paddle treat the PyLayer as in-place: the inputs' version would bump, and an
    op that saved them earlier (a router reading x before x enters an expert unit)
    would fail in backward with 'modified by an inplace operation'."""
    # the size from the shape: t.numel() would read a device tensor (a host sync)
    out = tuple(t.view(t.shape) if math.prod(t.shape) > 0 else t.clone() for t in tensors)
    return out if len(out) > 1 else out[0]


class _GraphToken:
    """Held by one :class:`_BackwardHook` node's context and nothing else, so it lives
    exactly as long as the autograd graph that can still run that node: Paddle frees
    the context when the node has run (without ``retain_graph``) or when the graph is
    dropped without a backward (a skipped batch, eval with grad on). Units count their
    pending post-backwards by these, and ``context.backward.live_graphs`` holds every one."""

    __slots__ = ("__weakref__",)




class _BackwardHook(PyLayer):
    """Identity on ``tensors`` whose backward first calls ``hook(unit, token)``: around
    a unit's outputs it fires before the unit's backward ops, around its inputs after
    them."""

    @staticmethod
    def forward(ctx, hook, unit, token, *tensors):
        ctx.hook, ctx.unit, ctx.token = hook, unit, token
        return _alias(tensors)

    @staticmethod
    def backward(ctx, *grads):
        with paddle.no_grad():  # see [Note: engine work without autograd]
            ctx.hook(ctx.unit, ctx.token)
        return grads if len(grads) > 1 else grads[0]


def _on_post_backward(unit: FSDPUnit, token: "_GraphToken") -> None:
    """The unit's backward is done (the grads of its inputs exist): reduce-scatter its
    grads now and free the full-size ones, so at most a unit or two of full grads are
    alive at once. Every rank takes this path alike as long as every rank runs the same
    units and their inputs require grad alike (docs/engine.md); owners of tied params
    wait for the end of backward, since a borrower's backward may still add to them."""
    unit.pending_calls.discard(token)
    if unit.pending_calls:
        return  # called again in this forward (two micro-batches, a shared block): the
        # other calls' backward still needs the params and adds to the grads (a call
        # whose graph was dropped without a backward no longer counts: see _GraphToken)
    if unit.controls.reduce_grads_in_backward and not unit.borrowed_by:
        root = unit.root()
        if root is not None:
            memory.sample_full_grads(root.units)
        unit.post_backward_hook()
    if unit.controls.reshard_after_backward and not unit.is_root and not unit.borrowed_by:
        unit.reshard()
    trace.record("backward", "done", unit.index)


def _reset_backward(unit: FSDPUnit, failed: bool = False) -> None:
    """Forget one backward's progress (its end, or a backward that failed). The unit's
    pending calls stay at a normal end: they are the graphs of forwards whose backward
    has not run yet (a pipeline's 1F1B runs a stage's forward of the next micro-batch
    before the backward of this one), and their post-backward hooks will still fire
    (a finished graph's token is gone already). Forgetting them made those hooks
    reduce-scatter a buffer the early reduction had just reduced: one extra
    reduce-scatter per unit per step under 1F1B with 2 micro-batches (measured)."""
    unit.end_backward(failed)


def on_pre_backward(unit: FSDPUnit, token: _GraphToken | None = None) -> None:
    for owner in unit.borrowed:
        owner.unshard()
    unit.unshard()
    # the grads land in place in the reduce input (engine/buffer/full_grads.py); a finished
    # reduce-scatter's input goes back to the pool first, to serve as this one
    finish_transferred_reduces()
    for buf in unit.buffers:
        buf.full_grads.attach_grid()
    root = unit.root()
    if root is not None:
        controls = unit.controls
        for nxt in controls.backward_prefetch if controls.backward_prefetch is not None \
                else root.neighbours(unit, controls.backward_prefetch_count, backward=True):
            nxt.prefetch()
    # Any unit's pre-backward registers its root: a root whose own outputs hide their
    # tensors (a custom output object) still gets its end of backward.
    if root is not None and root not in context.backward.roots_in_backward:
        context.backward.roots_in_backward.append(root)
        root.outer_sync.begin_backward()
    if root is not None:  # after this unit's collectives: beside its compute
        root.outer_sync.issue_ready()
    trace.record("backward", "compute", unit.index)


def wrap_tensors(hook, unit: FSDPUnit, obj, token: _GraphToken | None = None):
    """Route every grad-requiring tensor of ``obj`` through one :class:`_BackwardHook`
    (holding ``token``, or a new one)."""
    flat, rebuild = _flatten(obj)
    idx = [i for i, t in enumerate(flat)
           if isinstance(t, paddle.Tensor) and not t.stop_gradient]
    if not idx:
        return obj
    token = _GraphToken() if token is None else token
    context.backward.live_graphs.add(token)
    wrapped = _BackwardHook.apply(hook, unit, token, *[flat[i] for i in idx])
    if len(idx) == 1:
        wrapped = (wrapped,)
    for i, t in zip(idx, wrapped, strict=True):
        flat[i] = t
    return rebuild(flat)


def _cast_floating(obj, dtype):
    flat, rebuild = _flatten(obj)
    for i, t in enumerate(flat):
        if isinstance(t, paddle.Tensor) and t.is_floating_point() and t.dtype != dtype:
            flat[i] = t.astype(dtype)
    return rebuild(flat)


def _flatten(obj):
    """``obj``'s tensors as a flat list, and a function that rebuilds ``obj`` from such a
    list. Walks tuples, lists, namedtuples, dicts (subclasses too: ModelOutput-like) and
    dataclasses; anything else is a leaf."""
    if isinstance(obj, paddle.Tensor):
        return [obj], lambda f: f[0]
    if isinstance(obj, dict):
        keys = list(obj)
        flat, rb = _flatten([obj[k] for k in keys])

        def rebuild_dict(f):
            new = copy.copy(obj)
            for k, v in zip(keys, rb(f), strict=True):
                new[k] = v
            return new
        return flat, rebuild_dict
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        flat, rb = _flatten([getattr(obj, n) for n in names])
        return flat, lambda f: dataclasses.replace(obj, **dict(zip(names, rb(f), strict=True)))
    if isinstance(obj, (list, tuple)):
        parts = [_flatten(o) for o in obj]
        sizes = [len(p[0]) for p in parts]

        def rebuild(flat):
            out, i = [], 0
            for (_, rb), n in zip(parts, sizes, strict=True):
                out.append(rb(flat[i:i + n]))
                i += n
            return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
        return [t for p in parts for t in p[0]], rebuild
    return [obj], lambda f: f[0]


def _input_dtype(unit: FSDPUnit):
    """The dtype floating inputs are cast to under the unit's mixed-precision policy."""
    policy = unit.policies.mp
    if policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
        return None
    return compute_dtype_of(policy.param_dtype)


def make_root_state(root: FSDPUnit, all_units: list[FSDPUnit]) -> "RootState":
    if root.root_state is None:
        root.root_state = RootState(root, all_units)
        for u in root.root_state.units:
            u.enter_root(root.root_state)
    return root.root_state


def record_outer_sync_again(units) -> None:
    """Every root among ``units`` records and agrees its outer syncs' order anew at its
    next backward (:meth:`OuterSyncSchedule.record_again`): paddle_hsdp.ft, on every
    member of a round that changed who trains (a joiner's roots may not exist yet:
    they record at their first backward anyway)."""
    for unit in units:
        if unit.root_state is not None:
            unit.root_state.outer_sync.record_again()


class ForwardHooks:
    """The forward pre- and post-hook of one unit's module, as bound methods (the unit
    keeps their handles: ``unit.hooks``)."""

    __slots__ = ("unit", "all_units")

    def __init__(self, unit: FSDPUnit, all_units: list[FSDPUnit]):
        self.unit, self.all_units = unit, all_units

    def pre_forward(self, module: paddle.nn.Layer, args: tuple, kwargs: dict
                    ) -> tuple[tuple, dict]:
        unit = self.unit
        # A root is a unit no running unit contains, called outside any backward; a
        # forward run inside a backward (activation recompute) is never a root.
        starts_root = context.backward.depth == 0 and not any(
            id(unit.module) in a.subtree_ids for a in context.backward.active)
        unit.is_root = starts_root
        if starts_root:
            self._start_root()
        context.backward.active.append(unit)
        # before this unit's gathers and prefetches: their tags carry it (gather_tags)
        gather_tags.note_forward(unit.index)
        root = unit.root()
        if root is not None:
            root.record(unit)
        for owner in unit.borrowed:
            owner.unshard()
            owner.pin()
        unit.unshard()
        if root is not None:
            controls = unit.controls
            for nxt in controls.forward_prefetch if controls.forward_prefetch is not None \
                    else root.neighbours(unit, controls.forward_prefetch_count, backward=False):
                nxt.prefetch()
        dtype = _input_dtype(unit)
        if dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), dtype)
        if paddle.is_grad_enabled():
            packed = (args, kwargs)
            call = _GraphToken()
            wrapped = wrap_tensors(_on_post_backward, unit, packed, call)
            if wrapped is not packed:
                unit.pending_calls.add(call)  # its post-backward will fire, or its graph go
            args, kwargs = wrapped
        trace.record("forward", "compute", unit.index)
        return args, kwargs

    def _start_root(self) -> None:
        context.backward.active.clear()  # whatever a forward that raised left behind
        registry.storage_may_have_changed()  # user code ran since the last pass
        gather_tags.start_forward()
        root_state = make_root_state(self.unit, self.all_units)
        for u in root_state.units:
            u.clear_pins()  # pins a failed forward left raised
            # every unit's refusals come before this forward's first gather (a
            # prefetch gathers the next unit before its own pre-forward)
            u.check_params()
        for u in root_state.units:  # outer sub-shards: the owed rebuilds
            u.start_owed_rebuilds()

    def post_forward(self, module: paddle.nn.Layer, inputs: tuple, outputs: Any) -> Any:
        unit = self.unit
        if unit in context.backward.active:
            context.backward.active.remove(unit)
        grad_on = paddle.is_grad_enabled()
        # Inside a backward (recompute) the unit is about to run its backward: keep it.
        may_reshard = context.backward.depth == 0
        for owner in unit.borrowed:
            owner.unpin()
            if may_reshard and (owner.should_reshard_after_forward() or not grad_on):
                owner.reshard()
        policy = unit.policies.mp
        if policy is not None and policy.output_dtype is not None:
            outputs = _cast_floating(outputs, policy.output_dtype)
        if grad_on:
            outputs = wrap_tensors(on_pre_backward, unit, outputs)
        if may_reshard and (unit.should_reshard_after_forward() or not grad_on):
            unit.reshard()
        if unit.is_root and may_reshard and (not grad_on or not module.training):
            # evaluation / generation never reach an optimizer step: read the gathers'
            # device-side tag flags now (nothing to read on CPU; one sync on a device)
            gather_tags.raise_pending()
        trace.record("forward", "done", unit.index)
        return outputs


def register_unit_hooks(unit: FSDPUnit, all_units: list[FSDPUnit]) -> None:
    hooks = ForwardHooks(unit, all_units)
    # (Paddle's stubs type a hook as taking and returning one Tensor; it is called with
    # the inputs tuple, and with_kwargs with the kwargs too)
    unit.hooks.forward += [
        unit.module.register_forward_pre_hook(
            hooks.pre_forward, with_kwargs=True),  # type: ignore[arg-type]
        unit.module.register_forward_post_hook(hooks.post_forward)]  # type: ignore[arg-type]


def abandon_forward(units: list[FSDPUnit]) -> None:
    """After a forward that raised: unpin and reshard ``units`` and the owners they
    borrow from (local work, no collective), so the module slots hold shards again."""
    for unit in units:
        if unit in context.backward.active:
            context.backward.active.remove(unit)
        root = unit.root()
        if root is not None and root.recording:
            root.forward_order.clear()  # a partial order would differ across ranks
        unit.pending_calls.clear()  # the raised forward's graph is gone
        for u in [unit] + unit.borrowed:
            u.clear_pins()
            u.reshard(force=True)


@paddle.no_grad()
def run_post_backward() -> None:
    """Finish the backward that just ran (see the module docstring). If that raises (an
    out-of-memory error building a reduce-scatter input), the backward is abandoned
    like one that raised inside the engine: a reduction left in flight would otherwise
    be accumulated into the next batch's grads."""
    while context.backward.roots_in_backward:
        try:
            context.backward.roots_in_backward[0].post_backward()
        except BaseException:
            _abandon_backward()
            raise
        context.backward.roots_in_backward.pop(0)


def install() -> None:
    """Wrap the autograd entry points once so the end of every backward is seen."""
    if context.backward.autograd_wrapped:
        return
    # run_backward serves Tensor.backward and paddle.autograd.backward; paddle.grad
    # goes through run_partial_grad.
    for name, retains in (("run_backward", _backward_retains),
                          ("run_partial_grad", _partial_grad_retains)):
        if hasattr(core.eager, name):
            setattr(core.eager, name, _then_post_backward(getattr(core.eager, name),
                                                          retains))
    context.backward.autograd_wrapped = True


def _backward_retains(args, kwargs) -> bool:
    """``run_backward(tensors, grad_tensors, retain_graph, ...)``."""
    return bool(args[2] if len(args) > 2 else kwargs.get("retain_graph", False))


def _partial_grad_retains(args, kwargs) -> bool:
    """``run_partial_grad(outputs, inputs, grad_outputs, retain_graph, create_graph,
    ...)``: a graph created for a second backward is retained too."""
    retain = args[3] if len(args) > 3 else kwargs.get("retain_graph", False)
    create = args[4] if len(args) > 4 else kwargs.get("create_graph", False)
    return bool(retain or create)


def _refuse_retained_graph() -> None:
    """Paddle 3.3 crashes the process (SIGSEGV in ``GradNodePyLayer``) on the second
    backward through a retained PyLayer node, and every unit puts one around its inputs
    and outputs: refuse the first, while the graph is intact and nothing ran."""
    raise NotImplementedError(
        "backward with retain_graph=True (or paddle.grad with retain_graph or "
        "create_graph) while a model sharded by fully_shard has a graph alive: Paddle 3.3 "
        "crashes (SIGSEGV in GradNodePyLayer) on a second backward through a retained "
        "PyLayer node, and fully_shard puts one around every unit. Sum the losses and "
        "call backward once ((loss_a + loss_b).backward()), or run a fresh forward for "
        "each backward. Nothing ran: the graph is intact, and backward() without "
        "retain_graph still works.")


def _then_post_backward(original, retains):
    def run(*args, **kwargs):
        if context.backward.live_graphs and retains(args, kwargs):
            _refuse_retained_graph()
        context.backward.depth += 1
        try:
            result = original(*args, **kwargs)
        except BaseException:
            context.backward.depth -= 1
            if context.backward.depth == 0:
                context.backward.hook_errors.clear()  # this error is the one that propagates
                _abandon_backward()
            raise
        context.backward.depth -= 1
        # A backward nested in another (reentrant activation recompute) is part of it:
        # only the outermost one ends the backward.
        if context.backward.depth == 0:
            if context.backward.hook_errors:  # an early reduction failed inside the backward
                error = context.backward.hook_errors[0]
                context.backward.hook_errors.clear()
                _abandon_backward()
                raise error
            run_post_backward()
        return result

    return run


def _abandon_backward() -> None:
    """After a failed backward: drop its partial full-size grads and free gathered params
    (no new collective, so a rank that failed alone cannot hang the others). The
    collectives this backward issued are waited for first (reduce-scatters in flight
    here, prefetched all-gathers in ``reshard``): on a device their buffers must not go
    back to the allocator while the communication stream may still write them."""
    drop_pending_reduces()
    while context.backward.roots_in_backward:
        root = context.backward.roots_in_backward.pop(0)
        root.outer_sync.abandon()
        for unit in root.units:
            unit.drop_full_grads()
            _reset_backward(unit, failed=True)
            unit.clear_pins()
            unit.reshard(force=True)
