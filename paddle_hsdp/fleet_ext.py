"""Teach fleet the ``fsdp_outer_degree`` option and give the HCG its HSDP groups.

``import paddle_hsdp`` calls :func:`install`, which

* lets ``strategy.hybrid_configs = {..., "sharding_configs": {"fsdp_outer_degree": O}}``
  through (Paddle 3.3 rejects a nested ``sharding_configs`` dict and knows no such key);
* validates the option on every rank inside ``fleet.init`` before any group exists;
* after Paddle has built its HCG, creates every inner and outer group of every FSDP
  group on every rank, in the one global order of :func:`topology.plan_hsdp_layout`;
* adds ``get_fsdp_group / get_fsdp_inner_group / get_fsdp_outer_group(is_expert)`` and
  ``get_fsdp_outer_degree()`` to ``HybridCommunicateGroup``.

Where a Paddle build already knows the option natively, each step defers to it.
"""

from __future__ import annotations

import functools
import itertools
import logging

from . import topology

logger = logging.getLogger(__name__)

OPTION = "fsdp_outer_degree"
MOE_ORDER_HINT = ["dp", "pp", "moe_sharding", "ep", "sharding", "sep", "cp", "mp"]
_installed = False


# ---------------------------------------------------------------- strategy option
def _strategy_knows_option_natively(strategy_cls) -> bool:
    from paddle.distributed.fleet.proto import distributed_strategy_pb2 as pb

    return OPTION in pb.ShardingConfig.DESCRIPTOR.fields_by_name if hasattr(
        pb, "ShardingConfig") else False


def get_fsdp_outer_degree(strategy) -> int:
    """The ``fsdp_outer_degree`` a strategy carries (1, plain FSDP, when unset)."""
    native = getattr(strategy.strategy.hybrid_configs.sharding_configs, OPTION, None)
    return native if native is not None else strategy._hsdp_fsdp_outer_degree


def _patch_strategy(strategy_cls) -> None:
    from paddle.distributed.fleet.base.distributed_strategy import assign_configs_value

    original = strategy_cls.hybrid_configs

    def set_hybrid_configs(self, configs):
        configs = dict(configs)
        sharding = configs.pop("sharding_configs", None)
        if sharding is not None:
            sharding = dict(sharding)
            if OPTION in sharding:
                # Stored as given: validation (with the group sizes) runs in fleet.init.
                self._hsdp_fsdp_outer_degree = sharding.pop(OPTION)
            assign_configs_value(self.strategy.hybrid_configs.sharding_configs, sharding)
        original.fset(self, configs)

    strategy_cls._hsdp_fsdp_outer_degree = 1  # class default; also unlocks the attribute
    strategy_cls.hybrid_configs = property(original.fget, set_hybrid_configs, None,
                                           original.__doc__)


# ---------------------------------------------------------------- validation
def validate_strategy(strategy) -> int:
    """Check the HSDP option of a strategy before any group is created; return O."""
    degree = get_fsdp_outer_degree(strategy)
    if degree != 1 and (getattr(strategy, "semi_auto", False) or getattr(strategy, "auto", False)):
        raise NotImplementedError(
            f"sharding_configs['{OPTION}']={degree} is not supported in Paddle's "
            "auto-parallel mode (strategy.auto / strategy.semi_auto); use manual hybrid "
            "parallel (fleet.init(is_collective=True, strategy=...)) or set it to 1."
        )
    hc = strategy.hybrid_configs
    sizes = {"dense": max(hc["sharding_degree"], 1)}
    if max(hc["ep_degree"], 1) > 1:
        order = list(strategy.hybrid_parallel_order)
        if "moe_sharding" not in order or "ep" not in order:
            raise ValueError(
                f"ep_degree={hc['ep_degree']} needs strategy.hybrid_parallel_order to name "
                f"'moe_sharding' and 'ep' (Paddle ignores ep_degree otherwise), got {order}; "
                f"set e.g. strategy.hybrid_parallel_order = {MOE_ORDER_HINT}."
            )
        sizes["expert"] = max(hc["moe_sharding_degree"], 1)
    return topology.validate_outer_degree(degree, sizes)


# ---------------------------------------------------------------- groups
def fsdp_rank_lists(hcg) -> tuple[list[list[int]], list[list[int]] | None]:
    """All dense FSDP groups of the job and all expert ones (None: same as dense)."""
    if hasattr(hcg, "_moe_topo"):  # EPHybridCommunicateGroup (ep_degree > 1)
        dense = hcg.merge_inner_comm_list(hcg._dense_topo, "moe_sharding", "dense_sharding")
        return dense, hcg._moe_topo.get_comm_list("moe_sharding")
    return hcg._topo.get_comm_list("sharding"), None


class HSDPGroups:
    """What the HCG answers for HSDP on this rank."""

    def __init__(self, layout: topology.HSDPLayout, groups: dict, fsdp_dense, fsdp_expert):
        self.layout = layout
        self.outer_degree = layout.outer_degree
        self._groups = groups  # member tuple -> paddle Group
        self._fsdp = {False: fsdp_dense, True: fsdp_expert}

    def fsdp(self, is_expert: bool):
        return self._fsdp[bool(is_expert)]

    def inner(self, rank: int, is_expert: bool):
        return self._groups[self.layout.groups_of(rank, is_expert).inner]

    def outer(self, rank: int, is_expert: bool):
        return self._groups[self.layout.groups_of(rank, is_expert).outer]


def build_hsdp_groups(hcg, outer_degree: int) -> HSDPGroups:
    """Create every inner/outer group on every rank in one global order; keep ours."""
    import paddle.distributed as dist

    from . import comm

    dense_lists, expert_lists = fsdp_rank_lists(hcg)
    layout = topology.plan_hsdp_layout(dense_lists, expert_lists, outer_degree)
    rank = dist.get_rank()
    fsdp_dense = _usable(hcg.get_sharding_parallel_group(), rank)
    fsdp_expert = (_usable(hcg.get_moe_sharding_parallel_group(), rank)
                   if expert_lists is not None else fsdp_dense)
    # Paddle's HCG already made every FSDP group on every rank. Skip *all* of them (not
    # only this rank's) so that every rank makes the same sequence of new_group calls
    # and group ids stay consistent; this rank's own FSDP groups are reused.
    fsdp_tuples = {tuple(g) for g in dense_lists} | {tuple(g) for g in (expert_lists or ())}
    existing = {tuple(g.ranks): g for g in (fsdp_dense, fsdp_expert)}
    groups = {}
    for members in layout.creation_order:
        if len(members) == 1:
            # Paddle gives one-rank groups rank -1 (and sometimes nranks -1); a local
            # Group object is what a one-rank group should be (no communicator needed).
            if members[0] == rank:
                groups[members] = _single_rank_group(rank)
            continue
        if members in fsdp_tuples:
            if members in existing:
                groups[members] = existing[members]
            continue
        groups[members] = dist.new_group(list(members))
    for is_expert in (False, True):
        mine = layout.groups_of(rank, is_expert)
        comm.name_group(groups[mine.inner], "expert_inner" if is_expert else "inner")
        comm.name_group(groups[mine.outer], "outer")
    logger.info("HSDP: %d groups created for fsdp_outer_degree=%d", len(groups), outer_degree)
    return HSDPGroups(layout, groups, fsdp_dense, fsdp_expert)


_single_ids = itertools.count(1)


def _usable(group, rank: int):
    """Paddle's one-rank HCG groups report rank -1: replace them by a local group whose
    rank is 0, so code that asks "am I rank 0 of this group" gets the right answer
    (sharding_degree=1: one process, or tensor parallelism without sharding)."""
    return _single_rank_group(rank) if group.nranks == 1 else group


def _single_rank_group(rank: int):
    from paddle.distributed.communication.group import Group

    # Negative ids never clash with Paddle's ring ids (which count up from 0); a fresh
    # id per group keeps the comm counter's labels (keyed by id) apart.
    gid = -next(_single_ids)
    return Group(0, gid, [rank], pg=None, name=f"hsdp_single_{rank}_{-gid}")


# ---------------------------------------------------------------- HCG methods
def _hsdp_of(hcg) -> HSDPGroups:
    hsdp = getattr(hcg, "_hsdp_groups", None)
    if hsdp is None:
        raise RuntimeError(
            "This HybridCommunicateGroup has no HSDP groups: `import paddle_hsdp` before "
            "calling fleet.init(is_collective=True, strategy=...)."
        )
    return hsdp


def _get_fsdp_group(self, is_expert: bool = False):
    """The FSDP group: sharding for dense params, moe_sharding for experts when EP > 1."""
    return _hsdp_of(self).fsdp(is_expert)


def _get_fsdp_inner_group(self, is_expert: bool = False):
    """The ranks that shard a buffer between them (one row of ``[outer, inner]``)."""
    return _hsdp_of(self).inner(self.global_rank, is_expert)


def _get_fsdp_outer_group(self, is_expert: bool = False):
    """The replicas of this rank's shard (one column of ``[outer, inner]``)."""
    return _hsdp_of(self).outer(self.global_rank, is_expert)


def _get_fsdp_outer_degree(self) -> int:
    return _hsdp_of(self).outer_degree


def _patch_fleet(fleet_cls) -> None:
    original_init = fleet_cls.init
    original_env = fleet_cls._init_hybrid_parallel_env

    @functools.wraps(original_init)
    def init(self, role_maker=None, is_collective=False, strategy=None, *args, **kwargs):
        if strategy is not None:
            validate_strategy(strategy)  # every rank, before any group exists
        return original_init(self, role_maker, is_collective, strategy, *args, **kwargs)

    @functools.wraps(original_env)
    def init_hybrid_parallel_env(self):
        original_env(self)
        degree = get_fsdp_outer_degree(self._user_defined_strategy)
        self._hcg._hsdp_groups = build_hsdp_groups(self._hcg, degree)

    fleet_cls.init = init
    fleet_cls._init_hybrid_parallel_env = init_hybrid_parallel_env


# ---------------------------------------------------------------- fleet.distributed_model
class _WithoutHSDPParams:
    """A view of a model for Paddle's parameter broadcasts that hides HSDP-managed
    parameters (shards, and full params gathered at the moment)."""

    def __init__(self, model):
        self._model = model

    def _obtain_parameters_buffers(self):
        from .api import managed_param

        return {k: v for k, v in self._model._obtain_parameters_buffers().items()
                if managed_param(v) is None}


def _patch_param_broadcasts() -> None:
    """``fleet.distributed_model`` (ShardingParallel, TensorParallel, ...) and
    ``paddle.DataParallel`` broadcast every parameter from one rank of a group through
    ``sync_params_buffers``. On HSDP shards that would overwrite every rank's block with
    the source rank's; HSDP makes its own replicas identical when it shards. So the
    broadcasts skip managed parameters and still sync everything else, and
    ``model = fleet.distributed_model(model)`` works before or after ``fully_shard``."""
    import paddle.distributed.parallel as parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util as util

    original = parallel.sync_params_buffers

    @functools.wraps(original)
    def sync_params_buffers(model, *args, **kwargs):
        return original(_WithoutHSDPParams(model), *args, **kwargs)

    parallel.sync_params_buffers = sync_params_buffers
    util.sync_params_buffers = sync_params_buffers


def install() -> None:
    """Apply the fleet extensions once; skip any piece Paddle already provides."""
    global _installed
    if _installed:
        return
    import paddle.distributed.fleet as fleet_pkg
    from paddle.distributed.fleet.base.distributed_strategy import DistributedStrategy
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup
    from paddle.distributed.fleet.fleet import Fleet

    _patch_param_broadcasts()
    if hasattr(HybridCommunicateGroup, "get_fsdp_inner_group"):
        logger.info("paddle_hsdp: this Paddle provides HSDP groups natively; deferring to it.")
        _installed = True
        return
    if not _strategy_knows_option_natively(DistributedStrategy):
        _patch_strategy(DistributedStrategy)
    _patch_fleet(Fleet)
    # ``fleet.init`` is a module-level alias bound to the singleton before we patched.
    fleet_pkg.init = fleet_pkg.fleet.init
    HybridCommunicateGroup.get_fsdp_group = _get_fsdp_group
    HybridCommunicateGroup.get_fsdp_inner_group = _get_fsdp_inner_group
    HybridCommunicateGroup.get_fsdp_outer_group = _get_fsdp_outer_group
    HybridCommunicateGroup.get_fsdp_outer_degree = _get_fsdp_outer_degree
    _installed = True
