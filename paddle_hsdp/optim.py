"""The step boundary: what the optimizer sees and when the outer all-reduce runs.

Paddle 3.3's optimizers have no step hooks. Every optimizer's ``step`` (and
``minimize``) goes through ``Optimizer._apply_optimize`` before clipping and updating,
so :func:`install` wraps that method: the first call of a step finishes the deferred
gradient sync of every unit whose shard params the optimizer holds, i.e. **one outer
all-reduce per buffer per optimizer step**, however many backward passes accumulated
into the shards. Grads are updated in place, so the grad list ``step`` collected just
before stays valid. Call :func:`finish_grad_sync` yourself to read synced grads before
``step`` (for logging or custom clipping).

``fleet.distributed_optimizer(opt)`` works too: Paddle wraps optimizers in its own
ZeRO-1 ``DygraphShardingOptimizer`` when ``sharding_degree > 1``; for HSDP-managed
params that would shard an already sharded state and reduce grads twice, so the
wrapper is skipped and Paddle's ``HybridParallelClipGrad`` is kept, reading the real HCG.
"""

from __future__ import annotations

import functools

import paddle

from . import clip, comm, gather_check
from .unit import FSDPUnit, sync_grads

_installed = False


def _params_of(optimizer) -> list:
    params = []
    for p in getattr(optimizer, "_parameter_list", None) or []:
        if isinstance(p, dict):
            params.extend(p["params"])
        else:
            params.append(p)
    return params


def _sharded_params_of(optimizer) -> list:
    return [p for p in _params_of(optimizer) if hasattr(p, "_hsdp_sharded_param")]


def _not_elementwise_classes() -> tuple:
    """Optimizers whose update of an element reads other elements of the parameter
    (trust ratios, line searches): on a shard they would see only this rank's rows."""
    import paddle.incubate.optimizer as incubate
    import paddle.incubate.optimizer.lbfgs as incubate_lbfgs

    names = [(paddle.optimizer, "Lamb"), (paddle.optimizer, "LBFGS"),
             (incubate_lbfgs, "LBFGS"), (incubate, "LarsMomentumOptimizer"),
             (incubate, "DistributedFusedLamb")]
    found = (getattr(mod, name, None) for mod, name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def check_optimizer(optimizer) -> list:
    """Refuse, before any collective or update, an optimizer that cannot be right on
    HSDP shards; return the shards it holds. Same answer on every rank: every rank
    builds the same optimizer over the same model."""
    from .api import managed_param

    params = _params_of(optimizer)
    for p in params:
        sp = managed_param(p)
        if sp is not None and p is not sp.shard:
            raise RuntimeError(
                f"The optimizer holds the full parameter '{sp.fqn}' ({p.name}), which "
                "fully_shard replaced by this rank's shard: its updates would be lost. "
                "Build the optimizer after the root's fully_shard, from model.parameters() "
                "(which then yields the shards).")
    shards = [p for p in params if hasattr(p, "_hsdp_sharded_param")]
    if shards and isinstance(optimizer, _not_elementwise_classes()):
        raise NotImplementedError(
            f"{type(optimizer).__name__} is not element-wise (its update of an element "
            "depends on the whole parameter), so on HSDP shards each rank would compute a "
            "different update and outer replicas would drift apart. Use an element-wise "
            "optimizer (AdamW, Adam, SGD, Momentum, RMSProp, ...) with paddle_hsdp.")
    return shards


def _units_of(params) -> list[FSDPUnit]:
    from .api import owning_unit

    units = {}
    for p in params:
        unit = owning_unit(p._hsdp_sharded_param)
        units[unit.index] = unit
    return [units[i] for i in sorted(units)]  # one global order on every rank


def finish_grad_sync(target) -> None:
    """Run the deferred outer all-reduce (and 1/N scaling) now, for the units of
    ``target``: an optimizer (the units whose shards it holds), a sharded model (every
    unit under it), or an iterable of parameters. A collective: call it on every rank.
    Idempotent within a step."""
    sync_grads(_units_for(target, "finish_grad_sync"))


def unwrap_optimizer(optimizer):
    """The optimizer under fleet.distributed_optimizer's wrappers (anything else as is)."""
    while hasattr(optimizer, "_inner_opt"):
        optimizer = optimizer._inner_opt
    return optimizer


def _units_for(target, what: str) -> list[FSDPUnit]:
    from .api import _units_under

    target = unwrap_optimizer(target)
    if hasattr(target, "_parameter_list"):
        return _units_of(_sharded_params_of(target))
    if isinstance(target, paddle.nn.Layer):
        units = _units_under(target)
        if not units:
            raise ValueError(f"{what}: no fully_shard unit in this "
                             f"{type(target).__name__}; call fully_shard on it first.")
        return units
    if isinstance(target, paddle.Tensor) or not hasattr(target, "__iter__"):
        raise TypeError(f"{what} takes an optimizer, a sharded model or an iterable of "
                        f"parameters, got {type(target).__name__}")
    return _units_of(_managed_shards(target))


def _managed_shards(params) -> list:
    """The HSDP shard of every managed param in ``params`` (a gathered full param
    counts as its shard), deduplicated, in order."""
    from .api import managed_param

    out, seen = [], set()
    for p in params:
        sp = managed_param(p)
        if sp is None:
            continue
        p = sp.shard
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _patch_apply_optimize() -> None:
    original = paddle.optimizer.Optimizer._apply_optimize

    @functools.wraps(original)
    def _apply_optimize(self, loss, startup_program, params_grads, *args, **kwargs):
        params = check_optimizer(self)
        gather_check.raise_pending()
        if params:
            finish_grad_sync(params)
            clip.make_clip_hsdp_aware(self, params)
        result = original(self, loss, startup_program, params_grads, *args, **kwargs)
        for unit in _units_of(params):
            unit.reshard(force=True)  # params kept gathered are stale after the update
        return result

    paddle.optimizer.Optimizer._apply_optimize = _apply_optimize


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

            setattr(cls, name, functools.wraps(original)(checked))


def _patch_hybrid_parallel_optimizer() -> None:
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
        hybrid_parallel_optimizer as hpo_mod,
    )

    cls = hpo_mod.HybridParallelOptimizer
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, optimizer, hcg, strategy):
        if not _sharded_params_of(optimizer):
            return original_init(self, optimizer, hcg, strategy)
        original_init(self, optimizer, _WithoutPaddleSharding(hcg), strategy)
        self._hcg = hcg
        self._sharding_enable = False  # grads are already reduced by the HSDP units
        inner = self._inner_opt
        clips = [inner._grad_clip] + [g.get("grad_clip") for g in
                                      getattr(inner, "_param_groups", None) or []
                                      if isinstance(g, dict)]
        for c in clips:
            if isinstance(c, hpo_mod.HybridParallelClipGrad):
                c._hcg = hcg  # its norm all-reduce spans the sharding group
                clip.record_norm_of_hybrid_clip(c)

    cls.__init__ = __init__


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

    paddle.optimizer.Optimizer.clear_grad = clear_grad


def _patch_grad_scaler() -> None:
    """AMP: ``GradScaler._unscale`` reads the grads before ``step`` reaches
    ``_apply_optimize``, so the deferred sync runs first; and since each rank holds other
    shards, ``found_inf`` is OR-ed over the job so every rank skips the same steps."""
    from paddle.amp.grad_scaler import AmpScaler

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

    AmpScaler._unscale = _unscale


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
