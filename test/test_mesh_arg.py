"""``fully_shard(mesh=ProcessMesh)`` in one process: validation, the pure layout of a
mesh (no group created), and a one-rank mesh end to end (every collective short-circuits
on one rank). Multi-rank numerics: ``test_collective/test_mesh_arg.py``."""


import numpy as np
import paddle
import pytest
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.topology import layout as topology
from paddle_hsdp.topology import mesh as hsdp_mesh

import models  # noqa: E402
import parity  # noqa: E402  (the parity bounds, test_collective/workers/parity.py)


@pytest.fixture
def registry(monkeypatch):
    """Empty unit registry and comm counter for the test, restored after."""
    saved = hsdp_registry.saved()
    hsdp_registry.clear()
    context.backward.active.clear()
    context.backward.roots_in_backward.clear()
    monkeypatch.setattr(comm, "counter", comm.CommCounter())
    yield
    hsdp_registry.restore(saved)
    context.backward.active.clear()
    context.backward.roots_in_backward.clear()


@pytest.fixture
def no_groups(monkeypatch):
    """Any attempt to create a process group fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created")
    monkeypatch.setattr(paddle.distributed, "new_group", refuse)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [[0, 1], (0,), "0,1", 4, {"outer": 1}],
                         ids=["list", "tuple", "str", "int", "dict"])
def test_non_process_mesh_raises_type_error(bad, no_groups):
    """Anything but a ProcessMesh (or None) is a TypeError naming the argument and the
    allowed forms."""
    with pytest.raises(TypeError, match=r"mesh=.*ProcessMesh.*\[outer, inner\]"):
        hsdp_mesh.resolve_mesh(bad)


def test_list_gets_a_wrap_hint():
    with pytest.raises(TypeError, match="wrap the rank list"):
        hsdp_mesh.plan_mesh([[0, 1], [2, 3]])


def test_3d_mesh_raises_value_error(no_groups):
    with pytest.raises(ValueError, match=r"3-D ProcessMesh of shape \[2, 2, 2\].*1-D.*2-D"):
        hsdp_mesh.resolve_mesh(ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist()))


def test_reversed_dim_names_raise(no_groups):
    """dims are [outer, inner]; a mesh named the other way round is a likely mistake."""
    mesh = ProcessMesh([[0, 2], [1, 3]], dim_names=["inner", "outer"])
    with pytest.raises(ValueError, match=r"\[outer, inner\].*transpose"):
        hsdp_mesh.plan_mesh(mesh, 4)


def test_ids_beyond_the_world_raise(no_groups):
    mesh = ProcessMesh([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"2 rank\(s\).*init_parallel_env"):
        hsdp_mesh.plan_mesh(mesh, world_size=2)


def test_multi_rank_mesh_without_distributed_env_raises(no_groups):
    """Single process: a 4-rank mesh cannot be resolved (RuntimeError when the env is
    not initialised, ValueError when it is but has one rank); both say what to do."""
    with pytest.raises((RuntimeError, ValueError), match="init_parallel_env"):
        hsdp_mesh.resolve_mesh(ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"]))


def test_rank_outside_the_mesh_raises(no_groups):
    plan = hsdp_mesh.plan_mesh(ProcessMesh([[0, 1], [2, 3]]), world_size=8)
    with pytest.raises(ValueError, match=r"rank \(5\) is not in the mesh.*create_mesh_groups"):
        plan.groups_of(5)


def test_fully_shard_with_bad_mesh_has_no_side_effects(registry):
    layer = paddle.nn.Linear(4, 4)
    cls = type(layer)
    with pytest.raises(ValueError, match="3-D"):
        paddle_hsdp.fully_shard(layer, mesh=ProcessMesh([[[0]]]))
    assert hsdp_registry.units == [] and type(layer) is cls and comm.counter.snapshot() == {}


# ---------------------------------------------------------------- layout (pure)
def test_2d_mesh_layout_rows_shard_columns_replicate(no_groups):
    plan = hsdp_mesh.plan_mesh(ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"]), 4)
    assert (plan.outer_degree, plan.inner_size) == (2, 2)
    assert plan.rows() == [(0, 1), (2, 3)]
    assert plan.cols() == [(0, 2), (1, 3)]
    # all inner groups, then all outer groups; the world needs no group of its own
    assert plan.creation_order == [(0, 1), (2, 3), (0, 2), (1, 3)]
    assert plan.covers_world and not plan.fsdp_needs_own_group()
    assert plan.groups_of(3) == topology.RankGroups((0, 1, 2, 3), (2, 3), (1, 3))
    assert plan.groups_of(0) == topology.RankGroups((0, 1, 2, 3), (0, 1), (0, 2))


def test_2d_mesh_layout_equals_the_fleet_layout(no_groups):
    """The same rules as topology.plan_hsdp_layout for one FSDP group of 8, outer 2."""
    plan = hsdp_mesh.plan_mesh(ProcessMesh(np.arange(8).reshape(2, 4).tolist()), 8)
    fleet = topology.plan_hsdp_layout([list(range(8))], None, 2)
    assert plan.creation_order == fleet.creation_order
    assert plan.layout.dense == fleet.dense
    assert plan.rows() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan.cols() == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_1d_mesh_is_pure_fsdp(no_groups):
    plan = hsdp_mesh.plan_mesh(ProcessMesh([0, 1, 2, 3]), 4)
    assert (plan.outer_degree, plan.inner_size) == (1, 4)
    assert plan.rows() == [(0, 1, 2, 3)]
    assert plan.cols() == [(0,), (1,), (2,), (3,)]
    assert plan.groups_of(2) == topology.RankGroups((0, 1, 2, 3), (0, 1, 2, 3), (2,))


def test_column_mesh_is_pure_replication(no_groups):
    plan = hsdp_mesh.plan_mesh(ProcessMesh([[0], [1], [2], [3]]), 4)
    assert (plan.outer_degree, plan.inner_size) == (4, 1)
    assert plan.groups_of(1) == topology.RankGroups((0, 1, 2, 3), (1,), (0, 1, 2, 3))


def test_mesh_order_is_kept(no_groups):
    """Rows and columns follow the mesh as written (Paddle sorts each group's ranks)."""
    plan = hsdp_mesh.plan_mesh(ProcessMesh([[3, 1], [2, 0]]), 4)
    assert plan.rows() == [(3, 1), (2, 0)]
    assert plan.cols() == [(3, 2), (1, 0)]
    assert plan.groups_of(0) == topology.RankGroups((3, 1, 2, 0), (2, 0), (1, 0))


def test_partial_mesh_gets_its_own_fsdp_group_last(no_groups):
    """A mesh on part of the world: its mesh-wide group is created after the rows and
    columns, unless it is one of them (1-D: the inner group)."""
    plan = hsdp_mesh.plan_mesh(ProcessMesh([[4, 5], [6, 7]]), 8)
    assert not plan.covers_world and plan.fsdp_needs_own_group()
    assert plan.creation_order == [(4, 5), (6, 7), (4, 6), (5, 7), (4, 5, 6, 7)]
    one_d = hsdp_mesh.plan_mesh(ProcessMesh([4, 5, 6, 7]), 8)
    assert not one_d.fsdp_needs_own_group()
    assert one_d.creation_order == [(4, 5, 6, 7), (4,), (5,), (6,), (7,)]


# ---------------------------------------------------------------- one-rank mesh
def test_one_rank_mesh_groups_are_local_labelled_and_cached(no_groups):
    m = hsdp_mesh.resolve_mesh(ProcessMesh([0], dim_names=["x"]))
    assert hsdp_mesh.resolve_mesh(ProcessMesh([0], dim_names=["y"])) is m  # ids + shape
    assert hsdp_mesh.create_mesh_groups(ProcessMesh([0])) is m
    assert hsdp_mesh.resolve_mesh(ProcessMesh([[0]])) is not m  # another shape
    inner, outer = m.inner(), m.outer()
    assert inner is not outer  # one local group per role: each keeps its label
    assert (inner.nranks, inner.rank, outer.nranks, outer.rank) == (1, 0, 1, 0)
    assert comm.group_label(inner) == "inner" and comm.group_label(outer) == "outer"
    assert m.inner(True) is inner and m.outer(True) is outer  # experts: same groups
    assert m.fsdp_size() == m.fsdp_size(True) == 1
    assert m.fsdp_group().nranks == 1 and m.fsdp_group(True) is m.fsdp_group()
    assert (m.mp_rank(), m.sep_rank()) == (0, 0)
    assert m.clip_group() is None  # the mesh is the world


def test_fully_shard_on_a_one_rank_mesh_matches_single_process(registry, no_groups, float64):
    """TinyLM sharded on ProcessMesh([0]) trains like the unsharded reference."""
    steps, micro, per_rank, clip = 3, 2, 2, 0.2
    data = models.batches(steps, micro, 1, per_rank)
    ref_losses, ref_params, ref_norms = models.train_reference(data, 1, per_rank, clip)
    mesh = ProcessMesh([0], dim_names=["inner"])
    model = models.build_model()
    for layer in [model.embed, *model.blocks, model]:
        paddle_hsdp.fully_shard(layer, mesh=mesh)
    assert len({id(u.mesh) for u in hsdp_registry.units}) == 1  # one mesh object for every unit
    opt = models.make_optimizer(model, model.parameters(), clip)
    losses = []
    for step, micro_batches in enumerate(data):
        total = 0.0
        for ids in micro_batches:
            loss = models.lm_loss(model, paddle.to_tensor(ids), models.uses_extra(0))
            (loss / micro).backward()
            total += float(loss) / micro
        opt.step()
        parity.assert_close(paddle_hsdp.last_global_norm(opt), ref_norms[step], "norm")
        opt.clear_grad()
        losses.append(total)
    parity.assert_close(losses, ref_losses, "losses")
    full = paddle_hsdp.full_state_dict(model)
    assert set(full) == set(ref_params)
    for name, value in full.items():
        parity.assert_close(value.numpy(), ref_params[name], name)
    assert comm.counter.get("outer", "all_reduce").calls > 0  # labelled for the counter
    assert comm.counter.get("inner", "reduce_scatter").calls > 0
