"""Which groups a unit talks to.

``fully_shard(module, mesh=None)`` uses the groups ``fleet.init`` built (:class:`HCGMesh`);
``fully_shard(module, mesh=ProcessMesh(...))`` builds its own (:class:`ProcessMeshGroups`),
so only ``paddle.distributed.init_parallel_env()`` (or a ``fleet.init`` without sharding
settings) is needed.

An explicit mesh is read the way :func:`~paddle_hsdp.topology.layout.plan_hsdp_layout`
reads an FSDP group:

* 1-D ``ProcessMesh([0, 1, 2, 3])``: pure FSDP, one inner group of all its ranks, outer
  degree 1;
* 2-D ``ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"])``: dims
  ``[outer, inner]``, row-major: each row is an inner group (the ranks that shard a
  buffer), each column an outer group (the replicas of one shard).

Dim names are not needed (dims are positional), except that ``["inner", "outer"]``, the
reverse, is refused as a likely mistake. Expert (MoE) parameters use the same inner and
outer groups as dense ones on an explicit mesh: a mesh describes one FSDP group.

Groups are created with ``paddle.distributed.new_group`` on every rank that resolves
the mesh, in one global order (every inner row, then every outer column, then the
mesh-wide FSDP group if it is neither the world nor one of those), and cached per mesh
(process ids and shape): calling ``fully_shard`` on several modules with equal meshes
creates them once. One-rank groups are local ``Group`` objects (no communicator). As
with every ``new_group``, every rank of the job must make the same calls in the same
order, ranks outside the mesh included: they must not call ``fully_shard`` with it
(``ValueError``), but call :func:`create_mesh_groups` at the same point instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from dataclasses import dataclass

import paddle.distributed as dist
from paddle.distributed import ProcessMesh
from paddle.distributed.fleet.base import topology as fleet_topology

from ..comm import collectives as comm
from ..comm.traits import contributing
from . import layout as topology
from .fleet import single_rank_group

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

    from .fleet import HSDPHybridCommunicateGroup

logger = logging.getLogger(__name__)


def _size(hcg: HybridCommunicateGroup | None, getter: str) -> int:
    return getattr(hcg, getter)() if hasattr(hcg, getter) else 1


def model_parallel_degrees(hcg: HybridCommunicateGroup | None = None) -> dict[str, int]:
    """fleet's degrees of the axes that split a model rather than its data (1 where the
    HCG has no such axis; all 1 before fleet.init). ``hcg``: fleet's, by default. Local
    and alike on every rank, so a refusal read from it is taken by every rank."""
    hcg = fleet_topology._HYBRID_PARALLEL_GROUP if hcg is None else hcg
    return {"mp_degree": _size(hcg, "get_model_parallel_world_size"),
            "pp_degree": _size(hcg, "get_pipe_parallel_world_size"),
            "sep_degree": _size(hcg, "get_sep_parallel_world_size"),
            "cp_degree": _size(hcg, "get_context_parallel_world_size")}


@runtime_checkable
class Mesh(Protocol):
    """What the engine, the clip and checkpoints ask of a mesh: its groups for dense
    (``is_expert=False``) or expert parameters, this rank's mp and sep coordinates, the
    clip's group (None: the whole job), the outer sharding ("none" or "optim") and the
    outer sync's policies from fleet's ``sharding_configs``.
    :class:`HCGMesh` (fleet's), :class:`ProcessMeshGroups` (an explicit ProcessMesh) and
    the tests' fake meshes satisfy it (test/test_engine_context.py)."""

    def inner(self, is_expert: bool = False) -> Any: ...
    def outer(self, is_expert: bool = False) -> Any: ...
    def reduce_scatter_group(self, is_expert: bool = False) -> Any: ...
    def fsdp_group(self, is_expert: bool = False) -> Any: ...
    def fsdp_size(self, is_expert: bool = False) -> int: ...
    def mp_rank(self) -> int: ...
    def sep_rank(self) -> int: ...
    def clip_group(self) -> Any: ...
    def outer_sharding(self) -> str: ...
    def outer_policies(self) -> tuple: ...
    def layout_degree(self, is_expert: bool = False) -> int | None: ...


class HCGMesh:
    """The HSDP groups ``fleet.init`` built, for dense and expert buffers.

    ``dp_size`` is the number of data-parallel ranks a gradient is averaged over: the
    whole dense FSDP group (outer x inner), for expert params too.
    """

    def __init__(self, hcg: HSDPHybridCommunicateGroup) -> None:
        self.hcg = hcg
        for name, size in (("sep", _size(hcg, "get_sep_parallel_world_size")),
                           ("context", _size(hcg, "get_context_parallel_world_size"))):
            if size > 1:
                raise NotImplementedError(
                    f"fully_shard with {name} parallel degree {size} > 1 is not supported: "
                    f"grads would not be reduced over the {name} group.")
        if hcg.get_data_parallel_world_size() > 1:
            raise NotImplementedError(
                "fully_shard with dp_degree > 1 is not supported: put the data-parallel "
                "ranks in sharding_degree and use sharding_configs['fsdp_outer_degree'] "
                "for replication instead."
            )

    def inner(self, is_expert: bool = False) -> Group:
        return self.hcg.get_fsdp_inner_group(is_expert)

    def outer(self, is_expert: bool = False) -> Group:
        return self.hcg.get_fsdp_outer_group(is_expert)

    def reduce_scatter_group(self, is_expert: bool = False) -> Group:
        """The inner group's twin for reduce-scatters on NCCL (see
        :func:`~paddle_hsdp.topology.fleet.separate_reduce_scatter`), else the inner group."""
        return self.hcg._hsdp_groups.reduce_scatter(self.hcg.global_rank, is_expert)

    def fsdp_group(self, is_expert: bool = False) -> Group:
        return self.hcg.get_fsdp_group(is_expert)

    def fsdp_size(self, is_expert: bool = False) -> int:
        # outer x inner (the dense FSDP group's size), read each time: a fault-tolerant
        # job's outer group follows the live replicas (paddle_hsdp.ft), less a rejoining
        # one that sits its first step out
        return contributing(self.outer(False)) * self.inner(False).nranks

    def mp_rank(self) -> int:
        return self.hcg.get_model_parallel_rank()

    def sep_rank(self) -> int:
        return self.hcg.get_sep_parallel_rank() if self.hcg.get_sep_parallel_world_size() > 1 else 0

    def clip_group(self) -> None:
        """The group the global-norm clip all-reduces over: None, the whole job."""
        return None

    def outer_sharding(self) -> str:
        """``sharding_configs["fsdp_outer_sharding"]``: "none" or "optim"."""
        return self.hcg._hsdp_groups.outer_sharding

    def outer_policies(self) -> tuple:
        """``sharding_configs``' outer-sync keys as ``(MixedPrecisionPolicy | None,
        OuterSyncPolicy | None)`` (patches/fleet.py)."""
        return self.hcg._hsdp_groups.outer_policies

    def layout_degree(self, is_expert: bool = False) -> int | None:
        """The segments a buffer is laid out over when not the inner degree (set by
        paddle_hsdp.ft for the dense inner group: engine/layout.py, [Note: the layout
        degree]; an expert inner group's is as many times its own), else None."""
        degree = self.hcg._hsdp_groups.layout_degree
        if degree is None:
            return None
        return degree // self.inner(False).nranks * self.inner(is_expert).nranks


# ---------------------------------------------------------------- explicit mesh: planning
_ALLOWED = ("a paddle.distributed.ProcessMesh, 1-D (pure FSDP over its ranks) or 2-D "
            "with dims [outer, inner] (each row shards, each column replicates), e.g. "
            "ProcessMesh([[0, 1], [2, 3]], dim_names=['outer', 'inner'])")


@dataclass(frozen=True)
class MeshPlan:
    """The pure layout of an explicit mesh: no Paddle process group involved.

    ``layout`` is :func:`~paddle_hsdp.topology.layout.plan_hsdp_layout` of the mesh's one FSDP group
    (its process ids, row-major) with ``outer_degree`` rows; ``creation_order`` is the
    order every rank creates the groups in (``fsdp`` last, if it needs a group of its
    own: not the world and not equal to an inner or outer group).
    """

    process_ids: tuple[int, ...]
    shape: tuple[int, ...]
    outer_degree: int
    inner_size: int
    layout: topology.HSDPLayout
    covers_world: bool

    @property
    def key(self) -> tuple:
        return (self.process_ids, self.shape)

    @property
    def fsdp(self) -> tuple[int, ...]:
        return self.process_ids

    def rows(self) -> list[tuple[int, ...]]:
        """Inner groups, one per row of ``[outer, inner]``."""
        n = self.inner_size
        return [self.process_ids[o * n:(o + 1) * n] for o in range(self.outer_degree)]

    def cols(self) -> list[tuple[int, ...]]:
        """Outer groups, one per column of ``[outer, inner]``."""
        return [tuple(row[i] for row in self.rows()) for i in range(self.inner_size)]

    def fsdp_needs_own_group(self) -> bool:
        if self.covers_world or len(self.fsdp) == 1:
            return False
        return self.fsdp not in self.layout.creation_order

    @property
    def creation_order(self) -> list[tuple[int, ...]]:
        order = list(self.layout.creation_order)
        if self.fsdp_needs_own_group():
            order.append(self.fsdp)
        return order

    def groups_of(self, rank: int) -> topology.RankGroups:
        if rank not in self.layout.dense:
            raise ValueError(
                f"fully_shard(mesh=...): this rank ({rank}) is not in the mesh, whose "
                f"process ids are {list(self.process_ids)} (shape {list(self.shape)}). Call "
                "fully_shard with this mesh only on its ranks; ranks outside it must call "
                "paddle_hsdp.create_mesh_groups(mesh) at the same point instead, so "
                "that every rank creates the same groups in the same order.")
        return self.layout.groups_of(rank)


def plan_mesh(mesh: ProcessMesh, world_size: int | None = None) -> MeshPlan:
    """Validate ``mesh`` and compute its layout; creates no group.

    ``world_size``: the number of ranks of the job (process ids must be below it);
    None skips that check. Raises ``TypeError`` for a non-``ProcessMesh`` and
    ``ValueError`` for a mesh that is not 1-D or 2-D ``[outer, inner]``; the same on
    every rank, since every rank passes the same mesh.
    """
    if not isinstance(mesh, ProcessMesh):
        hint = (" (wrap the rank list: ProcessMesh(...))"
                if isinstance(mesh, (list, tuple)) else "")
        raise TypeError(f"fully_shard(mesh=...) must be None (the groups fleet.init built) "
                        f"or {_ALLOWED}; got {type(mesh).__name__}{hint}.")
    shape = tuple(int(d) for d in mesh.shape)
    ids = tuple(int(r) for r in mesh.process_ids)
    if len(shape) not in (1, 2):
        raise ValueError(f"fully_shard(mesh=...) got a {len(shape)}-D ProcessMesh of shape "
                         f"{list(shape)}; it must be {_ALLOWED}.")
    names = list(mesh.dim_names or [])
    if len(shape) == 2 and names == ["inner", "outer"]:
        raise ValueError(f"fully_shard(mesh=...) reads a 2-D mesh as [outer, inner], and "
                         f"this one has dim_names {names} (shape {list(shape)}): transpose "
                         "it so that each row is an inner group, with dim_names "
                         "['outer', 'inner'].")
    if len(ids) != len(set(ids)) or min(ids) < 0:  # ProcessMesh checks too; be sure
        raise ValueError(f"fully_shard(mesh=...): process ids must be distinct and >= 0, "
                         f"got {list(ids)}.")
    if world_size is not None and max(ids) >= world_size:
        raise ValueError(
            f"fully_shard(mesh=...): the mesh names ranks {list(ids)}, but the job has "
            f"{world_size} rank(s) (valid ids 0..{world_size - 1}). Launch enough ranks and "
            "call paddle.distributed.init_parallel_env() (or fleet.init) first.")
    outer = shape[0] if len(shape) == 2 else 1
    layout = topology.plan_hsdp_layout([ids], None, outer)
    covers = world_size is not None and len(ids) == world_size
    return MeshPlan(ids, shape, outer, len(ids) // outer, layout, covers)


def _job_plan(mesh: ProcessMesh) -> tuple[MeshPlan, int]:
    """``plan_mesh`` against this job (world size, initialised); return it and our rank."""
    plan = plan_mesh(mesh)
    if not dist.is_initialized():
        if len(plan.process_ids) > 1:
            raise RuntimeError(
                f"fully_shard(mesh=...) with a mesh of {len(plan.process_ids)} ranks needs "
                "the distributed environment: call paddle.distributed.init_parallel_env() "
                "(or fleet.init) first.")
        return plan_mesh(mesh, 1), 0
    return plan_mesh(mesh, dist.get_world_size()), dist.get_rank()


# ---------------------------------------------------------------- explicit mesh: groups
class ProcessMeshGroups:
    """The groups of one explicit mesh, with :class:`HCGMesh`'s interface.

    ``inner``/``outer``/``fsdp_group``/``fsdp_size`` ignore ``is_expert``: experts
    shard and replicate like dense parameters on an explicit mesh. ``mp_rank`` and
    ``sep_rank`` are 0 (no tensor or sequence parallelism inside a mesh).
    On a rank outside the mesh only :attr:`plan` and :attr:`groups` are meaningful.
    """

    def __init__(self, plan: MeshPlan, groups: dict[tuple[str, topology.Ranks], Group],
                 fsdp: Group | None, rank: int) -> None:
        self.plan = plan
        self.groups = groups  # (role, members in mesh order) -> Group, this rank's and others'
        self._fsdp = fsdp
        self.rank = rank
        self.contains_rank = rank in plan.layout.dense
        self._inner: Group | None = None
        self._outer: Group | None = None
        if self.contains_rank:
            mine = plan.groups_of(rank)
            self._inner = groups[("inner", mine.inner)]
            self._outer = groups[("outer", mine.outer)]

    @property
    def outer_degree(self) -> int:
        return self.plan.outer_degree

    def _check_member(self) -> None:
        if not self.contains_rank:
            self.plan.groups_of(self.rank)  # raises the ValueError

    def inner(self, is_expert: bool = False) -> Group | None:
        self._check_member()
        return self._inner

    def outer(self, is_expert: bool = False) -> Group | None:
        self._check_member()
        return self._outer

    def reduce_scatter_group(self, is_expert: bool = False) -> Group | None:
        # explicit meshes make no twin yet: reduce-scatters share the inner group's stream
        return self.inner(is_expert)

    def fsdp_group(self, is_expert: bool = False) -> Group | None:
        self._check_member()
        return self._fsdp

    def fsdp_size(self, is_expert: bool = False) -> int:
        return len(self.plan.process_ids)

    def mp_rank(self) -> int:
        return 0

    def sep_rank(self) -> int:
        return 0

    def clip_group(self) -> Group | None:
        """The group the global-norm clip all-reduces over: None (the whole job) when
        the mesh is the world, else the mesh-wide FSDP group."""
        return None if self.plan.covers_world else self.fsdp_group()

    def outer_sharding(self) -> str:
        """An explicit mesh's default: "none" (``fully_shard(...,
        fsdp_outer_sharding="optim")`` asks for outer sub-shards on it)."""
        return "none"

    def outer_policies(self) -> tuple:
        """An explicit mesh carries no sharding_configs: fully_shard's arguments alone."""
        return None, None

    def layout_degree(self, is_expert: bool = False) -> None:
        """An explicit mesh is not a fault-tolerant job's: its inner degree."""
        return None

    def __repr__(self) -> str:
        return (f"ProcessMeshGroups(ids={list(self.plan.process_ids)}, "
                f"[outer, inner]=[{self.plan.outer_degree}, {self.plan.inner_size}])")


_mesh_cache: dict[tuple, ProcessMeshGroups] = {}


def create_mesh_groups(mesh: ProcessMesh) -> ProcessMeshGroups:
    """Validate ``mesh``, create (once per process ids and shape) and return its groups.

    Every rank of the job must call this (``fully_shard`` does on the mesh's ranks) at
    the same point, ranks outside the mesh included: ``new_group`` numbers groups by
    call order on every rank.
    """
    plan, rank = _job_plan(mesh)  # every check, before any group exists
    cached = _mesh_cache.get(plan.key)
    if cached is not None:
        return cached
    groups: dict[tuple[str, topology.Ranks], Group] = {}
    for members in plan.layout.creation_order:
        roles = [role for role, table in (("inner", plan.rows()), ("outer", plan.cols()))
                 if members in table]
        if len(members) == 1:
            # Paddle's new_group gives a one-rank group rank -1 and nranks -1; a local
            # Group is what it should be, one per role so each keeps its comm label.
            if members[0] == rank:
                for role in roles:
                    groups[(role, members)] = single_rank_group(rank)
            continue
        group = dist.new_group(list(members))
        for role in roles:
            groups[(role, members)] = group
    fsdp: Group | None = None
    if plan.covers_world:
        fsdp = dist.collective._get_global_group()
    elif plan.fsdp_needs_own_group():
        fsdp = dist.new_group(list(plan.fsdp))
    elif len(plan.fsdp) == 1:
        fsdp = single_rank_group(rank) if plan.fsdp[0] == rank else None
    else:  # the mesh-wide group is one of its rows or columns
        fsdp = groups.get(("inner", plan.fsdp), groups.get(("outer", plan.fsdp)))
    result = ProcessMeshGroups(plan, groups, fsdp, rank)
    inner, outer = result._inner, result._outer
    if inner is not None and outer is not None:  # set where the mesh contains this rank
        comm.name_group(inner, "inner")
        comm.name_group(outer, "outer")
        if plan.fsdp_needs_own_group() and fsdp is not None:  # (made above then)
            comm.name_group(fsdp, "fsdp")
    _mesh_cache[plan.key] = result
    logger.info("HSDP: groups of mesh %s created ([outer, inner] = [%d, %d])",
                list(plan.process_ids), plan.outer_degree, plan.inner_size)
    return result


def paddle_world_size() -> int:
    return dist.get_world_size()


def check_mesh_against_fleet(plan: MeshPlan, hcg: HybridCommunicateGroup) -> None:
    """With ``fleet.init``'s topology known, an explicit mesh must span exactly the
    ranks that train the same parameters on different data (dp x sharding), or the
    copies outside it drift apart silently. Tensor, pipeline, sep and context
    parallelism need the fleet groups (the clip and the replicas of mp-shared params
    depend on them): pass ``mesh=None`` there."""
    others = {k: v for k, v in model_parallel_degrees(hcg).items() if v > 1}
    if others:
        raise NotImplementedError(
            f"fully_shard(mesh=...) next to fleet's {others}: use mesh=None, which takes "
            "the HSDP groups fleet.init built (sharding_configs['fsdp_outer_degree']).")
    if not plan.covers_world:
        dp = _size(hcg, "get_data_parallel_world_size")
        sharding = _size(hcg, "get_sharding_parallel_world_size")
        raise ValueError(
            f"fully_shard(mesh=...): the mesh spans ranks {list(plan.process_ids)}, but "
            f"fleet.init made {dp * sharding} data-parallel ranks (dp_degree={dp} x "
            f"sharding_degree={sharding}) that train the same parameters on different "
            "data; ranks outside the mesh would train their own copy and drift apart. "
            "Use a mesh over all of them (e.g. 2-D [outer, inner] with the dp ranks as "
            "outer replicas), or mesh=None with sharding_configs['fsdp_outer_degree'].")


def resolve_mesh(mesh: ProcessMesh | None) -> HCGMesh | ProcessMeshGroups:
    """What ``fully_shard(mesh=...)`` talks to: the fleet HCG's groups (None) or an
    explicit mesh's (a ``ProcessMesh``; this rank must be in it)."""
    hcg = fleet_topology._HYBRID_PARALLEL_GROUP
    if mesh is not None:
        plan, rank = _job_plan(mesh)
        plan.groups_of(rank)  # not a member: ValueError, before any group exists
        if hcg is not None:
            check_mesh_against_fleet(plan, hcg)
        elif not plan.covers_world and plan.key not in _mesh_cache:
            logger.warning(
                "fully_shard(mesh=...) over ranks %s of a %d-rank job: nothing keeps this "
                "model in sync with ranks outside the mesh (right for a separate model, "
                "wrong for more data-parallel copies of the same one).",
                list(plan.process_ids), paddle_world_size())
        return create_mesh_groups(mesh)
    if hcg is None or not hasattr(hcg, "_hsdp_groups"):
        raise RuntimeError(
            "fully_shard(mesh=None) uses the groups fleet.init builds, and fleet has not "
            "been initialised with paddle_hsdp: `import paddle_hsdp`, then call "
            "fleet.init(is_collective=True, strategy=s) with s.hybrid_configs = "
            "{'sharding_degree': N, 'sharding_configs': {'fsdp_outer_degree': O}}, or "
            "pass mesh=paddle.distributed.ProcessMesh(...) after init_parallel_env()."
        )
    return HCGMesh(hcg)
