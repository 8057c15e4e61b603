"""ZeRO-1/2/3 (set_zero_stage), set_requires_all_reduce / set_requires_gradient_sync
and prefetch on HSDP 2x2: each matches single-process training on the whole batch,
and the comm counter and memory report show what each level costs.

Per optimizer step of K=3 micro-steps, for a model with A buffers (B of them trainable;
one all-gather per buffer each time its unit is gathered):
  ZeRO-3: all-gathers 2K A, reduce-scatters K B, outer all-reduces B
  ZeRO-2: all-gathers K A,  reduce-scatters K B, outer all-reduces B
  ZeRO-1: all-gathers A,    reduce-scatters B,   outer all-reduces B
Held bytes during backward (peak gathered params + grads held after it):
  ZeRO-3 < ZeRO-2 < ZeRO-1.
"""

import numpy as np
from common import config_from_argv, finish, init_fleet, max_rel
import parity

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import batches, build_model, lm_loss, make_optimizer, train_reference, uses_extra

STEPS, MICRO, PER_RANK, CLIP = 3, 3, 2, 0.2

config = config_from_argv()
parity.set_dtype(config.get("dtype", "float64"))
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
I = hcg.get_fsdp_inner_group().nranks
data = batches(STEPS, MICRO, world, PER_RANK)
ref_losses, ref_params, ref_norms = train_reference(data, world, PER_RANK, CLIP)
assert min(ref_norms) > CLIP, ref_norms


def train(stage=None, toggle=None, prefetch=None):
    """``toggle``: a module method switched off on non-last micro-steps."""
    model = build_model()
    for layer in [model.embed] + list(model.blocks):
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    if stage is not None:
        paddle_hsdp.set_zero_stage(model, stage)
    if prefetch is not None:
        model.set_prefetch_count(forward=prefetch, backward=prefetch)
    opt = make_optimizer(model, model.parameters(), CLIP)
    units = hsdp_registry.units_under(model)
    losses, per_step, held, peak_units, worst = [], [], [], [], {"norm": 0.0}
    for step, micro_batches in enumerate(data):
        comm.counter.reset()
        total = 0.0
        for m, micro in enumerate(micro_batches):
            if toggle is not None:
                getattr(model, toggle)(m == MICRO - 1)
            ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
            loss = lm_loss(model, ids, uses_extra(rank))
            paddle_hsdp.reset_peak_memory()
            (loss / MICRO).backward()
            report = paddle_hsdp.memory_report(model)
            held.append(report["peak_gathered"] + report["grad"])
            peak_units.append(report["peak_gathered_units"])
            t = paddle.to_tensor([float(loss)])
            dist.all_reduce(t)
            total += t.item() / world / MICRO
        opt.step()
        opt.clear_grad()
        worst["norm"] = max(worst["norm"], abs(paddle_hsdp.last_global_norm(opt)
                                               - ref_norms[step]) / ref_norms[step])
        losses.append(total)
        per_step.append({op: comm.counter.get(label, op).calls for label, op in
                         [("inner", "all_gather"), ("inner", "reduce_scatter"),
                          ("outer", "all_reduce")]})
    for name, value in paddle_hsdp.full_state_dict(model).items():
        worst[name] = max_rel(value.numpy(), ref_params[name])
    worst["loss"] = max_rel(np.array(losses), np.array(ref_losses))
    measured = parity.report(f"zero stage={stage} toggle={toggle} prefetch={prefetch}", worst)
    return {"worst": measured, "calls": per_step, "held": max(held), "units": max(peak_units),
            "all_buffers": sum(len(u.buffers) for u in units),
            "buffers": sum(b.trainable for u in units for b in u.buffers)}


results = {}
for stage in (3, 2, 1):
    r = results[stage] = train(stage=stage)
    A, B, K = r["all_buffers"], r["buffers"], MICRO
    expected = {3: (2 * K * A, K * B, B), 2: (K * A, K * B, B), 1: (A, B, B)}[stage]
    for calls in r["calls"]:
        got = (calls["all_gather"], calls["reduce_scatter"], calls["all_reduce"])
        assert got == expected, (stage, got, expected, r["calls"])
    print(f"ZERO stage {stage}: per step all_gather {expected[0]}, reduce_scatter "
          f"{expected[1]}, outer all_reduce {expected[2]} (A={A}, B={B}, K={K}); held "
          f"during backward {r['held']:,} B; max rel diff {r['worst']:.2e}", flush=True)
assert results[3]["held"] < results[2]["held"] < results[1]["held"], \
    {s: results[s]["held"] for s in results}

# torch's accumulation idioms: off on non-last micro-steps, on for the last.
for toggle in ("set_requires_all_reduce", "set_requires_gradient_sync"):
    r = train(toggle=toggle)
    B, K = r["buffers"], MICRO
    rs = K * B if toggle == "set_requires_all_reduce" else B
    assert all(c["all_reduce"] == B and c["reduce_scatter"] == rs for c in r["calls"]), r["calls"]
    print(f"TOGGLE {toggle}: reduce_scatter {rs}/step, outer all_reduce {B}/step; "
          f"max rel diff {r['worst']:.2e}", flush=True)

# Prefetch never changes results and keeps at most 1 + prefetch units gathered
# (beyond the root and tied owners it pins) while a ZeRO-3 backward runs.
PINNED = 2  # the root and the embedding it borrows (tied head) stay gathered in backward
for count in (0, 2):
    r = train(stage=3, prefetch=count)
    assert r["units"] <= PINNED + 1 + count, r["units"]
    print(f"PREFETCH {count}: at most {r['units']} units gathered during backward "
          f"({PINNED} pinned + 1 + prefetch); held {r['held']:,} B; max rel diff "
          f"{r['worst']:.2e}", flush=True)
finish()
