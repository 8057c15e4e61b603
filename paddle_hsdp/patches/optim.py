"""The step boundary: what the optimizer sees and when the outer all-reduce runs.

Paddle 3.3's optimizers have no step hooks. Every optimizer's ``step`` (and
``minimize``) goes through ``Optimizer._apply_optimize`` before clipping and updating,
so :func:`install` wraps that method: the first call of a step finishes the deferred
gradient sync of every unit whose shard params the optimizer holds, i.e. **one outer
all-reduce per buffer per optimizer step**, however many backward passes accumulated
into the shards. Grads are updated in place, so the grad list ``step`` collected just
before stays valid. With outer sub-shards (``fsdp_outer_sharding="optim"``) that is one
outer reduce-scatter per buffer, and after the update one outer all-gather per buffer
rebuilds the shards (owed here, issued at the next root forward so that edits of the
parameters made in between travel with it, and waited for by the unit's first
all-gather).
Call :func:`~paddle_hsdp.engine.optimizers.finish_grad_sync` yourself to read synced
grads before ``step`` (for logging or custom clipping).

``fleet.distributed_optimizer(opt)`` works too: Paddle wraps optimizers in its own
ZeRO-1 ``DygraphShardingOptimizer`` when ``sharding_degree > 1``; for HSDP-managed
params that would shard an already sharded state and reduce grads twice, so the
wrapper is skipped, and the ``HybridParallelClipGrad`` it puts in the optimizer is
replaced by the HSDP clip (the same marks, summed over the whole job; Paddle's sums
float16, bfloat16 and float32 grads only, so float64 ones went unclipped).
"""

from __future__ import annotations

import functools

import paddle
from paddle.amp.grad_scaler import AmpScaler
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo_mod,
)

from ..comm import collectives as comm
from ..comm import gather_tags
from ..engine import offload, outer_sync, trace
from ..engine.optimizers import (_not_elementwise_classes, _sharded_params_of, _units_of,
                                 check_optimizer, finish_grad_sync, optimizer_state_bytes,
                                 untouched_shards)
from ..engine.registry import registry
from . import clip
from .patching import replace

_installed = False


def _patch_apply_optimize() -> None:
    original = paddle.optimizer.Optimizer._apply_optimize

    @functools.wraps(original)
    def _apply_optimize(self, loss, startup_program, params_grads, *args, **kwargs):
        params = check_optimizer(self)
        gather_tags.raise_pending(step=True)  # one bounded host read (watchdog.host_sync)
        units = _units_of(params)
        if params:
            finish_grad_sync(params)
            params_grads = _pairs_to_update(params_grads)
            clip.make_clip_hsdp_aware(self, params)
            for unit in units:  # the update writes what an outer all-gather may still read
                unit.finish_rebuild()
        # offloaded shards: every grad copied back, then the update runs on the host
        with offload.host_step(b for u in units for b in u.buffers if b.trainable):
            result = original(self, loss, startup_program, params_grads, *args, **kwargs)
        registry.storage_may_have_changed()  # an optimizer may rebind what it updates
        for unit in units:
            unit.owe_rebuild()  # outer sub-shards: every replica needs every piece
        for unit in units:
            unit.reshard(force=True)  # params kept gathered are stale after the update
        outer_sync.step_taken(units)  # how many backwards a step has: the next predicted
        if trace.recording_memory():
            trace.note_optimizer_bytes(optimizer_state_bytes(self))
        trace.record("step", "done", -1)
        return result

    replace(paddle.optimizer.Optimizer, "_apply_optimize", _apply_optimize,
            "the step boundary: finish the deferred grad sync once per optimizer step")


def _pairs_to_update(params_grads):
    """``params_grads`` (``step``'s list of pairs, or a param group's dict with one)
    without the shards whose parameter got no grad on any rank (``untouched_shards``),
    as plain Paddle leaves a parameter whose grad is None out of the update; and with
    each shard's grad as it is after the sync (``step`` collected the pairs before:
    a grad autograd replaced is a view of the synced storage again, engine/buffer.py
    ``add_to_grad``)."""
    pairs = params_grads["params"] if isinstance(params_grads, dict) else params_grads
    untouched = untouched_shards([p for p, _ in pairs if hasattr(p, "_hsdp_sharded_param")])
    kept = [(p, _synced_grad(p, g)) for p, g in pairs if id(p) not in untouched]
    if isinstance(params_grads, dict):  # step's own dict (a defaultdict): kept as it is
        params_grads["params"] = kept
        return params_grads
    return kept


def _synced_grad(param, grad):
    """A shard's ``.grad`` now, where ``grad`` was its ``.grad`` when ``step`` collected
    it (not a main grad, which stays where it is)."""
    if not hasattr(param, "_hsdp_sharded_param") or grad is getattr(param, "main_grad", None):
        return grad
    return param.grad if param.grad is not None else grad


def _patch_optimizers_that_bypass_apply_optimize() -> None:
    """LBFGS steps without ``_apply_optimize``: check it at its own entry points."""
    for cls in _not_elementwise_classes():
        for name in ("step", "minimize"):
            original = cls.__dict__.get(name)
            if original is None:
                continue

            def checked(self, *args, __original=original, **kwargs):
                check_optimizer(self)
                return __original(self, *args, **kwargs)

            replace(cls, name, functools.wraps(original)(checked),
                    "refuse optimizers that are not element-wise on HSDP shards")


def _patch_hybrid_parallel_optimizer() -> None:
    cls = hpo_mod.HybridParallelOptimizer
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, optimizer, hcg, strategy):
        if not _sharded_params_of(optimizer):
            return original_init(self, optimizer, hcg, strategy)
        original_init(self, optimizer, _WithoutPaddleSharding(hcg), strategy)
        self._hcg = hcg
        self._sharding_enable = False  # grads are already reduced by the HSDP units
        # Paddle's HybridParallelClipGrad sums float16, bfloat16 and float32 grads only
        # (float64 ones would go unclipped, silently): the HSDP clip, which counts the
        # same marks over the whole job in every dtype, takes its place
        inner, mesh = self._inner_opt, _sharded_params_of(optimizer)[0]._hsdp_sharded_param.mesh
        if isinstance(inner._grad_clip, hpo_mod.HybridParallelClipGrad):
            inner._grad_clip = clip.hsdp_clip_for(inner._grad_clip._clip, mesh)
        for group in getattr(inner, "_param_groups", None) or []:
            if isinstance(group, dict) and isinstance(group.get("grad_clip"),
                                                      hpo_mod.HybridParallelClipGrad):
                group["grad_clip"] = clip.hsdp_clip_for(group["grad_clip"]._clip, mesh)

    replace(cls, "__init__", __init__,
            "no DygraphShardingOptimizer over HSDP shards (they are sharded and reduced already)")

    # Its tensor-parallel syncs broadcast (or average) replicated params, grads and
    # moments over the mp group; the collectives refuse a tensor of no elements, which
    # a 0-row shard is (engine/layout.py). Every rank of an mp group holds the same
    # rows (one sharding rank), so all skip it alike.
    original_sync = cls._insert_sync

    @functools.wraps(original_sync)
    def _insert_sync(self, sync_var, src, mp_group, sync_mode):
        if 0 in list(sync_var.shape):
            return None
        return original_sync(self, sync_var, src, mp_group, sync_mode)

    replace(cls, "_insert_sync", _insert_sync,
            "tensor-parallel syncs skip 0-row shards (nothing to send; collectives refuse them)")


class _WithoutPaddleSharding:
    """An HCG view that hides the sharding degree from HybridParallelOptimizer's
    constructor, so it does not wrap HSDP shards in DygraphShardingOptimizer."""

    def __init__(self, hcg):
        self._hcg = hcg

    def get_sharding_parallel_world_size(self, *args, **kwargs):
        return 1

    def __getattr__(self, name):
        return getattr(self._hcg, name)


def _patch_clear_grad() -> None:
    """``clear_grad`` also drops full-size grads a deferred reduce-scatter still holds
    (ZeRO-1, ``set_requires_gradient_sync(False)``): a skipped batch is skipped."""
    original = paddle.optimizer.Optimizer.clear_grad

    @functools.wraps(original)
    def clear_grad(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for unit in _units_of(_sharded_params_of(self)):
            unit.drop_pending_grads()
        return result

    replace(paddle.optimizer.Optimizer, "clear_grad", clear_grad,
            "also drop full-size grads a deferred reduce-scatter still holds")


def _patch_grad_scaler() -> None:
    """AMP: ``GradScaler._unscale`` reads the grads before ``step`` reaches
    ``_apply_optimize``, so the deferred sync runs first; and since each rank holds other
    shards, ``found_inf`` is OR-ed over the job so every rank skips the same steps."""
    original = AmpScaler._unscale

    @functools.wraps(original)
    def _unscale(self, optimizer):
        params = _sharded_params_of(getattr(optimizer, "_inner_opt", optimizer))
        if params:
            finish_grad_sync(params)
        result = original(self, optimizer)
        found = getattr(self, "_found_inf", None)
        if params and isinstance(found, paddle.Tensor):
            flag = found.astype("int32").reshape([1])
            group = getattr(params[0]._hsdp_sharded_param.mesh, "clip_group", lambda: None)()
            group = group or paddle.distributed.collective._get_global_group()
            comm.all_reduce(flag, group, tag="found_inf")
            self._found_inf = (flag > 0).reshape(found.shape)
        return result

    replace(AmpScaler, "_unscale", _unscale,
            "AMP: sync grads first; OR found_inf over the job so every rank skips alike")


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_apply_optimize()
    _patch_optimizers_that_bypass_apply_optimize()
    _patch_clear_grad()
    _patch_grad_scaler()
    _patch_hybrid_parallel_optimizer()
    _installed = True
