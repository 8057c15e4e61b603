"""Muon over HSDP with each matrix owned by one rank (issue 53): ``paddle_hsdp.Muon``
with ``shard_placement_fn=paddle_hsdp.owned_matrices()`` against the unsharded model
trained in one process on the whole batch with the same Muon, 5 steps, global-norm
clip active at every step and decoupled weight decay, float64: losses and every
parameter within workers/parity.py's bound. Layouts in the shared 4-rank launch:
2 x 2 (fleet's groups), HFSDP 2 x 2 (``fsdp_outer_sharding="optim"``: owners over
inner x outer), 1 x 4 (an explicit mesh) and 2 x 2 with the shards offloaded to the
host (the reduction's path without a grad grid). Also: every matrix's momentum lives on one
rank of the job (the state's elements summed over the ranks are the model's, not
inner or outer times them; issue 65: where the replicas keep their inner owners, on
the replica that orthogonalises it) and full_optimizer_state_dict gathers each, equal
to the one-process run's, the Newton-Schulz flops over the ranks are the model's once per step in
every layout (issue 65: replicas that keep their inner owners share the work, the
results all-gathered), the owners' balance per unit is printed; Muon over the default placement
(1 x 4, HFSDP 2 x 2) moves the cut matrices onto owners at its first step (issue 64)
and trains as the owned layout does; over rows asked explicitly (``Shard(0)``) it is
refused at its first step on every rank, nothing updated.

Checkpoints (config ``work``): the 2 x 2 owned run saves model and Muon state; a load
into the flat row layout gives the same parameters exactly; a load into the owned
layout with a new Muon, then one more step on both, gives the same parameters exactly
(the momentum came back); between the momentum on its owning replica and on every
replica (``share_over_replicas=False``) both ways, one more step exact; rank 0 writes the parameters for single_process_muon.py,
which loads the checkpoint into one process.
"""

import os
import time

import numpy as np
from common import compare_with_reference, config_from_argv, finish, init_fleet
from parity import bound, max_rel, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh, Shard

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.layout import owner_balance
from paddle_hsdp.engine.registry import managed_param, units_under
from paddle_hsdp.optim.muon import newton_schulz_flops
from models import (batches, build_model, decay_filter, global_norm, lm_loss, shard_tinylm,
                    uses_extra)

STEPS, PER_RANK, CLIP = 5, 2, 0.2
started = time.time()
config = config_from_argv()
init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()


def muon(model, params, share=True, exchange="packed"):
    return paddle_hsdp.Muon(learning_rate=0.05, parameters=params, momentum=0.9,
                            weight_decay=0.1, apply_decay_param_fun=decay_filter(model),
                            adam_beta1=0.9, adam_beta2=0.95,
                            grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP),
                            share_over_replicas=share, outer_exchange=exchange)


def trained(data, shard_kwargs=None, per_rank=PER_RANK, micro_steps=1):
    """TinyLM trained on ``data`` with Muon: sharded with ``shard_kwargs`` (this rank's
    rows, in ``micro_steps`` backwards per step), or unsharded on the whole batch in one
    process (None). Returns (losses, full params, pre-clip norms, the model, the
    optimizer)."""
    model = build_model()
    if shard_kwargs is not None:
        kwargs = dict(shard_kwargs)
        if kwargs.pop("root_only", False):  # every block's matrices in one unit
            paddle_hsdp.fully_shard(model, **kwargs)
        else:
            shard_tinylm(model, **kwargs)
    opt = muon(model, model.parameters())
    losses, norms = [], []
    for (micro,) in data:
        before = outer_wire_bytes()
        chunks = [rank] if shard_kwargs is not None else range(world)
        if shard_kwargs is not None and micro_steps > 1:  # grads accumulate (issue 65)
            rows = micro[rank * per_rank:(rank + 1) * per_rank]
            loss = 0.0
            for part in np.split(rows, micro_steps):
                part_loss = lm_loss(model, paddle.to_tensor(part), uses_extra(rank)) / micro_steps
                part_loss.backward()
                loss = loss + float(part_loss)
        else:
            loss = sum(lm_loss(model, paddle.to_tensor(micro[r * per_rank:(r + 1) * per_rank]),
                               uses_extra(r)) for r in chunks) / len(chunks)
            loss.backward()
        value = paddle.to_tensor([float(loss)], dtype="float64")
        if shard_kwargs is not None:
            dist.all_reduce(value)  # for the log only
        else:
            norms.append(global_norm(model))
        opt.step()
        opt.clear_grad()
        LAST_STEP_OUTER_BYTES[0] = outer_wire_bytes() - before
        losses.append(value.item() / (world if shard_kwargs is not None else 1))
    full = paddle_hsdp.full_state_dict(model) if shard_kwargs is not None else {
        n: p.numpy() for n, p in model.state_dict().items()}
    return losses, full, norms, model, opt


# the outer group's wire bytes of the last step trained() took (the counter's, this rank)
LAST_STEP_OUTER_BYTES = [0.0]


def outer_wire_bytes() -> float:
    return sum(comm.counter.get("outer", op).wire_bytes
               for op in ("all_reduce", "reduce_scatter", "all_gather"))


def momentum_elements(model, opt) -> tuple[int, int]:
    """(this rank's momentum elements of the matrices Muon updates, the elements of
    those matrices in the model)."""
    held = total = 0
    table = opt._accumulators["moment1"]
    for p in model.parameters():
        if opt.updates_as_matrix(p) and not p.stop_gradient:
            held += int(np.prod(table[p.name].shape)) if p.name in table else 0
            total += int(np.prod(p._hsdp_sharded_param.shape))
    return held, total


def full_momenta(model, opt) -> str:
    """full_optimizer_state_dict on every rank holds every matrix's momentum, each the
    one-process run's (within the bound), wherever its replica keeps it."""
    full = paddle_hsdp.full_optimizer_state_dict(model, opt)
    ref_model, ref_opt = REFERENCE_RUN[3], REFERENCE_RUN[4]
    table = ref_opt._accumulators["moment1"]
    worst, count = 0.0, 0
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        if opt.updates_as_matrix(p) and not p.stop_gradient:
            worst = max(worst, max_rel(full[f"{p.name}_moment1_0"].numpy(),
                                       table[q.name].numpy()))
            count += 1
    assert worst <= bound(), worst
    return f"full_optimizer_state_dict: {count} momenta {worst:.1e}; "


def newton_schulz_once(model, opt, steps) -> str:
    """The Newton-Schulz flops over every rank equal the model's matrices' once per
    step (issue 65: no replica repeats another's, the owners in the inner group
    included); what the line says."""
    flops = paddle.to_tensor([opt.ns_flops], dtype="int64")
    dist.all_reduce(flops)
    model_flops = steps * sum(
        newton_schulz_flops(sorted(p._hsdp_sharded_param.shape), opt._ns_steps)
        for p in model.parameters() if opt.updates_as_matrix(p) and not p.stop_gradient)
    assert int(flops.item()) == model_flops, (int(flops.item()), model_flops)
    return f"Newton-Schulz flops over the ranks {int(flops.item())} = 1 x the model's"


def shared_gathers(model, gathers, scatters, outer_bytes, steps) -> str:
    """Where every buffer keeps its owners in the inner group over 2 replicas (no outer
    all-gather of the engine's own): Muon's all-gathers of the shared results over the
    outer group, one per step whatever the number of matrices (issue 65, item 4); where
    the shared matrices' grads are exchanged packed (engine/owned_exchange.py, from the
    second step: the first lays the buffers out after its sync), one reduce-scatter a
    step, and the last step's outer bytes over the ranks against the flat layout's
    all-reduce of the same buffers (the line says it: TinyLM's odd matrix counts pad
    the replicas' shares)."""
    buffers = [b for unit in units_under(model) for b in unit.buffers if b.trainable]
    if world // buffers[0].inner.nranks < 2 or any(b.parts != 1 for b in buffers):
        return ""
    assert gathers == steps, (gathers, steps)
    packed = any(b.pieces.packed is not None for b in buffers)  # (this rank's)
    assert scatters == (steps - 1 if packed else 0), (scatters, steps, packed)
    line = f"; Muon's all-gathers over the outer group {gathers // steps} a step"
    total = paddle.to_tensor([outer_bytes, float(packed)], dtype="float64")
    dist.all_reduce(total)  # (every rank: whether it packs or not)
    if total[1].item() > 0:
        outer = buffers[0].outer.nranks
        theory = world * 2 * (outer - 1) / outer * sum(
            b.logical_numel * b.shape().reduce_bytes for b in buffers) / buffers[0].inner.nranks
        line += (f", reduce-scatters 1 a step from the second, outer bytes "
                 f"{float(total[0].item()) / theory:.3f}x the flat theory")
    return line


def balance(model) -> str:
    return "/".join(f"{owner_balance(buf.layout)['imbalance']:.2f}"
                    for unit in units_under(model) for buf in unit.buffers
                    if any(buf.layout.owned) and buf.layout.segments > 1)


def one_step(model, opt, micro):
    ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
    lm_loss(model, ids, uses_extra(rank)).backward()
    opt.step()
    opt.clear_grad()


def checkpoints(model, opt, shard_kwargs, work):
    """Save the owned run, load it into the flat layout and back into the owned one."""
    path = os.path.join(work, "muon_owned")
    paddle_hsdp.save_checkpoint(path, model, opt)
    saved = {n: t.numpy() for n, t in paddle_hsdp.full_state_dict(model).items()}
    if rank == 0:
        np.savez(os.path.join(work, "muon_owned_params.npz"), **saved)
    flat = shard_tinylm(build_model(seed=99))
    paddle_hsdp.load_checkpoint(path, flat)
    assert all(np.array_equal(saved[n], t.numpy())
               for n, t in paddle_hsdp.full_state_dict(flat).items())
    resumed = shard_tinylm(build_model(seed=99), **shard_kwargs)
    resumed_opt = muon(resumed, resumed.parameters())
    paddle_hsdp.load_checkpoint(path, resumed, resumed_opt)
    extra = batches(1, 1, world, PER_RANK, seed=21)[0][0]
    one_step(model, opt, extra)
    one_step(resumed, resumed_opt, extra)
    after = paddle_hsdp.full_state_dict(model)
    assert all(np.array_equal(after[n].numpy(), t.numpy())
               for n, t in paddle_hsdp.full_state_dict(resumed).items())
    # other owners (1 x 4: every matrix's momentum moves to another rank), one more step
    moved = shard_tinylm(build_model(seed=99), shard_placement_fn=OWNED,
                         mesh=ProcessMesh([0, 1, 2, 3]))
    moved_opt = muon(moved, moved.parameters())
    paddle_hsdp.load_checkpoint(path, moved, moved_opt)
    one_step(moved, moved_opt, extra)
    worst = max(max_rel(after[n].numpy(), t.numpy())
                for n, t in paddle_hsdp.full_state_dict(moved).items())
    assert worst <= bound(), worst
    old_layouts(path, shard_kwargs, after, work)
    spread_to_packed(work)
    print("MUON checkpoint: owned -> flat exact; owned -> owned, one more step exact; "
          f"2x2 owners -> 1x4 owners, one more step {worst:.1e}", flush=True)


def old_layouts(path, shard_kwargs, after, work):
    """Issue 65: the momentum of a matrix shared over the replicas lives on its owning
    replica only. A checkpoint of it loads into the old layout (share_over_replicas=False:
    every replica keeps every momentum) and one more step is within the parity bound of
    the run that saved it (not bitwise since 2026-12-07: the shared matrices' grads
    reach their replica only, so the clip sums its norm over other ranks in another
    order); the old layout's checkpoint loads back into the owners, one more step within
    the parity bound of the same checkpoint stepped in the old layout."""
    extra, second = (batches(1, 1, world, PER_RANK, seed=s)[0][0] for s in (21, 23))
    old = shard_tinylm(build_model(seed=98), **shard_kwargs)
    old_opt = muon(old, old.parameters(), share=False)
    paddle_hsdp.load_checkpoint(path, old, old_opt)
    one_step(old, old_opt, extra)
    first = max(max_rel(after[n].numpy(), t.numpy())
                for n, t in paddle_hsdp.full_state_dict(old).items())
    assert first <= bound(), first
    old_path = os.path.join(work, "muon_every_replica")
    paddle_hsdp.save_checkpoint(old_path, old, old_opt)
    # the old layout's checkpoint into the owners and, as the reference, into the old
    # layout again, each one step from the load
    runs = []
    for seed, share in ((97, True), (96, False)):
        new = shard_tinylm(build_model(seed=seed), **shard_kwargs)
        new_opt = muon(new, new.parameters(), share=share)
        paddle_hsdp.load_checkpoint(old_path, new, new_opt)
        one_step(new, new_opt, second)
        runs.append(paddle_hsdp.full_state_dict(new))
    # (2.7e-16 measured, not bitwise: the loaded parameters and states are equal, the
    # step's last bits are not; within the float64 parity bound)
    worst = max(max_rel(runs[1][n].numpy(), t.numpy()) for n, t in runs[0].items())
    assert worst <= bound(), worst
    print("MUON checkpoint: momentum on the owning replica -> on every replica, one more "
          f"step {first:.1e}; every replica -> the owning replica, one more step {worst:.1e}",
          flush=True)


def spread_to_packed(work):
    """Issue 65: a checkpoint of the spread layout (``outer_exchange="spread"``, the
    default before 2026-12-07: every block in the root unit at 2 x 2, its owners over
    inner x outer, each momentum in one outer part) loads into the packed one (owners in
    the inner group, the grads exchanged packed); two more steps on both (the second
    one exchanges) within the parity bound."""
    data = batches(3, 1, world, PER_RANK, seed=29)
    runs = []
    for seed, exchange in ((94, "spread"), (93, "packed")):
        model = build_model(seed=seed)
        paddle_hsdp.fully_shard(model, shard_placement_fn=OWNED)
        opt = muon(model, model.parameters(), exchange=exchange)
        if exchange == "spread":
            one_step(model, opt, data[0][0])
            path = os.path.join(work, "muon_spread")
            paddle_hsdp.save_checkpoint(path, model, opt)
        else:
            paddle_hsdp.load_checkpoint(path, model, opt)
        block = managed_param(model.blocks[0].fc1.weight).buffer
        assert block.parts == (2 if exchange == "spread" else 1), (exchange, block.parts)
        for step in (1, 2):
            one_step(model, opt, data[step][0])
        packed = any(b.pieces.packed is not None for b in block.owner.buffers)
        assert packed == (exchange == "packed"), (exchange, packed)
        runs.append(paddle_hsdp.full_state_dict(model))
    worst = max(max_rel(runs[0][n].numpy(), t.numpy()) for n, t in runs[1].items())
    assert worst <= bound(), worst
    print(f"MUON checkpoint: spread owners -> packed exchange, two more steps {worst:.1e}",
          flush=True)


def check(name, shard_kwargs, data, reference, work=None, parts=None, **train_kw):
    """``parts``: the outer parts the blocks' buffer must have after training (Muon's
    first step spreads the owners over the outer replicas where that costs at most
    SPREAD_PADDING_MAX in padding, issue 65)."""
    ref_losses, ref_params, norms = reference
    before = comm.counter.get("outer", "all_gather").calls
    scatters = comm.counter.get("outer", "reduce_scatter").calls
    losses, full, _, model, opt = trained(data, shard_kwargs, **train_kw)
    gathers = comm.counter.get("outer", "all_gather").calls - before
    scatters = comm.counter.get("outer", "reduce_scatter").calls - scatters
    outer_bytes = LAST_STEP_OUTER_BYTES[0]
    measured = compare_with_reference(f"muon {name}", full, ref_params, losses, ref_losses, {})
    held, total = momentum_elements(model, opt)
    counts = paddle.to_tensor([held], dtype="int64")
    dist.all_reduce(counts)
    # Muon's first step spreads the owners over the outer replicas (issue 65) unless
    # the buffer cannot move (offloaded) or would grow past SPREAD_PADDING_MAX; where
    # they stay in the inner group, each matrix's momentum lives on one replica's owner
    block = managed_param(model.blocks[0].fc1.weight).buffer
    assert parts is None or block.parts == parts, (name, block.parts, parts)
    assert int(counts.item()) == total, (name, int(counts.item()), total)
    print(f"MUON {name}: max rel diff {measured:.2e}; momentum elements over the ranks "
          f"{int(counts.item())} = 1 x {total}; "
          f"{full_momenta(model, opt) if reference is REFERENCE else ''}"
          f"{newton_schulz_once(model, opt, len(data))}; owner imbalance per unit "
          f"{balance(model)}{shared_gathers(model, gathers, scatters, outer_bytes, len(data))}",
          flush=True)
    if work is not None:
        checkpoints(model, opt, shard_kwargs, work)


def layouts_of(model) -> list:
    """Per buffer: its segment size and which parameters lie whole in one segment
    (which segment a tie goes to turns with the unit's index, so offsets are not
    compared across models)."""
    return [(buf.layout.segment_numel, buf.layout.owned,
             all(sp.slot.in_one_segment for sp, o in zip(buf.params, buf.layout.owned) if o))
            for unit in units_under(model) for buf in unit.buffers]


def moved_at_first_step(name, shard_kwargs, data, reference):
    """Issue 64: Muon over the default placement (the blocks' matrices cut into rows):
    its first step moves them onto owners (the layout owned_matrices() gives, checked),
    and training equals the one-process run (check)."""
    check(name, shard_kwargs, data, reference)
    moved = shard_tinylm(build_model(), **shard_kwargs)
    owned = shard_tinylm(build_model(), shard_placement_fn=OWNED, **shard_kwargs)
    assert layouts_of(moved) != layouts_of(owned)  # before its first step
    opt = muon(moved, moved.parameters())
    one_step(moved, opt, data[0][0])
    assert layouts_of(moved) == layouts_of(owned), name
    print(f"MUON {name}: laid out as owned_matrices() after its first step", flush=True)


def row_shards_refused():
    """Muon over rows asked explicitly (``Shard(0)``, 1 x 4: the blocks' matrices cut
    between ranks): refused at its first step, before any update, on every rank alike
    (the layout decides), naming the placement to use."""
    model = shard_tinylm(build_model(), mesh=ProcessMesh([0, 1, 2, 3]),
                         shard_placement_fn=lambda p: Shard(0))
    before = {n: t.numpy().copy() for n, t in paddle_hsdp.full_state_dict(model).items()}
    opt = muon(model, model.parameters())
    ids = batches(1, 1, world, PER_RANK)[0][0][rank * PER_RANK:(rank + 1) * PER_RANK]
    lm_loss(model, paddle.to_tensor(ids), uses_extra(rank)).backward()
    try:
        opt.step()
    except NotImplementedError as e:
        assert "owned_matrices()" in str(e) and "Shard(0)" in str(e), str(e)
        print(f"MUON refused on row shards: {e}", flush=True)
    else:
        raise AssertionError("Muon on row shards was not refused")
    opt.clear_grad()
    after = paddle_hsdp.full_state_dict(model)
    assert all(np.array_equal(before[n], after[n].numpy()) for n in before)


def apart_step_refused(data):
    """Issue 65: where a replica keeps a shared matrix's momentum alone (2 x 2, a block a
    unit), a step with set_requires_all_reduce(False) (each replica on its own grads)
    is refused on every rank before any update, naming the ways out."""
    model = shard_tinylm(build_model(), shard_placement_fn=OWNED)
    opt = muon(model, model.parameters())
    one_step(model, opt, data[0][0])
    before = {n: t.numpy().copy() for n, t in paddle_hsdp.full_state_dict(model).items()}
    model.set_requires_all_reduce(False)
    ids = data[1][0][rank * PER_RANK:(rank + 1) * PER_RANK]
    lm_loss(model, paddle.to_tensor(ids), uses_extra(rank)).backward()
    try:
        opt.step()
    except NotImplementedError as e:
        assert "set_requires_all_reduce(False)" in str(e) and \
            "share_over_replicas=False" in str(e), str(e)
    else:
        raise AssertionError("a step apart with the momentum on one replica was not refused")
    opt.clear_grad()
    model.set_requires_all_reduce(True)
    after = paddle_hsdp.full_state_dict(model)
    assert all(np.array_equal(before[n], after[n].numpy()) for n in before)
    print("MUON refused apart: set_requires_all_reduce(False) at the step", flush=True)


set_dtype("float64")
DATA = batches(STEPS, 1, world, PER_RANK, seed=13)
REFERENCE_RUN = trained(DATA)
REFERENCE = REFERENCE_RUN[:3]
assert min(REFERENCE[2]) > CLIP, REFERENCE[2]  # the clip is active at every step
OWNED = paddle_hsdp.owned_matrices()
# the owners stay in the inner group (parts 1), each matrix given to one replica, its
# grad exchanged packed over the model (issue 65), a block a unit or every block in the
# root unit; outer_exchange="spread" (owners over inner x outer) in spread_to_packed
check("2x2", {"shard_placement_fn": OWNED}, DATA, REFERENCE, config.get("work"), parts=1)
check("2x2 root only", {"shard_placement_fn": OWNED, "root_only": True}, DATA, REFERENCE,
      parts=1)
check("hfsdp 2x2", {"shard_placement_fn": OWNED, "fsdp_outer_sharding": "optim"}, DATA,
      REFERENCE)
check("1x4", {"shard_placement_fn": OWNED, "mesh": ProcessMesh([0, 1, 2, 3])}, DATA, REFERENCE)
# inner 1: each rank owns every matrix of its own group, each matrix given to one of the
# 4 replicas (issue 65's done-when names 4 x 1)
check("4x1", {"shard_placement_fn": OWNED, "mesh": ProcessMesh(
    [[0], [1], [2], [3]], dim_names=["outer", "inner"])}, DATA, REFERENCE)
# offloaded shards: the reduction concatenates the full grads by offset (no grad grid)
check("2x2 offload", {"shard_placement_fn": OWNED,
                      "offload_policy": paddle_hsdp.CPUOffloadPolicy()}, DATA, REFERENCE)
# issue 65: 4 micro-steps per step (grads accumulated in the shards, the outer sync and
# Muon's update once per step) equal one step on the whole batch
DATA4 = batches(3, 1, world, 4, seed=17)
check("2x2 4 micro-steps", {"shard_placement_fn": OWNED, "root_only": True}, DATA4,
      trained(DATA4, per_rank=4)[:3], parts=1, per_rank=4, micro_steps=4)
# the default placement at 2 x 2, as Paddle's FSDP MoE test builds Muon (issue 64)
check("2x2 default placement", {}, DATA, REFERENCE)
moved_at_first_step("1x4 moved", {"mesh": ProcessMesh([0, 1, 2, 3])}, DATA, REFERENCE)
moved_at_first_step("hfsdp 2x2 moved", {"fsdp_outer_sharding": "optim"}, DATA, REFERENCE)
row_shards_refused()
apart_step_refused(DATA)
print(f"MUON done in {time.time() - started:.1f} s", flush=True)
finish()
