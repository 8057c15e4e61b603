"""HFSDP (``fsdp_outer_sharding="optim"``): the optimizer state sharded across the outer
group too, against single-process training and against HSDP on the same model.

Training (float32, parity.py's bound): TinyLM, AdamW with weight decay, global-norm
clipping active every step, 3 micro-steps per optimizer step, a skipped batch
(``clear_grad`` after a backward) at step 1, synced grads read after the first micro-step
of step 2 (``finish_grad_sync``, then more grads), a param unused on odd ranks; losses, global
norms, the synced first-step grads (``full_grads``) and every final parameter against
one process on the whole batch. Every step: every replica's inner shard bit-identical
to the other replicas' (all-gathered over the outer group outside paddle_hsdp), one
outer reduce-scatter plus one outer all-gather per trainable buffer and no outer
all-reduce, their wire bytes those of HSDP's one outer all-reduce (measured on the same
model, equal up to HFSDP's extra padding rows). The optimizer state per rank is 1/O of
HSDP's (``memory_report(model, opt)``), the shard parameters are distinct sub-blocks
counted by the clip on every rank (``is_firstly_shared``). ``set_requires_all_reduce
(False)`` at the step is refused on every rank before any collective. With
``variants``, ZeRO-1, ZeRO-2 and ``fleet.distributed_optimizer`` runs are held to the
same reference, replicas identical every step.

With ``reads_work``, a same-layout HSDP and HFSDP load each read the files' bytes
exactly once over all ranks (counted), and continue bit for bit.

With ``work`` in argv (the shared 2 x 2 launch), checkpoints: HSDP 2 x 2 -> HFSDP and
HFSDP -> HSDP load the saved state exactly (every tensor of a re-save equals the saved
one) and the next 3 steps match the uninterrupted run within 1e-6; HFSDP -> HFSDP
reads the files' bytes once over all ranks, its optimizer rows indexed by rule, and
continues bit for bit; flex_checkpoint's same-layout dcp round trip of the sub-shards
is exact. ``single_process_resume.py`` then loads the HFSDP checkpoint in one process.

argv: JSON with sharding_degree, outer, optionally outer_sharding (fleet's
``sharding_configs["fsdp_outer_sharding"]``: the units then inherit it), variants
(``[[zero stage or null, via fleet.distributed_optimizer], ...]``: more runs held to
the same reference), work and reads_work.
"""

import os

import numpy as np
from common import compare_with_reference, config_from_argv, finish, init_fleet, max_rel
from parity import set_dtype

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.checkpoint import load as checkpoint_load
from paddle_hsdp.checkpoint.format import Reader, numpy_dtype, pieces_of, read_whole
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import (batches, build_model, lm_loss, make_optimizer, shard_tinylm,
                    train_reference, train_steps, uses_extra)

STEPS, MICRO, PER_RANK, CLIP = 4, 3, 2, 0.1
SKIP_AT = 1  # a batch backpropagated and dropped by clear_grad before this step
EARLY_SYNC_AT = 2  # finish_grad_sync after this step's first micro-step, then more grads

config = config_from_argv()
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
O, I = hcg.get_fsdp_outer_degree(), hcg.get_fsdp_inner_group().nranks
# fleet's option (units inherit it) or fully_shard's keyword on fleet's HSDP groups
OPTIM = None if config.get("outer_sharding") == "optim" else "optim"
DTYPE = set_dtype("float32")
data = batches(STEPS, MICRO, world, PER_RANK)
esize = 4


def reference():
    grads = []

    def before_step(model):
        if not grads:
            grads.append({n: p.grad.numpy() for n, p in model.named_parameters()
                          if p.grad is not None})
        return sum(float((p.grad.astype("float64") ** 2).sum()) for p in model.parameters()
                   if p.grad is not None) ** 0.5

    losses, params, norms = train_reference(data, world, PER_RANK, CLIP, before_step=before_step)
    assert min(norms) > CLIP, norms  # clipping active every step
    return losses, params, norms, grads[0]


def trainable(model):
    return [b for u in hsdp_registry.units_under(model) for b in u.buffers if b.trainable]


def micro_step(model, micro):
    ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
    loss = lm_loss(model, ids, uses_extra(rank))
    (loss / MICRO).backward()
    t = paddle.to_tensor([float(loss)])
    dist.all_reduce(t)  # for the log only: not through comm, not counted
    return t.item() / world / MICRO


def check_replicas(model):
    """Every outer replica holds the same inner shard, bit for bit (gathered over the
    outer group with Paddle's own collective: the counter does not see it), once the
    rebuild the step owes has run (the next root forward would issue it; a read of the
    shards, as here, runs it)."""
    for unit in hsdp_registry.units_under(model):
        unit.ensure_rebuilt()
    for buf in trainable(model):
        parts = []
        dist.all_gather(parts, buf.storage.flat.clone(), group=buf.outer)
        for other in parts[1:]:
            assert np.array_equal(parts[0].numpy(), other.numpy()), buf.describe()


def outer_counter(model, hfsdp: bool, before=None):
    """The step's outer traffic (``before``: a counter snapshot of its first part): one
    reduce-scatter and one all-gather per trainable buffer (HFSDP), or one all-reduce
    (HSDP); returns the wire bytes."""
    bufs = trainable(model)
    snap = {**(before or {}), **comm.counter.snapshot()}
    ops = {op: s for (label, op), s in snap.items() if label == "outer"}
    if hfsdp:
        assert set(ops) == {"reduce_scatter", "all_gather"}, ops
        for op in ops.values():
            assert op.calls == len(bufs), (ops, len(bufs))
            assert op.wire_bytes == (O - 1) / O * sum(b.shard_numel for b in bufs) * esize
    else:
        assert set(ops) == {"all_reduce"} and ops["all_reduce"].calls == len(bufs), ops
    return sum(op.wire_bytes for op in ops.values())


def hsdp_baseline():
    """One HSDP step of the same model: its outer bytes and optimizer bytes per rank."""
    model = shard_tinylm(build_model(), fsdp_outer_sharding="none")
    opt = make_optimizer(model, model.parameters(), CLIP)
    comm.counter.reset()
    for micro in data[0]:
        micro_step(model, micro)
    opt.step()
    wire = outer_counter(model, hfsdp=False)
    opt_bytes = paddle_hsdp.memory_report(model, opt)["optimizer"]
    opt.clear_grad()
    return wire, opt_bytes, sum(b.logical_numel for b in trainable(model))


def train_variant(ref, zero_stage=None, via_fleet=False):
    """ZeRO-1/2 (set_zero_stage) or fleet.distributed_optimizer (its clip replaced by
    the HSDP one over the sub-blocks): parity and identical replicas."""
    from paddle.distributed import fleet

    ref_losses, ref_params, ref_norms, _ = ref
    model = shard_tinylm(build_model(), fsdp_outer_sharding=OPTIM)
    if zero_stage is not None:
        paddle_hsdp.set_zero_stage(model, zero_stage)
    opt = make_optimizer(model, model.parameters(), CLIP)
    if via_fleet:
        opt = fleet.distributed_optimizer(opt)
    losses, worst = [], {"norm": 0.0}
    for step, micro_batches in enumerate(data):
        losses.append(sum(micro_step(model, micro) for micro in micro_batches))
        opt.step()
        worst["norm"] = max(worst["norm"], max_rel(paddle_hsdp.last_global_norm(opt),
                                                  ref_norms[step]))
        check_replicas(model)
        opt.clear_grad()
    name = f"zero{zero_stage}" if zero_stage else "fleet_opt"
    compare_with_reference(f"hfsdp {O}x{I} {name}", paddle_hsdp.full_state_dict(model),
                           ref_params, losses, ref_losses, worst)
    print(f"HFSDP_VARIANT {name}: max rel diff {max(worst.values()):.2e}", flush=True)


def train_hfsdp(ref, hsdp):
    ref_losses, ref_params, ref_norms, ref_grads = ref
    model = shard_tinylm(build_model(), fsdp_outer_sharding=OPTIM)
    for unit in hsdp_registry.units_under(model):
        assert unit.policies.outer_sharding == "optim", unit.label
    for buf in trainable(model):
        assert buf.parts == O, (buf.parts, buf.describe())
        for sp in buf.params:  # distinct sub-blocks: the clip counts them on every rank
            assert getattr(sp.shard, "is_firstly_shared", True) is not False, sp.fqn
            assert list(sp.shard.shape) == [sp.slot.sub_rows[1]] + sp.rest, sp.fqn
    opt = make_optimizer(model, model.parameters(), CLIP)
    losses, worst = [], {"norm": 0.0, "outer_bytes": 0.0}
    hsdp_wire, hsdp_opt_bytes, logical = hsdp
    for step, micro_batches in enumerate(data):
        if step == SKIP_AT:  # a batch dropped after its backward leaves nothing behind
            micro_step(model, data[0][0])
            opt.clear_grad()
        comm.counter.reset()
        total = micro_step(model, micro_batches[0])
        if step == EARLY_SYNC_AT:  # synced grads read early (logging), more grads after
            paddle_hsdp.finish_grad_sync(opt)
            comm.counter.reset()  # the step's own sync is counted below
        total += sum(micro_step(model, micro) for micro in micro_batches[1:])
        synced = None
        if step == 0:
            paddle_hsdp.finish_grad_sync(opt)  # the step then does nothing more
            synced = comm.counter.snapshot()  # full_grads' own outer gathers left out
            for name, g in paddle_hsdp.full_grads(model).items():
                if name in ref_grads:
                    worst["grad " + name] = max_rel(g.numpy(), ref_grads[name])
            comm.counter.reset()
        opt.step()
        for unit in hsdp_registry.units_under(model):  # the outer all-gather the step
            unit.ensure_rebuilt()  # owes (the next forward would issue it): counted here
        worst["norm"] = max(worst["norm"], max_rel(paddle_hsdp.last_global_norm(opt),
                                                  ref_norms[step]))
        wire = outer_counter(model, hfsdp=True, before=synced)
        # the same bytes as HSDP's one all-reduce, up to HFSDP's extra padding rows
        extra = 2 * (O - 1) / O * (sum(b.shard_numel for b in trainable(model)) * I
                                   - logical) / I * esize
        assert hsdp_wire <= wire <= hsdp_wire + extra, (wire, hsdp_wire, extra)
        worst["outer_bytes"] = max(worst["outer_bytes"], wire / hsdp_wire - 1)
        check_replicas(model)
        opt.clear_grad()
        losses.append(total)
    opt_bytes = paddle_hsdp.memory_report(model, opt)["optimizer"]
    check_optimizer_bytes(model, opt_bytes, hsdp_opt_bytes)
    check_refusal(model, opt)
    full = paddle_hsdp.full_state_dict(model)
    outer_bytes = worst.pop("outer_bytes")
    compare_with_reference(f"hfsdp {O}x{I}", full, ref_params, losses, ref_losses, worst)
    print(f"HFSDP_PARITY {O}x{I} {DTYPE}: max rel diff {max(worst.values()):.2e} "
          f"(loss {worst['loss']:.2e}, norm {worst['norm']:.2e}); outer bytes/step "
          f"{hsdp_wire * (1 + outer_bytes):.0f} vs HSDP {hsdp_wire:.0f} (+{outer_bytes:.2%} "
          f"padding); optimizer bytes/rank {opt_bytes} vs HSDP {hsdp_opt_bytes} "
          f"({hsdp_opt_bytes / opt_bytes:.2f}x)", flush=True)


def check_optimizer_bytes(model, opt_bytes, hsdp_opt_bytes):
    """AdamW's two moments cover exactly the rank's sub-blocks (whole rows, no padding:
    engine/layout.py), and over the job every parameter once, where HSDP holds every
    parameter once per outer replica: 1/O of HSDP's; two scalar beta powers per param
    as in HSDP."""
    params = [sp for b in trainable(model) for sp in b.params]
    scalars = 2 * 4 * len(params)
    moments = opt_bytes - scalars
    assert moments == 2 * esize * sum(sp.sub_numel for sp in params), (opt_bytes, moments)
    totals = paddle.to_tensor([moments, hsdp_opt_bytes - scalars], dtype="int64")
    dist.all_reduce(totals)  # over the job
    total, hsdp_total = (int(v) for v in totals.numpy())
    logical = sum(sp.numel for sp in params)
    assert total * O == hsdp_total == O * 2 * esize * logical, (total, hsdp_total, logical)


def check_refusal(model, opt):
    """set_requires_all_reduce(False) at the step: refused on every rank, no collective."""
    model.set_requires_all_reduce(False)
    micro_step(model, data[0][0])
    comm.counter.reset()
    try:
        opt.step()
        raise AssertionError("a step without the outer sync was accepted")
    except NotImplementedError as e:
        assert "fsdp_outer_sharding='optim'" in str(e), e
    assert not comm.counter.snapshot(), comm.counter.snapshot()
    opt.clear_grad()
    model.set_requires_all_reduce(True)


ref = reference()
train_hfsdp(ref, hsdp_baseline())
for variant in config.get("variants", []):  # [zero stage or None, via fleet]
    train_variant(ref, *variant)


# ------------------------------------------------------------------ checkpoints
SAVE_AT, MORE = 2, 3
ck_data = batches(SAVE_AT + MORE, 2, world, PER_RANK, seed=3)


def states(path) -> dict:
    """Every tensor of a checkpoint, whole (params and optimizer states)."""
    meta, reader = checkpoint.read_metadata(path), Reader(path)
    return {name: read_whole(reader, name, entry) for name, entry in meta["tensors"].items()}


def shard(mode, seed=2024):
    model = shard_tinylm(build_model(seed), fsdp_outer_sharding=mode)
    return model, make_optimizer(model, model.parameters(), CLIP)


def train(model, opt, steps):
    return train_steps(model, opt, [ck_data[i] for i in steps], rank, world, PER_RANK)


def params(model):
    return {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(model).items()}


def check_checkpoints(work):
    runs = {}
    for mode in ("none", "optim"):  # save after SAVE_AT steps, then the uninterrupted run
        model, opt = shard(mode)
        train(model, opt, range(SAVE_AT))
        path = os.path.join(work, f"hfsdp_ckpt_{mode}")
        checkpoint.save_checkpoint(path, model, opt, extra={"step": SAVE_AT})
        if mode == "optim" and rank == 0:  # for the one-process load
            np.savez(os.path.join(work, "hfsdp_full.npz"),
                     **{k.replace(".", "__"): v for k, v in params(model).items()})
        elif mode == "optim":
            params(model)  # a collective: every rank
        losses = train(model, opt, range(SAVE_AT, SAVE_AT + MORE))
        runs[mode] = (path, losses, params(model))
    check_set_state_dict(runs["optim"][2])
    for saved, into in (("none", "optim"), ("optim", "none"), ("optim", "optim")):
        path, ref_losses, ref_params = runs[saved]
        model, opt = shard(into, seed=99)  # other weights: loading must matter
        read = counted_load(path, model, opt)
        if saved == into:  # each rank reads its own ruled rows: the files once in all
            assert read == bytes_in_files(path), (read, bytes_in_files(path))
            check_ruled_index(path)
        again = os.path.join(work, f"hfsdp_resaved_{saved}_{into}")
        checkpoint.save_checkpoint(again, model, opt)
        if rank == 0:  # every param and optimizer state, whole: exactly the saved ones
            a, b = states(path), states(again)
            assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
            assert all(np.array_equal(a[k], b[k]) for k in a), \
                [k for k in a if not np.array_equal(a[k], b[k])]
        losses = train(model, opt, range(SAVE_AT, SAVE_AT + MORE))
        got = params(model)
        if saved == into:  # the same layout: bit for bit
            assert losses == ref_losses and all(np.array_equal(got[k], ref_params[k])
                                                for k in ref_params)
            worst = 0.0
        else:
            worst = max([max_rel(got[k], ref_params[k]) for k in ref_params]
                        + [max_rel(np.array(losses), np.array(ref_losses))])
            assert worst <= 1e-6, worst
        print(f"HFSDP_RESUME {saved}->{into}: saved state loaded exactly ({read} bytes "
              f"read by all ranks), next {MORE} steps max rel diff {worst:.2e}", flush=True)
    check_flex(work)


def bytes_in_files(path) -> int:
    """The tensor bytes the checkpoint's files hold (listed and ruled pieces)."""
    meta = checkpoint.read_metadata(path)
    return sum(int(np.prod(p["shape"])) * np.dtype(numpy_dtype(t["dtype"])).itemsize
               for name, t in meta["tensors"].items() for p in pieces_of(name, t)
               if "file" in p)


def counted_load(path, model, opt) -> int:
    """``load_checkpoint`` on every rank; the bytes all ranks read from the files."""
    readers = []

    class Counting(Reader):
        def __init__(self, where):
            super().__init__(where)
            readers.append(self)

    checkpoint_load.Reader = Counting
    try:
        assert checkpoint.load_checkpoint(path, model, opt) == {"step": SAVE_AT}
    finally:
        checkpoint_load.Reader = Reader
    read = paddle.to_tensor([sum(r.bytes_read for r in readers)], dtype="int64")
    dist.all_reduce(read)
    return int(read.item())


def check_ruled_index(path):
    """HFSDP's optimizer rows are indexed by rule (checkpoint/rules.py): no listed
    piece, one rule per buffer, the FSDP group's ranks once."""
    meta = checkpoint.read_metadata(path)
    moments = {n: t for n, t in meta["tensors"].items() if n.endswith("/optim/moment1")}
    assert moments and all(t["rules"] and not t["pieces"] for t in moments.values()), moments
    assert [len(r) for r in meta["rank_groups"].values()] == [world], meta["rank_groups"]
    return len(meta["rules"])


def check_reads(work):
    """HSDP and HFSDP O x I: a same-layout load reads each byte of the files exactly
    once over all ranks (the outer replicas split the reading; each rank reads its own
    ruled rows), loads exactly, and the next steps continue bit for bit."""
    for mode in ("none", "optim"):
        model, opt = shard(mode)
        train(model, opt, range(SAVE_AT))
        path = os.path.join(work, f"reads_{O}x{I}_{mode}")
        checkpoint.save_checkpoint(path, model, opt, extra={"step": SAVE_AT})
        rules = check_ruled_index(path) if mode == "optim" else 0
        fresh, fresh_opt = shard(mode, seed=99)
        read, in_files = counted_load(path, fresh, fresh_opt), bytes_in_files(path)
        assert read == in_files, (mode, read, in_files)
        later = range(SAVE_AT, SAVE_AT + MORE)
        assert train(fresh, fresh_opt, later) == train(model, opt, later)
        got, want = params(fresh), params(model)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        print(f"LOAD_READS {O}x{I} {mode}: {read} bytes read by all ranks, the files' "
              f"{in_files}; {rules} rule(s); the next {MORE} steps bit for bit", flush=True)


def check_set_state_dict(full):
    """``set_state_dict`` of full tensors writes every outer sub-block of the inner
    blocks (no collective): the gathered parameters are the given ones."""
    model, _ = shard("optim", seed=99)
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in full.items()})
    got = params(model)
    assert all(np.array_equal(got[k], full[k]) for k in full)
    print("HFSDP_SET_STATE_DICT: full tensors in, the same full tensors out", flush=True)


def check_flex(work):
    """flex_checkpoint: each rank describes the sub-block its optimizer sees (distinct
    rows on every rank); a same-layout dcp round trip is exact and the next step too."""
    from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict

    model, opt = shard("optim")
    train(model, opt, range(SAVE_AT))
    sd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(sd)
    rows = {k: [int(w.global_offset[0]), int(w.local_shape[0])] for k, w in sd.items()}
    mine = []
    dist.all_gather_object(mine, rows)
    frozen = {n for n, p in model.named_parameters() if p.stop_gradient}  # replicated
    for key, weight in sd.items():  # the ranks' pieces tile every tensor exactly once
        pieces = [tuple(r[key]) for r in mine if key in r]
        pieces = sorted(set(pieces) if key in frozen else pieces)
        assert sum(n for _, n in pieces) == weight.global_shape[0], (key, pieces)
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:])), (key, pieces)
    save_state_dict({**sd, **osd}, os.path.join(work, "hfsdp_dcp"), save_replicas=True)
    fresh, fresh_opt = shard("optim", seed=99)
    fresh_sd = fresh.sharded_state_dict()
    load_state_dict({**fresh_sd, **fresh_opt.sharded_state_dict(fresh_sd)},
                    os.path.join(work, "hfsdp_dcp"))
    expected, loaded = params(model), params(fresh)  # the rebuild runs first
    assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
    step = [ck_data[SAVE_AT]]
    assert train_steps(fresh, fresh_opt, step, rank, world, PER_RANK) == \
        train_steps(model, opt, step, rank, world, PER_RANK)
    after, stepped = params(model), params(fresh)
    assert all(np.array_equal(stepped[k], after[k]) for k in after)
    print(f"HFSDP_FLEX: sub-shards tile every tensor, dcp round trip of params and "
          f"{len(osd)} optimizer states exact, next step identical", flush=True)


if config.get("work"):
    check_checkpoints(config["work"])
if config.get("reads_work"):
    check_reads(config["reads_work"])
finish()
