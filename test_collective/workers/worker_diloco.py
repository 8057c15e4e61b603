"""The outer sync every H steps (DiLoCo, ``OuterSyncPolicy(every=4)``) on HSDP 2 x 2,
float64, AdamW inside, Nesterov SGD outside, against a one-process reference that
trains the O replicas on their own batches (each the mean over its inner ranks' rows)
with their own AdamW and applies the same outer step to their mean pseudo-gradient
every H steps. 10 steps: syncs after steps 4 and 8, then two steps apart again (the
position in the interval is 2 at the end). Checks every step's losses and parameters
of each replica (parity bound), also with a grad clip (each replica clips by its own
norm), the replicas bit-identical after a sync and apart between syncs, and the comm
counter: no outer collective between syncs, one
reduce-scatter and one all-gather per trainable buffer at a sync, each (O - 1) / O of
the padded shard. Then the same with ``outer_compress="int8"``: the replicas agree
after each sync and the outer group carries only the int8 all-gather and the new
params' all-gather.

Then, 6 steps each: plain HSDP with ``set_requires_all_reduce(False)`` at the step and a
clip (each replica clipped by its own norm, as replicas that never sync), and streaming
DiLoCo (``fragments=2``) against the reference of the same schedule, each sync moving
its fragment's bytes only.

After step 6 (mid-interval) the run saves a checkpoint, which then loads in another
layout (4 x 1, an explicit mesh): the outer anchor, momentum and position in the
interval equal the reference's. argv: JSON with ``work`` (where it saves).

Prints ``DILOCO <name> ...`` lines.
"""

import json
import os
import sys

import numpy as np
from common import finish, init_fleet
from parity import report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import (batches, build_model, fragment_of, lm_loss, make_optimizer, shard_tinylm,
                    uses_extra)
from parity import max_rel

STEPS, EVERY, MICRO, PER_RANK = 10, 4, 2, 2
SAVE_AT = 6  # two steps after the first sync: the checkpoint's position in the interval
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
CLIP = 0.3  # below the replicas' grad norms here: the clip acts
POLICY = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=OUTER_LR, momentum=OUTER_MOMENTUM)

hcg = init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
inner, outer = hcg.get_fsdp_inner_group(), hcg.get_fsdp_outer_group()
I, O = inner.nranks, outer.nranks
DATA = batches(STEPS, MICRO, world, PER_RANK, seed=17)


def replica_ranks():
    """Global ranks of each replica (outer index), gathered once (not through
    paddle_hsdp)."""
    mine = paddle.to_tensor([outer.rank], dtype="int64")
    every = []
    dist.all_gather(every, mine)
    index = [int(t.item()) for t in every]
    return [[r for r in range(world) if index[r] == q] for q in range(O)]


def micro_loss(model, micro, ranks):
    return sum(lm_loss(model, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                       uses_extra(r)) for r in ranks) / len(ranks)


def reference(groups, data, clip=None, every=EVERY, fragments=None):
    """Per step: each replica's loss and parameters, as DiLoCo defines them (``every``
    None: the replicas never sync; ``fragments``, ``(F, {name: fragment})``: streaming,
    fragment f's params synced where step % every comes round to f every // F); and the
    outer state (anchor, momentum) after step SAVE_AT."""
    count, fragment = fragments or (1, {})
    replicas = [build_model() for _ in groups]
    opts = [make_optimizer(m, m.parameters(), clip) for m in replicas]
    trainable = [n for n, p in replicas[0].named_parameters() if not p.stop_gradient]
    anchor = {n: p.numpy().copy() for n, p in replicas[0].named_parameters()}
    momentum = {n: np.zeros_like(anchor[n]) for n in trainable}
    losses, params = [], []
    saved = None
    for s, step in enumerate(data):
        step_losses = []
        for model, opt, ranks in zip(replicas, opts, groups, strict=True):
            total = 0.0
            for micro in step:
                loss = micro_loss(model, micro, ranks)
                (loss / len(step)).backward()
                total += float(loss) / len(step)
            opt.step()
            opt.clear_grad()
            step_losses.append(total)
        due = [] if every is None else [
            n for n in trainable if (s + 1) % every == fragment.get(n, 0) * every // count]
        if due:
            named = [dict(m.named_parameters()) for m in replicas]
            for n in due:
                deltas = [anchor[n] - p[n].numpy() for p in named]
                mean = sum(deltas[1:], deltas[0]) / len(deltas)
                momentum[n] = OUTER_MOMENTUM * momentum[n] + mean
                new = anchor[n] - OUTER_LR * (mean + OUTER_MOMENTUM * momentum[n])
                for p in named:
                    p[n].set_value(new)
                anchor[n] = new
        if s + 1 == SAVE_AT:
            saved = ({n: a.copy() for n, a in anchor.items() if n in momentum},
                     {n: m.copy() for n, m in momentum.items()})
        losses.append(step_losses)
        params.append([{n: p.numpy().copy() for n, p in m.state_dict().items()}
                       for m in replicas])
    return losses, params, saved


def train(policy, mp_policy=None, save=None, data=DATA, clip=None, all_reduce=True):
    model = shard_tinylm(build_model(), outer_sync_policy=policy, mp_policy=mp_policy)
    model.set_requires_all_reduce(all_reduce)  # False: each replica steps on its own grads
    opt = make_optimizer(model, model.parameters(), clip)
    losses, params, counts = [], [], []
    for step in data:
        comm.counter.reset()
        total = 0.0
        for micro in step:
            loss = micro_loss(model, micro, [rank])
            (loss / len(step)).backward()
            total += float(loss) / len(step)
        opt.step()
        counts.append(comm.counter.snapshot())
        opt.clear_grad()
        if save is not None and len(counts) == SAVE_AT:
            paddle_hsdp.save_checkpoint(save, model, opt)
        mean = paddle.to_tensor([total], dtype="float64")  # this replica's loss
        dist.all_reduce(mean, group=inner)
        losses.append(float(mean) / I)
        params.append({n: v.numpy() for n, v in paddle_hsdp.full_state_dict(model).items()})
    return model, losses, params, counts


def replicas_agree(model) -> bool:
    """This rank's shards equal its outer peers', bit for bit (one all-gather)."""
    bufs = [b for u in hsdp_registry.units_under(model) for b in u.buffers if b.trainable]
    mine = paddle.concat([b.storage.raw[:b.shard_numel] for b in bufs])
    both = paddle.empty([O * mine.shape[0]], dtype=mine.dtype)
    comm.all_gather_into(both, mine, outer, tag="test")
    halves = both.numpy().reshape(O, -1)
    return bool((halves == halves[0]).all())


set_dtype("float64")
groups = replica_ranks()
me = outer.rank
ref_losses, ref_params, (ref_anchor, ref_momentum) = reference(groups, DATA)
CKPT = os.path.join(json.loads(sys.argv[1])["work"], "diloco_ckpt")
model, losses, params, counts = train(POLICY, save=CKPT)
assert model.embed._hsdp_unit_.outer_sync is not None


def against_reference(losses, params, ref_losses, ref_params):
    worst = {}
    for s in range(len(losses)):
        worst[f"loss {s}"] = max_rel([losses[s]], [ref_losses[s][me]])
        for name, value in params[s].items():
            worst[f"{name} {s}"] = max_rel(value, ref_params[s][me][name])
    return worst


worst = against_reference(losses, params, ref_losses, ref_params)
report("diloco h4 2x2 losses and params vs one-process DiLoCo", worst)
# the check can fail: the replicas really trained apart, and apart from plain averaging
apart = max(max_rel(ref_params[STEPS - 1][0][n], ref_params[STEPS - 1][1][n])
            for n in ref_params[STEPS - 1][0])
assert apart > 1e-3, apart
print(f"DILOCO parity h{EVERY}: {max(worst.values()):.1e} over {STEPS} steps "
      f"(replicas apart by {apart:.1e} between syncs)", flush=True)

# bytes: nothing on the outer group between syncs; at a sync one reduce-scatter and one
# all-gather per trainable buffer, each (O - 1) / O of the shard padded to O pieces
bufs = [b for u in hsdp_registry.units_under(model) for b in u.buffers if b.trainable]
esize = paddle.zeros([1], dtype="float64").element_size()
padded = sum(-(-b.shard_numel // O) * O for b in bufs)
for s, snap in enumerate(counts):
    outer_ops = {op: st for (group, op), st in snap.items() if group == "outer"}
    if (s + 1) % EVERY:
        assert not outer_ops, (s, outer_ops)
        continue
    assert set(outer_ops) == {"reduce_scatter", "all_gather"}, (s, outer_ops)
    for op in ("reduce_scatter", "all_gather"):
        st = outer_ops[op]
        assert st.calls == len(bufs), (op, st)
        assert st.wire_bytes == (O - 1) / O * padded * esize, (op, st, padded)
print(f"DILOCO no outer collective between syncs; at a sync {2 * len(bufs)} collectives, "
      f"{2 * (O - 1) / O * padded * esize:.0f} bytes", flush=True)
assert not replicas_agree(model)  # two steps after the last sync
print("DILOCO replicas apart after the last sync's interval", flush=True)

# the checkpoint (saved by 2 x 2 after step 6) loads in another layout, 4 x 1 (four
# replicas of the whole model, each holding 1/4 of the outer momentum): the anchor,
# the momentum and the position in the interval are the reference's
mesh = ProcessMesh([[0], [1], [2], [3]], dim_names=["outer", "inner"])
other = shard_tinylm(build_model(seed=5), mesh=mesh, outer_sync_policy=POLICY)
other_opt = make_optimizer(other, other.parameters(), None)
paddle_hsdp.load_checkpoint(CKPT, other, other_opt)
worst = {}
for unit in hsdp_registry.units_under(other):
    state = unit.outer_sync
    assert state.steps == SAVE_AT % EVERY, state.steps
    momentum = state.gather_momentum(unit)
    for buf in (b for b in unit.buffers if b.trainable):
        for sp in buf.params:
            name = hsdp_registry.param_path(sp)
            worst[name + " anchor"] = max_rel(state.read_block(state.anchors[buf.index], sp)
                                              .numpy(), ref_anchor[name])
            worst[name + " momentum"] = max_rel(state.read_block(momentum[buf.index], sp)
                                                .numpy(), ref_momentum[name])
assert len(worst) == 2 * len(ref_momentum), (sorted(worst), sorted(ref_momentum))
report("diloco checkpoint 2x2 -> 4x1: outer anchor and momentum", worst)
print(f"DILOCO checkpoint 2x2 -> 4x1: outer state {max(worst.values()):.1e} from the "
      f"reference's, position {SAVE_AT % EVERY} of {EVERY}", flush=True)

# a grad clip: each replica clips by its own norm (over its inner group), as the
# reference's replicas do, 6 steps (a sync after 4)
CLIP_DATA = DATA[:6]
clip_ref = reference(groups, CLIP_DATA, CLIP)
clipped, clip_losses, clip_params, _ = train(POLICY, data=CLIP_DATA, clip=CLIP)
worst = against_reference(clip_losses, clip_params, *clip_ref[:2])
report("diloco h4 2x2 with a per-replica clip vs one-process DiLoCo", worst)
acted = max(max_rel(clip_ref[1][5][me][n], ref_params[5][me][n]) for n in ref_params[5][me])
assert acted > 1e-3, acted  # the clip changed the training: the check can fail
print(f"DILOCO clip per replica: {max(worst.values()):.1e} over {len(CLIP_DATA)} steps",
      flush=True)

# plain HSDP with set_requires_all_reduce(False) at the step: the replicas step on their
# own grads, so each clips by its own norm (the bug: one norm, replica 0's, for both),
# as the reference's replicas that never sync; then on again: one norm over the job
apart_ref = reference(groups, CLIP_DATA, CLIP, every=None)
_, alone_losses, alone_params, _ = train(None, data=CLIP_DATA, clip=CLIP, all_reduce=False)
worst = against_reference(alone_losses, alone_params, *apart_ref[:2])
report("set_requires_all_reduce(False) 2x2 with a clip vs replicas apart", worst)
unclipped = reference(groups, CLIP_DATA, None, every=None)[1][5][me]
acted = max(max_rel(apart_ref[1][5][me][n], unclipped[n]) for n in unclipped)
assert acted > 1e-3, acted  # the clip changed the training: the check can fail
print(f"DILOCO set_requires_all_reduce(False) clips per replica: {max(worst.values()):.1e} "
      f"over {len(CLIP_DATA)} steps", flush=True)

# streaming (two fragments dealt by size, models.fragment_of; here blocks 0 and 2 in
# one, the embedding, block 1 and the root in the other): fragment 1
# synced after steps 2 and 6, fragment 0 after step 4, each moving its own buffers only
STREAM = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                     fragments=2)
streamed, stream_losses, stream_params, stream_counts = train(STREAM, data=CLIP_DATA)
by_name = fragment_of(streamed, 2)
stream_ref = reference(groups, CLIP_DATA, fragments=(2, by_name))
worst = against_reference(stream_losses, stream_params, *stream_ref[:2])
report("diloco h4 streaming f2 2x2 vs one-process streaming DiLoCo", worst)
apart = max(max_rel(stream_ref[1][5][me][n], ref_params[5][me][n]) for n in by_name)
assert apart > 1e-3, apart  # not the unfragmented run: the check can fail
per_sync = []
for s, snap in enumerate(stream_counts):
    moved = sum(st.wire_bytes for (group, op), st in snap.items() if group == "outer")
    assert (moved > 0) == ((s + 1) % 2 == 0), (s, moved)  # steps 2, 4, 6 only
    if moved:
        per_sync.append(moved)
whole = 2 * (O - 1) / O * padded * esize  # one unfragmented sync's bytes
assert sum(per_sync[:2]) == whole and max(per_sync) < whole, (per_sync, whole)
print(f"DILOCO streaming f2: {max(worst.values()):.1e} over {len(CLIP_DATA)} steps; bytes "
      f"per sync {', '.join(f'{b:.0f}' for b in per_sync)} (one whole sync {whole:.0f})",
      flush=True)

# compressed: the replicas agree after a sync, and the outer group carries the int8
# all-gather and the new params' all-gather only
set_dtype("float32")
mp = paddle_hsdp.MixedPrecisionPolicy(outer_compress="int8", outer_compress_block=16)
STEPS = EVERY
DATA = DATA[:EVERY]
model, losses, params, counts = train(POLICY, mp, data=DATA)
assert replicas_agree(model)
for s, snap in enumerate(counts):
    outer_ops = {op for (group, op), st in snap.items() if group == "outer"}
    assert outer_ops == (set() if (s + 1) % EVERY else {"all_reduce_int8", "all_gather"}), \
        (s, outer_ops)
print("DILOCO int8 replicas bit-identical after the sync, outer ops int8 + all_gather",
      flush=True)
finish()
