"""fully_shard(mesh=ProcessMesh) without fleet's sharding config: only
init_parallel_env. On 4 ranks, in one launch:

1. TinyLM on ``ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"])`` (HSDP 2 x 2)
   and on ``ProcessMesh([0, 1, 2, 3])`` (pure FSDP 1 x 4): losses, every final param and
   the global grad norm equal single-process training on the whole batch (float64,
   parity.py's bound);
2. two disjoint 1-D meshes ``[0, 1]`` and ``[2, 3]`` training different data at the
   same time (no clip: the clip's all-reduce spans the whole job, see clip.py): a rank
   outside a mesh gets a ValueError from fully_shard and calls create_mesh_groups
   instead, which keeps every rank's group numbering in step (checked by one more mesh).
"""

from common import compare_with_reference, finish, rank_sum_check
from parity import set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.topology import mesh as hsdp_mesh
from models import (batches, build_model, lm_loss, make_optimizer, train_reference,
                    uses_extra)

STEPS, MICRO, PER_RANK, CLIP = 5, 2, 2, 0.2
set_dtype("float64")

dist.init_parallel_env()
from paddle.distributed.fleet.base import topology as fleet_topology  # noqa: E402

assert fleet_topology._HYBRID_PARALLEL_GROUP is None  # no fleet HCG at all
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, world


def shard(mesh):
    model = build_model()
    for layer in [model.embed, *model.blocks]:
        paddle_hsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    paddle_hsdp.fully_shard(model, mesh=mesh)
    return model


def check_groups(m, rows):
    """This rank's inner group is its row of ``rows``, the outer group its column."""
    row = next(r for r in rows if rank in r)
    col = [r[row.index(rank)] for r in rows]
    inner, outer = m.inner(), m.outer()
    assert inner.ranks == sorted(row) and outer.ranks == sorted(col), (inner, outer, rows)
    assert m.inner(True) is inner and m.outer(True) is outer  # experts: the same groups
    assert m.fsdp_size() == m.fsdp_size(True) == sum(len(r) for r in rows)
    assert sorted(m.fsdp_group().ranks) == sorted(x for r in rows for x in r)
    for group, what in ((inner, "inner"), (outer, "outer"), (m.fsdp_group(), "fsdp")):
        if group.nranks > 1:
            rank_sum_check(group, what)
        if what != "fsdp":
            assert comm.group_label(group) == what, (what, comm.group_label(group))


def run(mesh, rows, data, local, n_ranks, clip, ref):
    """Train on ``mesh``; this rank takes chunk ``local`` of the ``n_ranks`` chunks."""
    ref_losses, ref_params, ref_norms = ref
    model = shard(mesh)
    units = hsdp_registry.units_under(model)
    m = units[0].mesh
    assert all(u.mesh is m for u in units)  # groups made once for the mesh
    assert hsdp_mesh.resolve_mesh(mesh) is m
    check_groups(m, rows)
    opt = make_optimizer(model, model.parameters(), clip)
    trainable = [b for u in units for b in u.buffers if b.trainable]
    losses, worst = [], {}
    for step, micro_batches in enumerate(data):
        comm.counter.reset()
        total = 0.0
        for micro in micro_batches:
            ids = paddle.to_tensor(micro[local * PER_RANK:(local + 1) * PER_RANK])
            loss = lm_loss(model, ids, uses_extra(local))
            (loss / MICRO).backward()
            t = paddle.to_tensor([float(loss)])
            if m.fsdp_group().nranks > 1:  # for the log only: not through comm
                dist.all_reduce(t, group=m.fsdp_group())
            total += t.item() / n_ranks / MICRO
        opt.step()
        if clip:
            norm = paddle_hsdp.last_global_norm(opt)
            worst["norm"] = max(worst.get("norm", 0),
                                abs(norm - ref_norms[step]) / ref_norms[step])
        opt.clear_grad()
        losses.append(total)
        # the labels reach the counter: one outer all-reduce per buffer per step
        assert comm.counter.get("outer", "all_reduce").calls == len(trainable)
        assert comm.counter.get("inner", "reduce_scatter").calls == MICRO * len(trainable)
    full = paddle_hsdp.full_state_dict(model)
    shape = "x".join(str(d) for d in mesh.shape)
    compare_with_reference(f"mesh {shape} {m.plan.process_ids}", full, ref_params, losses,
                           ref_losses, worst)
    print(f"PARITY mesh {shape} {m.plan.process_ids}: max rel diff "
          f"{max(worst.values()):.2e} (loss {worst['loss']:.2e})", flush=True)


# 1. whole-world meshes: HSDP 2 x 2 and pure FSDP 1 x 4, compared with one reference
data = batches(STEPS, MICRO, world, PER_RANK)
ref = train_reference(data, world, PER_RANK, CLIP)
assert min(ref[2]) > CLIP, ref[2]  # clipping is active at every step
run(ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"]), [[0, 1], [2, 3]],
    data, rank, world, CLIP, ref)
run(ProcessMesh([0, 1, 2, 3]), [[0, 1, 2, 3]], data, rank, world, CLIP, ref)

# 2. two disjoint meshes at once; every rank creates both meshes' groups, in one order
mesh_a, mesh_b = ProcessMesh([0, 1], dim_names=["inner"]), ProcessMesh([2, 3])
mine, other = (mesh_a, mesh_b) if rank < 2 else (mesh_b, mesh_a)
try:
    paddle_hsdp.fully_shard(build_model(), mesh=other)
    raise AssertionError("fully_shard on a rank outside the mesh did not raise")
except ValueError as e:
    assert f"rank ({rank}) is not in the mesh" in str(e), e
data2 = batches(STEPS, MICRO, 2, PER_RANK, seed=11 + rank // 2)  # per-mesh data
ref2 = train_reference(data2, 2, PER_RANK, 0)
local = rank % 2
if rank < 2:
    run(mesh_a, [[0, 1]], data2, local, 2, 0, ref2)
    outside = hsdp_mesh.create_mesh_groups(mesh_b)
else:
    outside = hsdp_mesh.create_mesh_groups(mesh_a)
    run(mesh_b, [[2, 3]], data2, local, 2, 0, ref2)
assert not outside.contains_rank
# group numbering still agrees on every rank: a new mesh's groups work
transposed = hsdp_mesh.resolve_mesh(ProcessMesh([[0, 2], [1, 3]], dim_names=["outer", "inner"]))
check_groups(transposed, [[0, 2], [1, 3]])
finish()
