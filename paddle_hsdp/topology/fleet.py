"""The ``fsdp_outer_degree`` and ``fsdp_outer_sharding`` options of fleet's strategy and
the HCG's HSDP groups.

What this module computes; :mod:`paddle_hsdp.patches.fleet` installs it into Paddle's
classes. ``import paddle_hsdp``

* lets ``strategy.hybrid_configs = {..., "sharding_configs": {"fsdp_outer_degree": O,
  "fsdp_outer_sharding": "optim"}}`` through (Paddle 3.3 rejects a nested
  ``sharding_configs`` dict and knows no such keys);
* validates the option on every rank inside ``fleet.init`` before any group exists;
* after Paddle has built its HCG, creates every inner and outer group of every FSDP
  group on every rank, in the one global order of
  :func:`~paddle_hsdp.topology.layout.plan_hsdp_layout`;
* adds ``get_fsdp_group / get_fsdp_inner_group / get_fsdp_outer_group(is_expert)``,
  ``get_fsdp_outer_degree()`` and ``get_fsdp_outer_sharding()`` to
  ``HybridCommunicateGroup``.

Where a Paddle build already knows the option natively, each step defers to it.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING, Any, cast

import paddle.distributed as dist
from paddle.distributed.communication.group import Group

from ..comm import collectives as comm
from ..hints import did_you_mean
from . import layout as topology

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from paddle.distributed.fleet.base.distributed_strategy import DistributedStrategy
    from paddle.distributed.fleet.base.topology import (EPHybridCommunicateGroup,
                                                        HybridCommunicateGroup)

    class HSDPDistributedStrategy(DistributedStrategy):
        """fleet's strategy as ``import paddle_hsdp`` extends it (patches/fleet.py): the
        options kept aside where Paddle does not know them. For types only."""

        _hsdp_fsdp_outer_degree: int  # as given: validate_strategy checks them
        _hsdp_fsdp_outer_sharding: str

    class HSDPHybridCommunicateGroup(HybridCommunicateGroup):
        """fleet's HCG as ``import paddle_hsdp`` extends it: the methods below (their
        bodies are at the end of this module; patches/fleet.py installs them) and the
        HSDP groups ``fleet.init`` builds. For types only."""

        _hsdp_groups: HSDPGroups

        def get_fsdp_group(self, is_expert: bool = False) -> Group: ...
        def get_fsdp_inner_group(self, is_expert: bool = False) -> Group: ...
        def get_fsdp_outer_group(self, is_expert: bool = False) -> Group: ...
        def get_fsdp_outer_degree(self) -> int: ...
        def get_fsdp_outer_sharding(self) -> str: ...

logger = logging.getLogger(__name__)

OPTION = "fsdp_outer_degree"
# "none": HSDP (each outer replica keeps its inner shard's optimizer state); "optim":
# HFSDP (the optimizer state is sharded across the outer group too; docs/engine.md)
SHARDING_OPTION = "fsdp_outer_sharding"
OUTER_SHARDING_VALUES = ("none", "optim")
# The outer sync's keys (the config file's names; patches/fleet.py turns them into the
# policies fully_shard takes when it is given none: engine/policies.py)
OUTER_SYNC_OPTIONS = ("fsdp_outer_compress", "fsdp_outer_compress_block",
                      "fsdp_outer_sync_every", "fsdp_outer_optimizer",
                      "fsdp_outer_sync_fragments")
# Every key paddle_hsdp adds to fleet's sharding_configs (Paddle's own come from its
# strategy definition at run time).
HSDP_OPTIONS = (OPTION, SHARDING_OPTION, *OUTER_SYNC_OPTIONS)
MOE_ORDER_HINT = ["dp", "pp", "moe_sharding", "ep", "sharding", "sep", "cp", "mp"]


# ---------------------------------------------------------------- strategy option
def get_fsdp_outer_degree(strategy: HSDPDistributedStrategy) -> int:
    """The ``fsdp_outer_degree`` a strategy carries (1, plain FSDP, when unset)."""
    native = getattr(strategy.strategy.hybrid_configs.sharding_configs, OPTION, None)
    return native if native is not None else strategy._hsdp_fsdp_outer_degree


def get_fsdp_outer_sharding(strategy: HSDPDistributedStrategy) -> str:
    """The ``fsdp_outer_sharding`` a strategy carries ("none", HSDP, when unset)."""
    native = getattr(strategy.strategy.hybrid_configs.sharding_configs, SHARDING_OPTION,
                     None)
    return native if native is not None else strategy._hsdp_fsdp_outer_sharding


def validate_outer_sharding(value: object) -> str:
    """``fsdp_outer_sharding`` must be "none" or "optim" (with outer degree 1 both are
    plain FSDP: there is no outer group to shard across)."""
    if isinstance(value, str) and value in OUTER_SHARDING_VALUES:
        return value
    raise ValueError(
        f"sharding_configs['{SHARDING_OPTION}'] must be 'none' (HSDP: every outer replica "
        "keeps the optimizer state of its inner shard) or 'optim' (HFSDP: the optimizer "
        f"state is sharded across the outer group too), got {value!r} "
        f"({type(value).__name__})")


# ---------------------------------------------------------------- validation
def check_sharding_config_keys(config: dict, paddle_message: Message) -> None:
    """Refuse a ``sharding_configs`` key that is neither Paddle's (a field of
    ``paddle_message``, its ``DygraphShardingConfig``) nor paddle_hsdp's: Paddle
    silently drops unknown keys, so a typo of ``fsdp_outer_degree`` would train as
    pure FSDP across every machine. Raised where the strategy is assigned, so on every
    rank and before ``fleet.init`` creates any group."""
    paddle_keys = list(paddle_message.DESCRIPTOR.fields_by_name)
    valid = list(HSDP_OPTIONS) + paddle_keys
    unknown = [key for key in config if key not in valid]
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"hybrid_configs['sharding_configs'] has an unknown key {key!r}"
            f"{did_you_mean(key, valid)} paddle_hsdp's keys: {', '.join(HSDP_OPTIONS)}; "
            f"Paddle's ({type(paddle_message).__name__}): {', '.join(paddle_keys)} "
            "(docs/topology.md lists them)."
            + (f" Also unknown: {', '.join(map(repr, unknown[1:]))}." if unknown[1:] else ""))


def validate_strategy(strategy: HSDPDistributedStrategy) -> int:
    """Check the HSDP option of a strategy before any group is created; return O."""
    degree = get_fsdp_outer_degree(strategy)
    validate_outer_sharding(get_fsdp_outer_sharding(strategy))
    if degree != 1 and (getattr(strategy, "semi_auto", False) or getattr(strategy, "auto", False)):
        raise NotImplementedError(
            f"sharding_configs['{OPTION}']={degree} is not supported in Paddle's "
            "auto-parallel mode (strategy.auto / strategy.semi_auto); use manual hybrid "
            "parallel (fleet.init(is_collective=True, strategy=...)) or set it to 1."
        )
    # (Paddle's TypedDict of hybrid_configs lacks the MoE degrees its proto has)
    hc = cast("dict[str, Any]", strategy.hybrid_configs)
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
def fsdp_rank_lists(hcg: HybridCommunicateGroup,
                    ) -> tuple[list[list[int]], list[list[int]] | None]:
    """All dense FSDP groups of the job and all expert ones (None: same as dense)."""
    if hasattr(hcg, "_moe_topo"):  # EPHybridCommunicateGroup (ep_degree > 1)
        ep = cast("EPHybridCommunicateGroup", hcg)
        dense = ep.merge_inner_comm_list(ep._dense_topo, "moe_sharding", "dense_sharding")
        return dense, ep._moe_topo.get_comm_list("moe_sharding")
    return hcg._topo.get_comm_list("sharding"), None


class HSDPGroups:
    """What the HCG answers for HSDP on this rank."""

    def __init__(self, layout: topology.HSDPLayout, groups: dict[topology.Ranks, Group],
                 fsdp_dense: Group, fsdp_expert: Group,
                 reduce_scatter_twins: dict[topology.Ranks, Group] | None = None,
                 outer_sharding: str = "none") -> None:
        self.layout = layout
        self.outer_degree = layout.outer_degree
        self.outer_sharding = outer_sharding
        self._groups = groups  # member tuple -> paddle Group
        self._fsdp = {False: fsdp_dense, True: fsdp_expert}
        self._twins = reduce_scatter_twins or {}  # inner member tuple -> its twin
        # set by paddle_hsdp.ft: the outer group across replicas
        self.live_outer: Group | None = None
        # set by paddle_hsdp.ft: the segments every group lays a buffer out over
        # (engine/layout.py, [Note: the layout degree]); None: the inner degree
        self.layout_degree: int | None = None
        # sharding_configs' outer-sync keys as policies (MixedPrecisionPolicy | None,
        # OuterSyncPolicy | None): what fully_shard uses when given none
        self.outer_policies: tuple = (None, None)

    def fsdp(self, is_expert: bool) -> Group:
        return self._fsdp[bool(is_expert)]

    def inner(self, rank: int, is_expert: bool) -> Group:
        return self._groups[self.layout.groups_of(rank, is_expert).inner]

    def outer(self, rank: int, is_expert: bool) -> Group:
        if self.live_outer is not None:
            return self.live_outer
        return self._groups[self.layout.groups_of(rank, is_expert).outer]

    def use_live_outer(self, group: Group) -> None:
        """A fault-tolerant job (paddle_hsdp.ft): ``group`` is this rank's outer group for
        dense and expert buffers alike, across replica groups (fleet's outer degree is 1)."""
        self.live_outer = group

    def use_layout_degree(self, degree: int | None) -> None:
        """A fault-tolerant job whose groups may differ in size: every buffer sharded
        from now on is laid out as a ``degree``-rank group lays it out, so the groups'
        flat buffers are identical (engine/layout.py, [Note: the layout degree])."""
        self.layout_degree = degree

    def reduce_scatter(self, rank: int, is_expert: bool) -> Group:
        """The group inner reduce-scatters run on: the inner group's twin where one was
        made (:func:`separate_reduce_scatter`), else the inner group itself."""
        members = self.layout.groups_of(rank, is_expert).inner
        return self._twins.get(members) or self._groups[members]


SEPARATE_REDUCE_SCATTER_ENV = "PADDLE_HSDP_SEPARATE_REDUCE_SCATTER"


def separate_reduce_scatter(on_gloo: bool) -> bool:
    """Whether each inner group gets a twin with the same ranks for its reduce-scatters.

    On NCCL every process group has its own communication stream, so the twin lets a
    backward prefetch all-gather run beside the previous unit's reduce-scatter instead
    of queueing behind it on one stream (torch FSDP2 gives them separate streams). On
    gloo a collective is done when it returns, so a twin buys nothing and costs a
    communicator: none, unless ``PADDLE_HSDP_SEPARATE_REDUCE_SCATTER=1`` (the tests force
    the NCCL arrangement on CPU with it; ``0`` turns it off on NCCL).
    """
    value = os.environ.get(SEPARATE_REDUCE_SCATTER_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SEPARATE_REDUCE_SCATTER_ENV} must be 0 or 1, got {value!r}")
    return value == "1" if value else not on_gloo


def inner_rows(layout: topology.HSDPLayout) -> list[topology.Ranks]:
    """Every inner group of the job with more than one rank (dense, then expert), each
    once, in an order every rank computes alike."""
    rows: list[topology.Ranks] = []
    seen: set[topology.Ranks] = set()  # beside the list: O(ranks), not ranks x rows
    for groups in (layout.dense, layout.expert):
        for rank in sorted(groups):
            members = groups[rank].inner
            if len(members) > 1 and members not in seen:
                seen.add(members)
                rows.append(members)
    return rows


def build_hsdp_groups(hcg: HybridCommunicateGroup, outer_degree: int,
                      outer_sharding: str = "none") -> HSDPGroups:
    """Create every inner/outer group on every rank in one global order; keep ours."""
    dense_lists, expert_lists = fsdp_rank_lists(hcg)
    layout = topology.plan_hsdp_layout(dense_lists, expert_lists, outer_degree)
    rank = dist.get_rank()
    fsdp_dense = _usable(hcg.get_sharding_parallel_group(), rank)
    fsdp_expert = (_usable(cast("EPHybridCommunicateGroup", hcg).get_moe_sharding_parallel_group(),
                           rank)
                   if expert_lists is not None else fsdp_dense)  # (expert lists: an EP HCG)
    # Paddle's HCG already made every FSDP group on every rank. Skip *all* of them (not
    # only this rank's) so that every rank makes the same sequence of new_group calls
    # and group ids stay consistent; this rank's own FSDP groups are reused.
    fsdp_tuples = {tuple(g) for g in dense_lists} | {tuple(g) for g in (expert_lists or ())}
    existing = {tuple(g.ranks): g for g in (fsdp_dense, fsdp_expert)}
    groups: dict[topology.Ranks, Group] = {}
    for members in layout.creation_order:
        if len(members) == 1:
            # Paddle gives one-rank groups rank -1 (and sometimes nranks -1); a local
            # Group object is what a one-rank group should be (no communicator needed).
            if members[0] == rank:
                groups[members] = single_rank_group(rank)
            continue
        if members in fsdp_tuples:
            if members in existing:
                groups[members] = existing[members]
            continue
        groups[members] = dist.new_group(list(members))
    twins: dict[topology.Ranks, Group] = {}
    if separate_reduce_scatter(comm.is_gloo(fsdp_dense)):
        # after every other group, in one global order: ids stay consistent across ranks
        for members in inner_rows(layout):
            twins[members] = dist.new_group(list(members))
    for is_expert in (False, True):
        mine = layout.groups_of(rank, is_expert)
        label = "expert_inner" if is_expert else "inner"
        comm.name_group(groups[mine.inner], label)
        if mine.inner in twins:  # its traffic is the inner group's, for the counter
            comm.name_group(twins[mine.inner], label)
        comm.name_group(groups[mine.outer], "outer")
    logger.info("HSDP: %d groups (%d reduce-scatter twins) created for fsdp_outer_degree=%d",
                len(groups) + len(twins), len(twins), outer_degree)
    return HSDPGroups(layout, groups, fsdp_dense, fsdp_expert, twins, outer_sharding)


_single_ids = itertools.count(1)


def _usable(group: Group, rank: int) -> Group:
    """Paddle's one-rank HCG groups report rank -1: replace them by a local group whose
    rank is 0, so code that asks "am I rank 0 of this group" gets the right answer
    (sharding_degree=1: one process, or tensor parallelism without sharding)."""
    return single_rank_group(rank) if group.nranks == 1 else group


def single_rank_group(rank: int) -> Group:
    # Negative ids never clash with Paddle's ring ids (which count up from 0); a fresh
    # id per group keeps the comm counter's labels (keyed by id) apart.
    gid = -next(_single_ids)
    return Group(0, gid, [rank], pg=None, name=f"hsdp_single_{rank}_{-gid}")


# ---------------------------------------------------------------- HCG methods
def _hsdp_of(hcg: HybridCommunicateGroup) -> HSDPGroups:
    hsdp = getattr(hcg, "_hsdp_groups", None)
    if hsdp is None:
        raise RuntimeError(
            "This HybridCommunicateGroup has no HSDP groups: `import paddle_hsdp` before "
            "calling fleet.init(is_collective=True, strategy=...)."
        )
    return hsdp


def _get_fsdp_group(self: HybridCommunicateGroup, is_expert: bool = False) -> Group:
    """The FSDP group: sharding for dense params, moe_sharding for experts when EP > 1."""
    return _hsdp_of(self).fsdp(is_expert)


def _get_fsdp_inner_group(self: HybridCommunicateGroup, is_expert: bool = False) -> Group:
    """The ranks that shard a buffer between them (one row of ``[outer, inner]``)."""
    return _hsdp_of(self).inner(self.global_rank, is_expert)


def _get_fsdp_outer_group(self: HybridCommunicateGroup, is_expert: bool = False) -> Group:
    """The replicas of this rank's shard (one column of ``[outer, inner]``)."""
    return _hsdp_of(self).outer(self.global_rank, is_expert)


def _get_fsdp_outer_degree(self: HybridCommunicateGroup) -> int:
    return _hsdp_of(self).outer_degree


def _get_fsdp_outer_sharding(self: HybridCommunicateGroup) -> str:
    """"none" (HSDP) or "optim" (HFSDP): ``sharding_configs["fsdp_outer_sharding"]``."""
    return _hsdp_of(self).outer_sharding


#: The methods ``import paddle_hsdp`` adds to Paddle's HybridCommunicateGroup, by name
#: (patches/fleet.py installs them; Paddle has no FSDP groups of its own).
HCG_METHODS = {
    "get_fsdp_group": _get_fsdp_group,
    "get_fsdp_inner_group": _get_fsdp_inner_group,
    "get_fsdp_outer_group": _get_fsdp_outer_group,
    "get_fsdp_outer_degree": _get_fsdp_outer_degree,
    "get_fsdp_outer_sharding": _get_fsdp_outer_sharding,
}
