"""The step boundary: what runs around every optimizer's update.

From the second step on, grads are final when the backward that ends a step returns
(engine/outer_sync.py predicts it): the outer all-reduce (with outer sub-shards the
reduce-scatter) and the 1/N scale ran there. What a step still needs runs in
:class:`_StepBoundary`, around the update of **every** optimizer, however it steps:
Paddle 3.3's optimizers have no step hooks, so :func:`install` wraps the own ``step``,
``minimize`` and ``_apply_optimize`` of every optimizer class (classes defined later
too, through ``__init_subclass__``): Paddle's own optimizers and
``MixPrecisionOptimizer`` update in ``_apply_optimize``; an optimizer that overrides
``step`` without calling the base class (Paddle's Muon, hand-written ones) is caught at
its ``step``; the outermost entry runs the boundary. Before the update: refusals
(optimizers that cannot be right on shards), the sync of grads whose backward did not
finish it (the first step, a step with fewer micro-steps than predicted, deferred or
offloaded grads; one outer collective per buffer per step either way) and the HSDP clip
in every place Paddle keeps one (:func:`paddle_hsdp.patches.clip.make_clip_hsdp_aware`).
After it: with outer sub-shards (``fsdp_outer_sharding="optim"``) one outer all-gather
per buffer rebuilds the shards (owed here, issued at the next root forward so that edits
of the parameters made in between travel with it, and waited for by the unit's first
all-gather); params kept gathered are resharded; the next step's backward count is
learnt. Call :func:`~paddle_hsdp.engine.optimizers.finish_grad_sync` yourself to read
synced grads between micro-steps.

``fleet.distributed_optimizer(opt)`` works too: Paddle wraps optimizers in its own
ZeRO-1 ``DygraphShardingOptimizer`` when ``sharding_degree > 1``; for HSDP-managed
params that would shard an already sharded state and reduce grads twice, so the
wrapper is skipped, and the ``HybridParallelClipGrad`` it puts in the optimizer is
replaced by the HSDP clip (the same marks, summed over the whole job; Paddle's sums
float16, bfloat16 and float32 grads only, so float64 ones went unclipped).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import paddle
from paddle.amp.grad_scaler import AmpScaler
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import (
    hybrid_parallel_optimizer as hpo_mod,
)

from ..comm import collectives as comm
from ..comm import gather_tags
from ..engine import diloco, offload, outer_sync, trace
from ..engine.optimizers import (not_elementwise_classes, sharded_params_of, units_of_shards,
                                 check_optimizer, finish_grad_sync, optimizer_state_bytes,
                                 move_matrices_to_owners, refuse_row_sharded_matrices,
                                 share_orthogonalisation_over_replicas, untouched_shards)
from ..engine.optimizer_state import adopt_shards, cut_full_state
from ..engine.registry import registry
from . import clip
from .patching import replace

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.distributed_strategy import DistributedStrategy
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

    # what Optimizer.step hands _apply_optimize: the pairs, or a param group's dict
    ParamsGrads = list[tuple[paddle.Tensor, paddle.Tensor | None]] | dict

_installed = False
logger = logging.getLogger("paddle_hsdp")


class _StepBoundary:
    """What every optimizer step runs around its update, once however the step is
    nested: ``HybridParallelOptimizer.step`` -> ``MixPrecisionOptimizer.step`` ->
    ``AdamW._apply_optimize``, or an optimizer's own ``step`` that never reaches
    ``_apply_optimize`` (Paddle's Muon, hand-written ones). The outermost entry runs it;
    the inner ones only run the update."""

    def __init__(self) -> None:
        self.open: object | None = None  # the optimizer whose step is running

    @contextlib.contextmanager
    def around(self, optimizer: paddle.optimizer.Optimizer) -> Iterator[None]:
        if self.open is not None:
            yield
            return
        adopt_built_before_sharding(optimizer)
        params = check_optimizer(optimizer)
        gather_tags.raise_pending(step=True)  # one bounded host read (watchdog.host_sync)
        units = units_of_shards(params)
        if params:
            to_move = refuse_row_sharded_matrices(optimizer, params)
            finish_grad_sync(params)  # a no-op where backward finished it
            if to_move:  # a whole-matrix optimizer's first step: its matrices onto owners
                move_matrices_to_owners(optimizer, to_move)
            share_orthogonalisation_over_replicas(optimizer, params)
            clip.make_clip_hsdp_aware(optimizer, params, units)
            for unit in units:  # the update writes what an outer all-gather may still read
                unit.finish_rebuild()
            diloco.before_update(units)  # DiLoCo's first step: where its interval starts
        self.open = optimizer
        try:
            # offloaded shards: every grad copied back, then the update runs on the host
            with offload.host_step(b for u in units for b in u.buffers if b.trainable):
                yield
        finally:
            self.open = None
        registry.storage_may_have_changed()  # an optimizer may rebind what it updates
        for unit in units:
            unit.owe_rebuild()  # outer sub-shards: every replica needs every piece
        diloco.after_update(units)  # DiLoCo: every H-th step, the outer sync
        for unit in units:
            unit.reshard(force=True)  # params kept gathered are stale after the update
        outer_sync.step_taken(units)  # how many backwards a step has: the next predicted
        if trace.recording_memory():
            trace.note_optimizer_bytes(optimizer_state_bytes(optimizer))
        trace.record("step", "done", -1)


_boundary = _StepBoundary()


_STEPPING = ("step", "minimize", "_apply_optimize")


def _with_boundary(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original`` (a class's own ``step``, ``minimize`` or ``_apply_optimize``) run
    inside the step boundary; ``_apply_optimize`` also gets the pairs to update as
    they are after the sync (:func:`_pairs_to_update`)."""

    def stepping(self: paddle.optimizer.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with _boundary.around(self):
            if name == "_apply_optimize" and sharded_params_of(self):
                if "params_grads" in kwargs:  # (loss, startup_program, params_grads, ...)
                    kwargs["params_grads"] = _pairs_to_update(kwargs["params_grads"], self)
                elif len(args) >= 3:
                    args = (*args[:2], _pairs_to_update(args[2], self), *args[3:])
            return original(self, *args, **kwargs)

    wrapped = functools.wraps(original)(stepping)
    vars(wrapped)["_hsdp_step_boundary"] = True  # the mark _wrap_steps_of looks for
    return wrapped


def _wrap_steps_of(cls: type[paddle.optimizer.Optimizer]) -> None:
    """Give every class in ``cls``'s MRO that defines its own ``step``, ``minimize`` or
    ``_apply_optimize`` the step boundary (once per class): an optimizer that overrides
    ``step`` without calling Paddle's ``_apply_optimize`` still steps on synced grads
    with the HSDP clip, and its update is followed by what the engine owes after one
    (HFSDP's rebuild, resharding params kept gathered, the next step's prediction)."""
    for klass in cls.__mro__:
        for name in _STEPPING:
            original = klass.__dict__.get(name)
            if original is None or getattr(original, "_hsdp_step_boundary", False):
                continue
            replace(klass, name, _with_boundary(original, name),
                    "the step boundary around every optimizer's own step, whether or not "
                    "it goes through Paddle's _apply_optimize")


def _patch_every_optimizer_class() -> None:
    """The boundary around the own step of every optimizer class: those that exist now
    (Paddle's, and any defined before ``import paddle_hsdp``) and, through
    ``__init_subclass__``, every one defined later. (Not at construction: Paddle's
    AdamW never calls ``Optimizer.__init__``.)"""
    base = paddle.optimizer.Optimizer
    pending = [base]
    while pending:
        cls = pending.pop()
        _wrap_steps_of(cls)
        pending.extend(cls.__subclasses__())

    def __init_subclass__(cls: type[paddle.optimizer.Optimizer], **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        _wrap_steps_of(cls)

    replace(base, "__init_subclass__", classmethod(__init_subclass__),
            "wrap each later optimizer class's own step in the step boundary")


def _pairs_to_update(params_grads: ParamsGrads,
                     optimizer: paddle.optimizer.Optimizer) -> ParamsGrads:
    """``params_grads`` (``step``'s list of pairs, or a param group's dict with one)
    without the shards whose parameter got no grad on any rank (``untouched_shards``),
    as plain Paddle leaves a parameter whose grad is None out of the update; and with
    each shard's grad as it is after the sync (``step`` collected the pairs before:
    a grad autograd replaced is a view of the synced storage again, engine/buffer/shard_grads.py
    ``add_to_grad``)."""
    pairs = params_grads["params"] if isinstance(params_grads, dict) else params_grads
    untouched = untouched_shards([p for p, _ in pairs if hasattr(p, "_hsdp_sharded_param")])
    kept = [(p, _synced_grad(p, g)) for p, g in pairs if id(p) not in untouched]
    if isinstance(params_grads, dict):  # step's own dict (a defaultdict): kept as it is
        params_grads["params"] = kept
        # a group's clip, copied into the dict by ``step`` before the boundary ran
        params_grads["grad_clip"] = clip.hsdp_aware_for(params_grads.get("grad_clip"),
                                                        optimizer)
        return params_grads
    return kept


def _synced_grad(param: paddle.Tensor, grad: paddle.Tensor | None) -> paddle.Tensor | None:
    """A shard's ``.grad`` now, where ``grad`` was its ``.grad`` when ``step`` collected
    it (not a main grad, which stays where it is)."""
    if not hasattr(param, "_hsdp_sharded_param") or grad is getattr(param, "main_grad", None):
        return grad
    return param.grad if param.grad is not None else grad


def _patch_hybrid_parallel_optimizer() -> None:
    cls = hpo_mod.HybridParallelOptimizer
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: hpo_mod.HybridParallelOptimizer, optimizer: paddle.optimizer.Optimizer,
                 hcg: HybridCommunicateGroup, strategy: DistributedStrategy) -> None:
        if not sharded_params_of(optimizer):
            return original_init(self, optimizer, hcg, strategy)
        original_init(self, optimizer, _WithoutPaddleSharding(hcg), strategy)
        self._hcg = hcg
        self._sharding_enable = False  # grads are already reduced by the HSDP units
        # Paddle's HybridParallelClipGrad sums float16, bfloat16 and float32 grads only
        # (float64 ones would go unclipped, silently): the HSDP clip, which counts the
        # same marks over the whole job in every dtype, takes its place wherever
        # Paddle put it (under a MixPrecisionOptimizer too)
        clip.make_clip_hsdp_aware(self, sharded_params_of(optimizer))

    replace(cls, "__init__", __init__,
            "no DygraphShardingOptimizer over HSDP shards (they are sharded and reduced already)")

    # Its tensor-parallel syncs broadcast (or average) replicated params, grads and
    # moments over the mp group; the collectives refuse a tensor of no elements, which
    # a 0-row shard is (engine/layout.py). Every rank of an mp group holds the same
    # rows (one sharding rank), so all skip it alike.
    original_sync = cls._insert_sync

    @functools.wraps(original_sync)
    def _insert_sync(self: hpo_mod.HybridParallelOptimizer, sync_var: paddle.Tensor, src: int,
                     mp_group: Group, sync_mode: str) -> None:
        if 0 in list(sync_var.shape):
            return None
        return original_sync(self, sync_var, src, mp_group, sync_mode)

    replace(cls, "_insert_sync", _insert_sync,
            "tensor-parallel syncs skip 0-row shards (nothing to send; collectives refuse them)")


class _WithoutPaddleSharding:
    """An HCG view that hides the sharding degree from HybridParallelOptimizer's
    constructor, so it does not wrap HSDP shards in DygraphShardingOptimizer."""

    def __init__(self, hcg: HybridCommunicateGroup) -> None:
        self._hcg = hcg

    def get_sharding_parallel_world_size(self, *args: Any, **kwargs: Any) -> int:
        return 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hcg, name)


def _patch_clear_grad() -> None:
    """``clear_grad`` also drops full-size grads a deferred reduce-scatter still holds
    (ZeRO-1, ``set_requires_gradient_sync(False)``): a skipped batch is skipped; and it
    clears the shards' ``main_grad`` (Paddle's master-grad wrapper fills it) as Paddle's
    own ZeRO optimizer does: zeroed, or released with ``set_to_zero=False``."""
    original = paddle.optimizer.Optimizer.clear_grad

    @functools.wraps(original)
    def clear_grad(self: paddle.optimizer.Optimizer, set_to_zero: bool = True) -> None:
        result = original(self, set_to_zero)
        shards = sharded_params_of(self)
        for p in shards:
            if getattr(p, "main_grad", None) is not None:
                if set_to_zero:
                    p.main_grad.zero_()
                else:
                    p.main_grad._clear()
                    p.main_grad = None
        for unit in units_of_shards(shards):
            unit.drop_pending_grads()
        return result

    replace(paddle.optimizer.Optimizer, "clear_grad", clear_grad,
            "also drop full-size grads a deferred reduce-scatter still holds, and clear "
            "the shards' main_grad")


def _patch_set_state_dict() -> None:
    original = paddle.optimizer.Optimizer.set_state_dict

    @functools.wraps(original)
    def set_state_dict(self: paddle.optimizer.Optimizer, state_dict: dict, *args: Any,
                       **kwargs: Any) -> Any:
        if registry.units:
            state_dict = cut_full_state(self, state_dict)
        return original(self, state_dict, *args, **kwargs)

    replace(paddle.optimizer.Optimizer, "set_state_dict", set_state_dict,
            "a full optimizer state loads as this rank's rows of it; other shapes refused")


def adopt_built_before_sharding(optimizer: paddle.optimizer.Optimizer) -> None:
    """An optimizer built before fully_shard takes the shards (said once)."""
    swapped = adopt_shards(optimizer)
    if swapped and not getattr(optimizer, "_hsdp_adopted_said", False):
        logger.info("paddle_hsdp: the optimizer was built before fully_shard; its %d "
                    "sharded parameters (e.g. '%s') now are this rank's shards",
                    len(swapped), swapped[0])
        optimizer._hsdp_adopted_said = True


def _patch_grad_scaler() -> None:
    """AMP: ``GradScaler._unscale`` reads the grads before ``step`` reaches
    ``_apply_optimize``, so the deferred sync runs first; and since each rank holds other
    shards, ``found_inf`` is OR-ed over the job so every rank skips the same steps."""
    original = AmpScaler._unscale

    @functools.wraps(original)
    def _unscale(self: AmpScaler, optimizer: paddle.optimizer.Optimizer) -> Any:
        params = sharded_params_of(getattr(optimizer, "_inner_opt", optimizer))
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
    _patch_every_optimizer_class()
    for cls in not_elementwise_classes():  # refused at their step (incubate's too)
        _wrap_steps_of(cls)
    _patch_clear_grad()
    _patch_set_state_dict()
    _patch_grad_scaler()
    _patch_hybrid_parallel_optimizer()
    _installed = True
