"""fully_shard's knobs on HSDP 2 x 2, each against an independent single-process
reference of the same model and data (AdamW, global-norm clipping active, 2 micro-steps):

1. ``mp_policy=MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")`` on
   every unit. Reference: float32 masters whose values are replaced by their bf16
   rounding for each micro-step's forward + backward (grads are then w.r.t. the rounded
   params) and restored before the optimizer step. Plus the comm counter: the inner
   all-gathers move exactly half the bytes of an fp32 run, every reduce-scatter is
   float32, also when a parameter (``Block.extra``) first gets a grad in micro-step 1.
2. ``ignored_params``: one weight stays a full, ordinary parameter outside every buffer;
   the test all-reduces its grad itself.
3. ``shard_placement_fn`` returning ``Replicate()`` for one 2-D weight: whole on every
   rank, grads synchronised by the engine.
1b. ``reduce_dtype="bfloat16"``: reduce-scatter and outer all-reduce in bf16 (half the
   bytes of an fp32 run on the outer group), within bf16's tolerance of the reference.
1c. ``CPUOffloadPolicy`` with its path forced on CPU: equal to the fp32 run bit for bit,
   with one upload / download per collective counted.
1d. policy 1 with ``fsdp_outer_sharding="optim"`` (HFSDP): the same reference, the outer
   reduce-scatter and all-gather in float32; 1e. that with the offload path forced on
   CPU: equal to 1d bit for bit.
1f. the outer all-reduce issued during the step's last backward (from step 2 on, on the
   outer group's thread): the fp32 run equals a run with it off bit for bit (also with a
   root of two buffers, one reduced early and one at the end of backward), and the
   event trace's timestamps show the thread running all-reduces inside a 0.3 s
   backward compute of the main thread.

Prints ``KNOBS <name> max rel diff ...`` per check.
"""

import copy
import threading
import time

import numpy as np
from common import finish, init_fleet, max_rel
import parity

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import offload, outer_sync, trace
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import (HIDDEN, VOCAB, TiedHead, batches, build_model, lm_loss, make_optimizer,
                    shard_tinylm)

STEPS, MICRO, PER_RANK, CLIP = 3, 2, 2, 0.2
# float32 parity (parity.py's bound): both sides compute the same float32 math on the
# same (rounded) values and differ only in summation order (per-rank losses and
# inner/outer grad reductions). float32 on purpose: this is the bf16 path's check.
RTOL = parity.bound("float32")

hcg = init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
inner, outer = hcg.get_fsdp_inner_group(), hcg.get_fsdp_outer_group()
assert (outer.nranks, inner.nranks) == (2, 2), (outer.nranks, inner.nranks)
data = batches(STEPS, MICRO, world, PER_RANK)

IGNORED = "blocks.1.fc2.weight"      # [25, 8], inside a ZeRO-3 block unit
REPLICATED = "blocks.0.fc1.weight"   # [8, 25], inside a ZeRO-3 block unit


def use_extra(micro: int) -> bool:
    """``Block.extra`` is unused on every rank in micro-step 0, used in micro-step 1."""
    return micro == 1


# ------------------------------------------------------------------ reference
def train_reference(round_bf16: bool):
    """Single process, whole batch (the mean of every rank's chunk loss)."""
    model = build_model()
    opt = make_optimizer(model, model.parameters(), CLIP)
    params = list(model.parameters())  # the tied weight once; the frozen table too
    losses, norms = [], []
    for step in data:
        total = 0.0
        for m, micro in enumerate(step):
            if round_bf16:
                masters = [p.detach().clone() for p in params]
                with paddle.no_grad():
                    for p in params:
                        p.set_value(p.astype("bfloat16").astype("float32"))
            loss = 0.0
            for r in range(world):
                ids = paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK])
                loss = loss + lm_loss(model, ids, use_extra(m)) / world
            (loss / MICRO).backward()
            total += float(loss) / MICRO
            if round_bf16:
                with paddle.no_grad():
                    for p, master in zip(params, masters):
                        p.set_value(master)
        sq = sum(float((p.grad.astype("float64") ** 2).sum()) for p in params
                 if p.grad is not None)
        norms.append(sq ** 0.5)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    assert min(norms) > CLIP, norms  # clipping is active at every step
    return losses, {n: p.numpy() for n, p in model.state_dict().items()}, norms


# ------------------------------------------------------------------ dtype log
# Every collective the engine issues goes through comm's module attributes: wrap two of
# them to log (group label, op, dtype, elements) per call, next to comm.counter.
calls = []


def _logged(op, fn):
    def run(out, inp, group, *args, **kwargs):
        payload = out if op == "all_gather" else inp
        calls.append((kwargs.get("tag") or comm.group_label(group),
                      kwargs.get("counted_as", op), payload.dtype, int(payload.numel())))
        return fn(out, inp, group, *args, **kwargs)
    return run


_unlogged = (comm.all_gather_into, comm.reduce_scatter)  # restored at the end: the
comm.all_gather_into = _logged("all_gather", comm.all_gather_into)  # launch's later
comm.reduce_scatter = _logged("reduce_scatter", comm.reduce_scatter)  # workers share comm


# ------------------------------------------------------------------ HSDP runs
def shard(model=None, **kwargs):
    return shard_tinylm(model if model is not None else build_model(), **kwargs)


def train_hsdp(model, ignored=None):
    """``ignored``: a parameter the engine leaves alone; its grad is averaged here."""
    opt = make_optimizer(model, model.parameters(), CLIP)
    losses, norms, per_step = [], [], []
    for step in data:
        comm.counter.reset()
        del calls[:]
        total = 0.0
        for m, micro in enumerate(step):
            ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
            loss = lm_loss(model, ids, use_extra(m))
            (loss / MICRO).backward()
            t = paddle.to_tensor([float(loss)])
            dist.all_reduce(t)  # for the comparison only: not through comm
            total += t.item() / world / MICRO
        if ignored is not None:
            assert ignored.grad is not None and list(ignored.grad.shape) == list(ignored.shape)
            g = ignored.grad.clone()
            spread = paddle.concat([g, -g])  # max and -min over ranks in one call
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
            # the engine left it alone: every rank still holds the grad of its own data
            assert float((spread[:len(g)] + spread[len(g):]).abs().max()) > 0
            dist.all_reduce(g)
            paddle.assign(g / world, output=ignored.grad)
        opt.step()
        for unit in hsdp_registry.units_under(model):  # HFSDP: the outer all-gather the
            unit.ensure_rebuilt()  # step owes (the next forward would issue it), here
        norms.append(paddle_hsdp.last_global_norm(opt))
        opt.clear_grad()
        losses.append(total)
        per_step.append((comm.counter.snapshot(), list(calls)))
    return losses, norms, per_step


def compare(run, ref):
    losses, norms, _ = run
    ref_losses, _, ref_norms = ref
    return {"loss": max_rel(losses, ref_losses), "norm": max_rel(norms, ref_norms)}


def compare_params(model, ref_params, worst):
    full = paddle_hsdp.full_state_dict(model)
    assert set(full) == set(ref_params), set(full) ^ set(ref_params)
    for n, value in full.items():
        assert list(value.shape) == list(ref_params[n].shape), n
        worst[n] = max_rel(value.numpy(), ref_params[n])


failures = []


def report(name, worst, rtol=RTOL, note=""):
    """Called after a check's last collective, so a parity failure (the same on every
    rank) is recorded and the next checks still run; the worker fails at the end."""
    bad = parity.record(f"knobs {name}", worst, rtol)
    if bad:
        failures.append(f"{name}: parity failed (rtol {rtol}): {bad}")
        print(f"KNOBS {name} FAILED max rel diff {max(bad.values()):.2e}: {bad}", flush=True)
        return
    print(f"KNOBS {name} max rel diff {max(worst.values()):.2e} (loss {worst['loss']:.2e}, "
          f"norm {worst['norm']:.2e}, rtol {rtol:.0e}){note}", flush=True)


def trainable_buffers(model):
    return [b for u in hsdp_registry.units_under(model) for b in u.buffers if b.trainable]


def all_buffers(model):
    return [b for u in hsdp_registry.units_under(model) for b in u.buffers]


ref32 = train_reference(round_bf16=False)
ref16 = train_reference(round_bf16=True)
BF16_EFFECT = max_rel(ref16[0], ref32[0])  # how far a run that did not round would be
assert BF16_EFFECT > 1e-4, "bf16 rounding should change the losses"

# ---- 1. mixed precision (and an fp32 run of the same model for the byte counts)
fp32_model = shard()
fp32_run = train_hsdp(fp32_model)
fp32_worst = compare(fp32_run, ref32)
compare_params(fp32_model, ref32[1], fp32_worst)
parity.report("knobs fp32 run", fp32_worst)

mp = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
mp_model = shard(mp_policy=mp)
for buf in all_buffers(mp_model):
    assert buf.dtypes.gather == paddle.bfloat16 and buf.dtype == paddle.float32, buf.params[0].fqn
    assert buf.dtypes.reduce == paddle.float32
mp_run = train_hsdp(mp_model)
mp_worst = compare(mp_run, ref16)
compare_params(mp_model, ref16[1], mp_worst)
for p in mp_model.parameters():  # the optimizer's masters stay float32
    assert p.dtype == paddle.float32, p.name

trainable = trainable_buffers(mp_model)
rs_sizes = sorted(b.padded_numel for b in trainable)
for step, ((snap32, calls32), (snap16, calls16)) in enumerate(zip(fp32_run[2], mp_run[2])):
    ag32, ag16 = snap32[("inner", "all_gather")], snap16[("inner", "all_gather")]
    assert ag32.calls == ag16.calls > 0 and 2 * ag16.payload_bytes == ag32.payload_bytes, \
        (step, ag32, ag16)
    gathers = [c for c in calls16 if c[:2] == ("inner", "all_gather")]
    assert all(c[2] == paddle.bfloat16 for c in gathers), gathers
    assert ag16.payload_bytes == sum(n * 2 for *_, n in gathers)
    rs = snap16[("inner", "reduce_scatter")]
    scatters = [c for c in calls16 if c[:2] == ("inner", "reduce_scatter")]
    assert len(scatters) == rs.calls == MICRO * len(trainable), (scatters, len(trainable))
    assert all(c[2] == paddle.float32 for c in scatters), scatters  # no call mixes dtypes
    assert sorted(c[3] for c in scatters) == sorted(rs_sizes * MICRO), scatters
    assert rs.payload_bytes == MICRO * 4 * sum(rs_sizes), rs  # float32-sized
    assert rs.payload_bytes == snap32[("inner", "reduce_scatter")].payload_bytes
# Block.extra had no grad anywhere in micro-step 0 and one in micro-step 1: the engine
# reduced zeros for it in micro 0, in the same float32 call as its buffer's other grads.
extra = [sp for b in trainable for sp in b.params if sp.fqn.endswith("extra")]
assert len(extra) == 3, [sp.fqn for sp in extra]
mp_worst["fp32_run"] = max(fp32_worst.values())
report("mixed_precision", mp_worst,
       note=f"; bf16 vs fp32 reference losses differ by {BF16_EFFECT:.1e}")

# ---- 1d. the same policy with fsdp_outer_sharding="optim" (HFSDP): the optimizer sees
# 1/O of each float32 master shard; the outer reduce-scatter travels in reduce_dtype
# (float32) and the post-step all-gather in the masters' float32, so the masters of every
# replica stay exact and the run matches the same bf16-rounding reference.
hf_model = shard(mp_policy=mp, fsdp_outer_sharding="optim")
assert all(b.parts == 2 for b in trainable_buffers(hf_model))
hf_run = train_hsdp(hf_model)
hf_worst = compare(hf_run, ref16)
compare_params(hf_model, ref16[1], hf_worst)
for snap, step_calls in hf_run[2]:
    scatters = [c for c in step_calls if c[:2] == ("outer", "reduce_scatter")]
    gathers = [c for c in step_calls if c[:2] == ("outer", "all_gather")]
    assert len(scatters) == len(gathers) == len(trainable_buffers(hf_model)), step_calls
    assert all(c[2] == paddle.float32 for c in scatters + gathers), step_calls
    assert ("outer", "all_reduce") not in snap, snap
report("mixed_precision_hfsdp", hf_worst,
       note=f"; bf16 vs fp32 reference losses differ by {BF16_EFFECT:.1e}")

# ---- 1b. bf16 reduce: the reduce-scatter *and* the outer all-reduce (the bytes that
# cross machines) travel in bfloat16, half an fp32 run's; the grads are then bf16-rounded
# sums, so against the reference (exact float32 grads of the bf16-rounded params) the
# tolerance is bf16's, on losses and global grad norms over the 3 steps and on each
# parameter's synced first-step grad in norm (||g - g_ref|| / ||g_ref||) against the
# fp32-reduce run checked above. bf16's unit roundoff is u = 2^-8 (3.9e-3) and each
# synced grad element is rounded up to 3 times (the cast, the inner reduce-scatter, the
# outer all-reduce); measured 7.3e-3 (1.9 u) on 2026-12-01, x86-64 2-core CPU. The bound
# 12 u (4.7e-2) keeps a 6x margin; a real error (a rank's grads lost, a wrong scale) is
# 0.25 or more. Parameters after Adam steps are not compared: Adam turns the rounding of
# a near-zero grad into a full-size step of either sign (15-30% of a bias that started
# at zero).
BF16_REDUCE_RTOL = 12 * 2.0 ** -8


def first_step_grads(policy):
    model = shard(mp_policy=policy)
    opt = make_optimizer(model, model.parameters(), CLIP)
    for m, micro in enumerate(data[0]):
        ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
        (lm_loss(model, ids, use_extra(m)) / MICRO).backward()
    paddle_hsdp.finish_grad_sync(opt)
    grads = {k: v.numpy() for k, v in paddle_hsdp.full_grads(model).items() if v is not None}
    opt.clear_grad()
    return grads


bf = paddle_hsdp.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="bfloat16")
bf_model = shard(mp_policy=bf)
bf_run = train_hsdp(bf_model)
bf_worst = compare(bf_run, ref16)
fp32_reduce_grads = first_step_grads(mp)
bf_grads = first_step_grads(bf)
assert sorted(bf_grads) == sorted(fp32_reduce_grads) and len(bf_grads) > 10, sorted(bf_grads)
for name, g in bf_grads.items():
    ref = fp32_reduce_grads[name]
    bf_worst["grad " + name] = float(np.linalg.norm(g - ref) / np.linalg.norm(ref))
for (snap32, _), (snap_bf, calls_bf) in zip(fp32_run[2], bf_run[2]):
    ar32, ar_bf = snap32[("outer", "all_reduce")], snap_bf[("outer", "all_reduce")]
    assert ar32.calls == ar_bf.calls > 0 and 2 * ar_bf.payload_bytes == ar32.payload_bytes, \
        (ar32, ar_bf)
    assert all(c[2] == paddle.bfloat16 for c in calls_bf
               if c[1] in ("reduce_scatter", "all_reduce") and c[0] in ("inner", "outer"))
report("bf16_reduce", bf_worst, rtol=BF16_REDUCE_RTOL,
       note=" (outer all-reduce bytes half the fp32 run's)")

# ---- 1c. CPU offload, its path forced on CPU (host and "device" both the CPU, every
# upload and download a real copy): shards, grads and optimizer state in host storage,
# the outer all-reduce on an uploaded copy. Same kernels in the same order as the fp32
# run above, so equal to it bit for bit.
offload.EXERCISE_ON_CPU = True
offload.reset_counters()
off_model = shard(offload_policy=paddle_hsdp.CPUOffloadPolicy(pin_memory=True))
off_buffers = trainable_buffers(off_model)
assert all(b.host is not None for b in all_buffers(off_model))
off_run = train_hsdp(off_model)
moved = copy.copy(offload.counters())  # before the full_state_dict gathers below
gathers = sum(snap[("inner", "all_gather")].calls for snap, _ in off_run[2])
# one upload per all-gather and per outer all-reduce; one download per reduce-scatter
# and per outer all-reduce; the optimizer stepped on the host once per step
assert moved.uploads == gathers + STEPS * len(off_buffers), (moved, gathers)
assert moved.downloads == STEPS * (MICRO + 1) * len(off_buffers), moved
assert moved.host_steps == STEPS, moved
assert off_run[0] == fp32_run[0] and off_run[1] == fp32_run[1], (off_run[:2], fp32_run[:2])
fp32_full = paddle_hsdp.full_state_dict(fp32_model)
for name, value in paddle_hsdp.full_state_dict(off_model).items():
    np.testing.assert_array_equal(value.numpy(), fp32_full[name].numpy(), err_msg=name)
offload.EXERCISE_ON_CPU = False
print(f"KNOBS offload_forced equal to the fp32 run bit for bit ({moved})", flush=True)

# ---- 1e. HFSDP with the offload path forced on CPU: pieces reduce-scattered from an
# uploaded copy and downloaded into host storage, the rebuild all-gathered from an
# uploaded piece into the host shard; the same kernels as 1d, so equal to it bit for bit.
offload.EXERCISE_ON_CPU = True
hoff_model = shard(mp_policy=mp, fsdp_outer_sharding="optim",
                   offload_policy=paddle_hsdp.CPUOffloadPolicy(pin_memory=True))
assert all(b.host is not None and b.parts == 2 for b in trainable_buffers(hoff_model))
hoff_run = train_hsdp(hoff_model)
assert hoff_run[0] == hf_run[0] and hoff_run[1] == hf_run[1], (hoff_run[:2], hf_run[:2])
hf_full = paddle_hsdp.full_state_dict(hf_model)
for name, value in paddle_hsdp.full_state_dict(hoff_model).items():
    np.testing.assert_array_equal(value.numpy(), hf_full[name].numpy(), err_msg=name)
offload.EXERCISE_ON_CPU = False
print("KNOBS offload_forced_hfsdp equal to the HFSDP run bit for bit", flush=True)

# ---- 1f. the outer all-reduce issued during the step's last backward
# (engine/outer_sync.py), on the outer group's own thread. The fp32 run above already
# used it from step 2 on; the same training with it off (outer all-reduces at the
# step) must be equal bit for bit: the same sums of the same values.
outer_sync.ENABLED = False
late_model = shard()
late_run = train_hsdp(late_model)
outer_sync.ENABLED = True
assert late_run[0] == fp32_run[0] and late_run[1] == fp32_run[1], (late_run[:2], fp32_run[:2])
late_full = paddle_hsdp.full_state_dict(late_model)
for name, value in paddle_hsdp.full_state_dict(fp32_model).items():
    np.testing.assert_array_equal(value.numpy(), late_full[name].numpy(), err_msg=name)
# A root that holds two trainable buffers, one reduced early (final norm and an untied
# head) and one at the end of backward (the embedding's): the early one's outer sync is
# issued while the other still gets its reduce-scatter; each buffer keeps its own sync.
def shard_two_buffer_root():
    model = build_model()
    model.head = TiedHead(model.create_parameter([VOCAB, HIDDEN]))  # untied
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    assert len(trainable_buffers(model)) == len(model.blocks) + 2
    return model


two_buffer_runs = []
for early in (True, False):
    outer_sync.ENABLED = early
    root_model = shard_two_buffer_root()
    two_buffer_runs.append((train_hsdp(root_model)[:2], paddle_hsdp.full_state_dict(root_model)))
outer_sync.ENABLED = True
(early_run, early_full), (late_run, late_full) = two_buffer_runs
assert early_run == late_run, (early_run, late_run)
for name, value in early_full.items():
    np.testing.assert_array_equal(value.numpy(), late_full[name].numpy(), err_msg=name)

# The overlap, from the event trace's timestamps: in the last micro-step of steps 2
# and 3, the backward of the last block but one is made 0.3 s long, as a big layer's
# would be (a sleep in its fc1's grad, releasing the GIL as kernels do), and every
# all-reduce run on a thread takes 0.1 s more (a slow link). That block's pre-backward
# is the first to issue an outer all-reduce: the root's head buffer's, whose
# reduce-scatter (issued when the head's grads were complete) the last block's
# post-backward finished. That all-reduce must still run when the compute's sleep
# begins: waited for before the compute, or run on the main thread, it could not.
# Step 1 has no count of its backwards: no outer all-reduce before its step.
windows, slow = [], [False]
real_all_reduce = dist.stream.all_reduce


def slow_link_on_threads(*args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
        time.sleep(0.1)
    return real_all_reduce(*args, **kwargs)


def slow_backward(layer, inputs, output):
    def hold(grad):
        if slow[0]:
            begin = time.perf_counter()
            time.sleep(0.3)
            windows.append((begin, time.perf_counter()))
        return grad
    if not output.stop_gradient:
        output.register_hook(hold)


traced_model = shard()
traced_model.blocks[-2].fc1.register_forward_post_hook(slow_backward)
opt = make_optimizer(traced_model, traced_model.parameters(), CLIP)
dist.stream.all_reduce = slow_link_on_threads
trace.enable()
for s, step in enumerate(data):
    for m, micro in enumerate(step):
        slow[0] = s > 0 and m == MICRO - 1
        ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
        (lm_loss(traced_model, ids, use_extra(m)) / MICRO).backward()
    opt.step()
    opt.clear_grad()
trace.disable()
dist.stream.all_reduce = real_all_reduce
assert len(windows) == STEPS - 1, windows
traced_full = paddle_hsdp.full_state_dict(traced_model)
for name, value in paddle_hsdp.full_state_dict(fp32_model).items():
    np.testing.assert_array_equal(value.numpy(), traced_full[name].numpy(), err_msg=name)
events = list(trace.recorded().events)
ends = [i for i, e in enumerate(events) if e[:2] == ("backward", "end")]
steps_done = [i for i, e in enumerate(events) if e[:2] == ("step", "done")]
n_buffers = len(trainable_buffers(traced_model))
beside = []
for s in range(STEPS):
    first, last = ends[2 * s], ends[2 * s + 1]  # the step's two backwards' ends
    since = steps_done[s - 1] if s else -1
    issues = [i for i in range(since + 1, steps_done[s])
              if events[i][:2] == ("issue", "all_reduce")]
    assert len(issues) == n_buffers, (s, issues)
    if s == 0:
        assert min(issues) > last, "step 1 has no prediction: outer all-reduces at the step"
        continue
    assert first < min(issues) and max(issues) < last, (s, issues, first, last)
    begin, end = windows[s - 1]
    during = [min(sp[3], end) - max(sp[2], begin) for sp in trace.recorded().spans
              if sp[2] < end and sp[3] > begin]
    assert during, (s, windows, trace.recorded().spans)
    beside.append(sum(during))
print(f"KNOBS early_outer_sync equal to the step-time sync bit for bit; outer all-reduces "
      f"ran on their thread during a 0.3 s backward compute in steps 2-3 "
      f"({', '.join(f'{t * 1e3:.0f} ms' for t in beside)} of it)", flush=True)

# ---- 2. ignored_params
model = build_model()
ignored = dict(model.named_parameters())[IGNORED]
ignored_shape = list(ignored.shape)
# Passed to every call, as the module tree of each call contains or skips it.
model = shard(model, ignored_params=[ignored])
named = dict(model.named_parameters())
assert named[IGNORED] is ignored and list(ignored.shape) == ignored_shape, IGNORED
assert not hasattr(ignored, "_hsdp_sharded_param"), "ignored param became a shard"
assert ignored._is_initialized()
assert all(sp.full is not ignored and sp.shard is not ignored
           for b in all_buffers(model) for sp in b.params), "ignored param is in a buffer"
assert id(ignored) not in hsdp_registry.owner_of
assert sum(1 for p in model.parameters() if p is ignored) == 1
run = train_hsdp(model, ignored=ignored)
worst = compare(run, ref32)
compare_params(model, ref32[1], worst)
report("ignored_params", worst)

# ---- 3. shard_placement_fn: Replicate() for one 2-D weight
model = build_model()
target = dict(model.named_parameters())[REPLICATED]
full_shape = list(target.shape)
assert len(full_shape) == 2


def placement(p):
    return dist.Replicate() if p is target else None


model = shard(model, shard_placement_fn=placement)
shard_param = dict(model.named_parameters())[REPLICATED]
assert hasattr(shard_param, "_hsdp_sharded_param") and shard_param is not target
assert list(shard_param.shape) == full_shape, (shard_param.shape, full_shape)  # whole
others = [p for n, p in model.named_parameters() if n != REPLICATED and len(p.shape) == 2
          and hasattr(p, "_hsdp_sharded_param")]
# the rest stays sharded: in buffers cut over the inner group, this rank's rows only
assert others and all(p._hsdp_sharded_param.buffer.inner.nranks > 1
                      and p.shape[0] == p._hsdp_sharded_param.row_range(sub=True)[1]
                      for p in others)
run = train_hsdp(model)
worst = compare(run, ref32)
compare_params(model, ref32[1], worst)
# Every rank holds the same whole weight after training.
whole = shard_param.detach().clone()
dist.all_reduce(whole)
worst["replicas_agree"] = max_rel(whole.numpy() / world, shard_param.numpy())
report("replicate_placement", worst)

comm.all_gather_into, comm.reduce_scatter = _unlogged
assert not failures, "\n".join(failures)
finish()
