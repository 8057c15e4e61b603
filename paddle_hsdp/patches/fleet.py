"""Fleet: the ``fsdp_outer_degree`` / ``fsdp_outer_sharding`` strategy options,
``fleet.init``, the HCG's HSDP methods, and parameter broadcasts that skip HSDP shards.

What it patches, and why:

* ``DistributedStrategy.hybrid_configs`` (setter): Paddle 3.3 rejects a nested
  ``sharding_configs`` dict carrying ``fsdp_outer_degree``; the options are kept aside
  (skipped where Paddle knows the option natively);
* ``Fleet.init``: validates the option on every rank before any group exists;
  ``Fleet._init_hybrid_parallel_env``: after Paddle built its HCG, creates every inner
  and outer group (:func:`paddle_hsdp.topology.fleet.build_hsdp_groups`);
  ``paddle.distributed.fleet.init``, the module alias bound before the patch;
* ``HybridCommunicateGroup.get_fsdp_group / get_fsdp_inner_group /
  get_fsdp_outer_group / get_fsdp_outer_degree / get_fsdp_outer_sharding``: added
  (Paddle has none);
* ``sync_params_buffers`` (``paddle.distributed.parallel`` and fleet's
  ``hybrid_parallel_util``): see :func:`_patch_param_broadcasts`;
* ``fused_allreduce_gradients_with_group`` (``hybrid_parallel_util``, and the copy
  ``sequence_parallel_utils`` imported): see :func:`_patch_fused_grad_allreduces`.

Where a Paddle build already provides HSDP groups natively, only the broadcast and
all-reduce guards are installed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any, Iterable, cast

import paddle.distributed.fleet as fleet_pkg
import paddle.distributed.parallel as parallel
from paddle.distributed.fleet.base.distributed_strategy import (DistributedStrategy,
                                                                assign_configs_value)
from paddle.distributed.fleet.base.topology import HybridCommunicateGroup
from paddle.distributed.fleet.fleet import Fleet
from paddle.distributed.fleet.proto import distributed_strategy_pb2 as pb
from paddle.distributed.fleet.utils import hybrid_parallel_util as util
from paddle.distributed.fleet.utils import sequence_parallel_utils

from ..engine.policies import MixedPrecisionPolicy, outer_sync_policy_from
from ..engine.registry import managed_param
from ..topology.fleet import (HCG_METHODS, OPTION, OUTER_SYNC_OPTIONS, SHARDING_OPTION,
                              build_hsdp_groups,
                              check_sharding_config_keys, get_fsdp_outer_degree,
                              get_fsdp_outer_sharding, validate_strategy)
from . import sequence_parallel
from .patching import replace

if TYPE_CHECKING:
    import paddle
    from paddle.distributed.fleet.base.role_maker import RoleMakerBase

    from ..topology.fleet import HSDPDistributedStrategy

logger = logging.getLogger(__name__)
_installed = False


# ---------------------------------------------------------------- strategy option
def _strategy_knows_option_natively(strategy_cls: type[DistributedStrategy]) -> bool:
    return OPTION in pb.ShardingConfig.DESCRIPTOR.fields_by_name if hasattr(
        pb, "ShardingConfig") else False


def _patch_strategy(strategy_cls: type[DistributedStrategy]) -> None:
    original = inspect.getattr_static(strategy_cls, "hybrid_configs")
    if not isinstance(original, property) or original.fset is None:
        raise TypeError(f"paddle_hsdp: {strategy_cls.__name__}.hybrid_configs is not the "
                        "settable property paddle_hsdp extends; this Paddle is not supported")
    original_set = original.fset

    def set_hybrid_configs(self: DistributedStrategy, configs: dict) -> None:
        configs = dict(configs)
        sharding = configs.pop("sharding_configs", None)
        if sharding is not None:
            sharding = dict(sharding)
            check_sharding_config_keys(sharding, self.strategy.hybrid_configs.sharding_configs)
            if OPTION in sharding:
                # Stored as given: validation (with the group sizes) runs in fleet.init.
                self._hsdp_fsdp_outer_degree = sharding.pop(OPTION)
            if SHARDING_OPTION in sharding:
                self._hsdp_fsdp_outer_sharding = sharding.pop(SHARDING_OPTION)
            given = {key: sharding.pop(key) for key in OUTER_SYNC_OPTIONS if key in sharding}
            if given:
                self._hsdp_outer_policies = outer_policies_of(given)
            assign_configs_value(self.strategy.hybrid_configs.sharding_configs, sharding)
        original_set(self, configs)

    # class default; also unlocks the attribute
    replace(strategy_cls, "_hsdp_fsdp_outer_degree", 1, "the option's default: plain FSDP")
    replace(strategy_cls, "_hsdp_fsdp_outer_sharding", "none",
            "the option's default: HSDP (optimizer state replicated across outer)")
    replace(strategy_cls, "_hsdp_outer_policies", (None, None),
            "the outer sync's default: uncompressed, every step")
    replace(strategy_cls, "hybrid_configs",
            property(original.fget, set_hybrid_configs, None, original.__doc__),
            "Paddle 3.3 rejects fsdp_outer_degree inside sharding_configs; kept aside")


def outer_policies_of(given: dict) -> tuple:
    """``sharding_configs``' outer-sync keys (:data:`OUTER_SYNC_OPTIONS`, the config
    file's names) as ``(MixedPrecisionPolicy | None, OuterSyncPolicy | None)``, checked
    where the strategy is assigned: on every rank, before ``fleet.init``."""
    try:
        compress = given.get("fsdp_outer_compress")
        mp = None if compress is None else MixedPrecisionPolicy(
            outer_compress=compress,
            outer_compress_block=given.get("fsdp_outer_compress_block", 256))
        every = given.get("fsdp_outer_sync_every", 1)
        if every == 1 and given.get("fsdp_outer_optimizer") is not None:
            raise ValueError("fsdp_outer_optimizer is unused with fsdp_outer_sync_every 1 "
                             "(plain HSDP); set fsdp_outer_sync_every >= 2 or drop it")
        outer = outer_sync_policy_from(every, given.get("fsdp_outer_optimizer"),
                                       given.get("fsdp_outer_sync_fragments", 1))
    except (TypeError, ValueError) as error:
        raise ValueError(f"hybrid_configs['sharding_configs'] {sorted(given)}: {error}"
                         ) from None
    return mp, (outer if outer.trains_apart else None)


# ---------------------------------------------------------------- fleet.init and the HCG
def _patch_fleet(fleet_cls: type[Fleet]) -> None:
    original_init = fleet_cls.init
    original_env = fleet_cls._init_hybrid_parallel_env

    @functools.wraps(original_init)
    def init(self: Fleet, role_maker: RoleMakerBase | None = None, is_collective: bool = False,
             strategy: HSDPDistributedStrategy | None = None, *args: Any,
             **kwargs: Any) -> Any:
        if strategy is not None:
            validate_strategy(strategy)  # every rank, before any group exists
        return original_init(self, role_maker, is_collective, strategy, *args, **kwargs)

    @functools.wraps(original_env)
    def init_hybrid_parallel_env(self: Fleet) -> None:
        original_env(self)
        # (the class _patch_strategy extended, or one that knows the options natively)
        strategy = cast("HSDPDistributedStrategy", self._user_defined_strategy)
        self._hcg._hsdp_groups = build_hsdp_groups(self._hcg, get_fsdp_outer_degree(strategy),
                                                   get_fsdp_outer_sharding(strategy))
        self._hcg._hsdp_groups.outer_policies = getattr(strategy, "_hsdp_outer_policies",
                                                        (None, None))

    replace(fleet_cls, "init", init, "validate fsdp_outer_degree on every rank before any group")
    replace(fleet_cls, "_init_hybrid_parallel_env", init_hybrid_parallel_env,
            "create every HSDP inner/outer group after Paddle's HCG")


# ---------------------------------------------------------------- fleet.distributed_model
class _WithoutHSDPParams:
    """A view of a model for Paddle's parameter broadcasts that hides HSDP-managed
    parameters (shards, and full params gathered at the moment)."""

    def __init__(self, model: paddle.nn.Layer) -> None:
        self._model = model

    def _obtain_parameters_buffers(self) -> dict:
        return {k: v for k, v in self._model._obtain_parameters_buffers().items()
                if managed_param(v) is None}


def _patch_param_broadcasts() -> None:
    """``fleet.distributed_model`` (ShardingParallel, TensorParallel, ...) and
    ``paddle.DataParallel`` broadcast every parameter from one rank of a group through
    ``sync_params_buffers``. On HSDP shards that would overwrite every rank's block with
    the source rank's; HSDP makes its own replicas identical when it shards. So the
    broadcasts skip managed parameters and still sync everything else, and
    ``model = fleet.distributed_model(model)`` works before or after ``fully_shard``."""
    original = parallel.sync_params_buffers

    @functools.wraps(original)
    def sync_params_buffers(model: paddle.nn.Layer, *args: Any, **kwargs: Any) -> Any:
        return original(_WithoutHSDPParams(model), *args, **kwargs)

    why = "parameter broadcasts skip HSDP shards (they would overwrite other ranks' blocks)"
    replace(parallel, "sync_params_buffers", sync_params_buffers, why)
    replace(util, "sync_params_buffers", sync_params_buffers, why)


def _patch_fused_grad_allreduces() -> None:
    """Paddle's fused gradient all-reduce (``fused_allreduce_gradients`` and
    ``fused_allreduce_gradients_with_group`` in ``hybrid_parallel_util``) sums every
    listed parameter's grad over a data-parallel group. PaddleFormers' Trainer calls it
    with ``list(model.parameters())`` whenever the model has ``no_sync`` (gradient
    accumulation, recompute), as Paddle's own DataParallel recipe does. On HSDP shards
    it would sum different row blocks of different ranks; HSDP reduces their grads
    itself. So it skips managed parameters and still reduces everything else (over the
    tensor-parallel group, where every rank holds the same shards, their grads are
    summed: :func:`.sequence_parallel.sum_shard_grads`). Which
    parameters are managed depends only on the model's structure, so every rank drops
    the same ones and the remaining collectives still match."""
    original = util.fused_allreduce_gradients_with_group

    @functools.wraps(original)
    def fused_allreduce_gradients_with_group(parameter_list: Iterable[paddle.Tensor], *args: Any,
                                             **kwargs: Any) -> Any:
        params = list(parameter_list)
        kept = [p for p in params if managed_param(p) is None]
        group = kwargs.get("group", args[0] if args else None)
        if len(kept) < len(params) and sequence_parallel.is_mp_group(group):
            # sequence parallel's sum over mp (PaddleFormers' SPGradSyncCallback): every
            # mp rank holds the same shards, so their grads are summed, after the sync
            scale = kwargs.get("scale", args[2] if len(args) > 2 else None)
            sequence_parallel.sum_shard_grads([p for p in params if managed_param(p)], group,
                                              1.0 / group.nranks if scale is None else scale)
        return original(kept, *args, **kwargs)

    why = "fused gradient all-reduces skip HSDP shards (they would sum other ranks' blocks)"
    # fused_allreduce_gradients looks this name up in util at call time; sequence
    # parallelism's helper bound it at import
    replace(util, "fused_allreduce_gradients_with_group", fused_allreduce_gradients_with_group,
            why)
    replace(sequence_parallel_utils, "fused_allreduce_gradients_with_group",
            fused_allreduce_gradients_with_group, why)


def install() -> None:
    """Apply the fleet extensions once; skip any piece Paddle already provides."""
    global _installed
    if _installed:
        return
    _patch_param_broadcasts()
    _patch_fused_grad_allreduces()
    if hasattr(HybridCommunicateGroup, "get_fsdp_inner_group"):
        logger.info("paddle_hsdp: this Paddle provides HSDP groups natively; deferring to it.")
        _installed = True
        return
    if not _strategy_knows_option_natively(DistributedStrategy):
        _patch_strategy(DistributedStrategy)
    _patch_fleet(Fleet)
    # ``fleet.init`` is a module-level alias bound to the singleton before we patched.
    replace(fleet_pkg, "init", fleet_pkg.fleet.init,
            "the module alias was bound to the singleton's init before the patch")
    for name, method in HCG_METHODS.items():
        replace(HybridCommunicateGroup, name, method, "the HCG's HSDP groups (Paddle has none)")
    _installed = True
