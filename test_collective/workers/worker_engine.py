"""HSDP training == single-process training on the whole batch (losses, every param,
grad norm), plus the comm counter against the volume formulas (docs/architecture.md) and the memory report.

argv: JSON with sharding_degree, outer, dtype (default float64: see parity.py), the run
variants to check (``[reshard_blocks, via_fleet, end_of_backward, layout_degree]``, the
last two optional: a layout degree lays every buffer out as a group of that many ranks
would, engine/layout.py's [Note: the layout degree]), and optionally ``mesh`` (nested
rank lists; with ``dim_names``): shard on that explicit mesh instead of fleet's groups (in the shared 2 x 2 launch, 1 x 4 and
4 x 1 run this way; fleet builds those layouts' groups in test_faults' launches), and
``separate_reduce_scatter`` (common.init_fleet sets PADDLE_HSDP_SEPARATE_REDUCE_SCATTER=1
for the layout's fleet.init):
every buffer must reduce-scatter on its inner group's twin. Units shard with
``fsdp_outer_sharding="none"`` (HSDP) whatever fleet's option says (the 2 x 4 layout sets
it to "optim" for worker_hfsdp.py).
"""

from common import compare_with_reference, config_from_argv, finish, init_fleet
from parity import FLEET_OPTIMIZER_DTYPE, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh, fleet

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.comm.gather_tags import TAG_NUMEL
from paddle_hsdp.engine.layout import ALIGN, buffer_layout
from paddle_hsdp.topology.mesh import resolve_mesh
from models import (batches, build_model, lm_loss, make_optimizer, train_reference,
                    uses_extra)

STEPS, MICRO, PER_RANK, CLIP = 5, 2, 2, 0.2

config = config_from_argv()
DTYPE = config.get("dtype", "float64")
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
MESH = (ProcessMesh(config["mesh"], dim_names=config.get("dim_names"))
        if "mesh" in config else None)
groups = resolve_mesh(MESH) if MESH is not None else None
inner, outer = ((groups.inner(), groups.outer()) if groups is not None
                else (hcg.get_fsdp_inner_group(), hcg.get_fsdp_outer_group()))
I, O = inner.nranks, outer.nranks
data = batches(STEPS, MICRO, world, PER_RANK)
_references = {}


def reference(dtype: str):
    """The single-process run in ``dtype`` (built once per dtype)."""
    if dtype not in _references:
        _references[dtype] = train_reference(data, world, PER_RANK, CLIP)
        assert min(_references[dtype][2]) > CLIP, _references[dtype][2]  # clipping every step
    return _references[dtype]


def shard(reshard_blocks: bool, overlap: bool = True, layout_degree: int | None = None):
    if layout_degree is not None:  # (fleet's groups: an explicit mesh has no degree)
        hcg._hsdp_groups.use_layout_degree(layout_degree)
    model = build_model()
    units = [model.embed] + list(model.blocks)
    for layer in units:
        paddle_hsdp.fully_shard(layer, reshard_after_forward=reshard_blocks,
                                enable_tensor_fusion_and_overlap=overlap, mesh=MESH,
                                fsdp_outer_sharding="none")
    paddle_hsdp.fully_shard(model, enable_tensor_fusion_and_overlap=overlap, mesh=MESH,
                            fsdp_outer_sharding="none")
    hcg._hsdp_groups.use_layout_degree(None)  # (the layout is fixed once sharded)
    if layout_degree is not None:  # each rank holds layout_degree / I segments
        for b in (b for u in hsdp_registry.units_under(model) for b in u.buffers):
            fine = buffer_layout([sp.shape for sp in b.params], layout_degree)
            assert (b.layout.offsets, b.padded_numel) == (fine.offsets, fine.total_numel), b
            assert b.layout.segments == I, b.layout
    return model


def run(reshard_blocks: bool, via_fleet: bool, end_of_backward: bool = False,
        layout_degree: int | None = None):
    # the end-of-backward variant also runs every collective synchronously
    dtype = set_dtype(FLEET_OPTIMIZER_DTYPE if via_fleet else DTYPE)
    esize = paddle.zeros([1]).element_size()
    ref_losses, ref_params, ref_norms = reference(dtype)
    model = shard(reshard_blocks, overlap=not end_of_backward, layout_degree=layout_degree)
    if end_of_backward:
        model.set_reduce_grads_at_end_of_backward(True)
    opt = make_optimizer(model, model.parameters(), CLIP)
    if via_fleet:
        opt = fleet.distributed_optimizer(opt)
    unit_list = hsdp_registry.units_under(model)
    losses, worst = [], {}
    for step, micro_batches in enumerate(data):
        comm.counter.reset()
        total = 0.0
        for micro in micro_batches:
            ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
            loss = lm_loss(model, ids, uses_extra(rank))
            if reshard_blocks:  # resharded units hold no full-size storage after forward
                for u in unit_list:
                    if u.should_reshard_after_forward():
                        assert u.held_bytes()["gathered"] == 0, u.module
            paddle_hsdp.reset_peak_memory()
            (loss / MICRO).backward()
            held = paddle_hsdp.memory_report(model)
            assert held["gathered"] == 0, held  # everything resharded after backward
            check_full_grad_peak(unit_list, held["peak_full_grads"], end_of_backward, esize)
            t = paddle.to_tensor([float(loss)])
            dist.all_reduce(t)  # for the log only: not through comm, not counted
            total += t.item() / world / MICRO
        opt.step()
        norm = paddle_hsdp.last_global_norm(opt)  # both clip set-ups record it
        worst["norm"] = max(worst.get("norm", 0), abs(norm - ref_norms[step]) / ref_norms[step])
        opt.clear_grad()
        losses.append(total)
        check_counter(unit_list, esize)
    full = paddle_hsdp.full_state_dict(model)
    tag = (f"reshard={reshard_blocks} fleet_opt={via_fleet} end_of_backward={end_of_backward}"
           + (f" layout_degree={layout_degree}" if layout_degree is not None else ""))
    compare_with_reference(f"engine {O}x{I} {tag}", full, ref_params, losses, ref_losses, worst)
    print(f"PARITY {O}x{I} {dtype} {tag}: max rel diff {max(worst.values()):.2e} "
          f"(loss {worst['loss']:.2e})", flush=True)


def full_grad_bytes(unit, esize) -> int:
    """A unit's full grads: a buffer's whole grad grid (padding included) when autograd
    adds them there (engine/buffer/full_grads.py; the tied embedding's too: Paddle accumulates
    a leaf's grads from both uses at once, after the embedding's pre-backward), else its
    parameters' grads."""
    return sum(b.padded_numel * esize if b.full_grads.in_place()
               else sum(sp.numel * esize for sp in b.params)
               for b in unit.buffers if b.trainable)


def check_full_grad_peak(units, peak, end_of_backward, esize):
    """Per-unit reduction: full-size grads alive at once are at most the unit being
    reduced plus those that wait for the end of backward (the root, whose input ids
    need no grad, and the embedding, which the tied head borrows). At the end of
    backward every unit's are alive at once (less the params unused on this rank)."""
    everything = sum(full_grad_bytes(u, esize) for u in units)
    waiting = [u for u in units if u.is_root or u.borrowed_by]
    bound = (sum(full_grad_bytes(u, esize) for u in waiting)
             + max(full_grad_bytes(u, esize) for u in units))
    if end_of_backward:
        assert bound < peak <= everything, (peak, bound, everything)
    else:
        assert 0 < peak <= bound < everything, (peak, bound, everything)


def check_counter(units, esize):
    """One optimizer step of MICRO micro-steps, against the volume formulas (docs/architecture.md)."""
    trainable = [b for u in units for b in u.buffers if b.trainable]
    if config.get("separate_reduce_scatter"):  # the NCCL arrangement, forced on gloo
        for b in trainable:
            assert b.reduce_group is not b.inner and b.reduce_group.id != b.inner.id, b
            assert list(b.reduce_group.ranks) == list(b.inner.ranks), b
    rs = comm.counter.get("inner", "reduce_scatter")  # the twin's traffic is filed here
    assert rs.calls == MICRO * len(trainable), (rs, len(trainable))
    grad_bytes = sum(b.padded_numel for b in trainable) * esize
    assert rs.wire_bytes == MICRO * (I - 1) / I * grad_bytes, rs
    ar = comm.counter.get("outer", "all_reduce")
    assert ar.calls == len(trainable), comm.counter.snapshot()  # exactly one outer all-reduce per buffer per step
    assert ar.wire_bytes == 2 * (O - 1) / O * grad_bytes / I, ar
    ag = comm.counter.get("inner", "all_gather")
    tags = comm.counter.get("inner", "all_gather_tags")  # gather_check's own calls
    passes = [(2 if u.should_reshard_after_forward() else 1) * MICRO for u in units
              for b in u.buffers]
    expected = sum(n * (I - 1) / I * b.padded_numel * esize
                   for n, b in zip(passes, [b for u in units for b in u.buffers]))
    assert ag.wire_bytes == expected, (ag, expected)
    assert tags.calls == ag.calls == sum(passes), (tags, ag)
    assert tags.wire_bytes == sum(passes) * (I - 1) * TAG_NUMEL * esize, tags
    # padding per buffer ([Note: the segment layout]): every gap is under ALIGN + one
    # row, the tail under one segment's rounding to whole rows
    for b in trainable:
        gaps = b.layout.gaps()
        assert b.padded_numel - b.logical_numel == sum(e - s for s, e in gaps)
        assert all(e - s < ALIGN + max(sp.row_numel for sp in b.params) for s, e in gaps[:-1])


# the first laid out over 2 I segments (a 2 x 2 job's buffers as a 4-rank group's): the
# others keep the inner degree's layout
for variant in config.get("variants", [[True, False, False, 2 * I], [False, True],
                                       [True, False, True]]):
    run(*variant)
finish()
