"""Paddle's master-grad mixed precision over HSDP, on 4 CPU ranks (the shared 2 x 2
launch): ``MixPrecisionLayer`` / ``MixPrecisionOptimizer``
(``paddle.distributed.fleet.utils.mix_precision_utils``) and ``paddle.amp.decorate``.

Each run trains TinyLM 3 steps of 2 micro-steps with clipping active (every step's norm
is over the bound) and matches the unsharded model under the same wrappers, trained in
one process on the whole batch (each micro-step's loss the mean of every rank's chunk,
so its main_grad is the synced one): losses, every parameter, every step's synced main
grads and clip norm, within workers/parity.py's float32 bound (main_grad is float32
whatever the parameters are, so these runs are float32).

* wrappers after fully_shard, HSDP 2 x 2; then a checkpoint round trip through the
  wrappers (model and optimizer state back bit for bit);
* wrappers before fully_shard, ZeRO-1 (the hook's full-size float32 main_grad
  accumulates over the micro-steps, reduced at the step), torch's
  set_requires_all_reduce toggle, clear_grad(set_to_zero=False);
* wrappers after fully_shard on the explicit 1 x 4 mesh (mesh=[0, 1, 2, 3]);
* PaddleFormers' order: amp.decorate(level="O2") before fully_shard, the wrappers after,
  decorate again with the optimizer;
* refused on every rank before any collective, naming MixedPrecisionPolicy: a
  MixPrecisionLayer over part of a unit's buffer, and amp.decorate's bf16 cast of the
  shards after fully_shard.

On CPU, Paddle's bf16 autocast and amp.decorate change nothing (both act on GPU, XPU
and custom devices only: decorate returns the model as it is, compute stays float32),
and CPU has no bf16 kernels to train a cast model with. So these runs check the
wrapper logic, which does not depend on the device: the grad hooks, main_grad in
float32 filled by the engine and accumulated over micro-steps, ``.grad`` left None, the
clip reading main_grad. The cast that decorate makes on a GPU is called directly
(``amp_initialize``) for the refusal; its effect on shards when made before fully_shard
is checked in one process (test/test_master_grad.py).
"""

import os
import shutil
import tempfile
import time

import numpy as np
from common import compare_with_reference, finish, init_fleet, max_rel, train_loop
from parity import set_dtype

import paddle
import paddle.distributed as dist
from paddle.amp.auto_cast import amp_initialize
from paddle.distributed import ProcessMesh
from paddle.distributed.fleet.utils.mix_precision_utils import (MixPrecisionLayer,
                                                                 MixPrecisionOptimizer)

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.optimizers import states_of, unwrap_optimizer
from models import batches, build_model, lm_loss, make_optimizer, shard_tinylm, uses_extra

STEPS, MICRO, PER_RANK, CLIP = 3, 2, 2, 0.2
started = time.time()
set_dtype("float32")  # main_grad is float32: parity.py's float32 bound
hcg = init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, MICRO, world, PER_RANK)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]


def reference():
    """Unsharded TinyLM under the same wrappers, one process, the whole batch."""
    model = build_model()
    wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    opt = MixPrecisionOptimizer(make_optimizer(model, model.parameters(), CLIP))
    norms, main_grads = [], []

    def record(_):
        grads = {n: p.main_grad for n, p in trainable(model)}
        assert all(g.dtype == paddle.float32 for g in grads.values())
        main_grads.append({n: g.numpy() for n, g in grads.items()})
        norms.append(sum(float((g.astype("float64") ** 2).sum()) for g in grads.values()) ** 0.5)

    def micro_loss(micro, _):
        return sum(lm_loss(wrapper, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                           uses_extra(r)) for r in range(world)) / world

    losses = train_loop(opt, data, micro_loss, before_step=record)
    assert min(norms) > CLIP, norms  # clipping every step
    return losses, {n: p.numpy() for n, p in model.state_dict().items()}, norms, main_grads


ref_losses, ref_params, ref_norms, ref_main_grads = reference()


def run(name, order, mesh=None, zero1=False, decorate=False):
    """``order``: the wrappers "before" or "after" fully_shard. ``zero1``: ZeRO-1 with
    the torch toggle and clear_grad(set_to_zero=False). ``decorate``: amp.decorate(O2)
    before fully_shard and again with the optimizer (PaddleFormers' order)."""
    model = build_model()
    if decorate:
        model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
        assert all(p.dtype == paddle.float32 for p in model.parameters())  # CPU: no cast
    if order == "before":
        wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    shard_tinylm(model, mesh=mesh)
    if order == "after":
        wrapper = MixPrecisionLayer(model, dtype="bfloat16")
    if zero1:
        paddle_hsdp.set_zero_stage(model, 1)
    opt = make_optimizer(model, model.parameters(), CLIP)
    if decorate:
        model, opt = paddle.amp.decorate(models=model, optimizers=opt, level="O2",
                                         dtype="bfloat16", master_weight=True)
    opt = MixPrecisionOptimizer(opt)
    worst = {"norm": 0.0}

    def micro_loss(micro, m):
        if zero1:
            model.set_requires_all_reduce(m == MICRO - 1)  # torch's accumulation pattern
        ids = paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])
        return lm_loss(wrapper, ids, uses_extra(rank))

    # the optimizer's shards (ZeRO-1 keeps the model's slots on the full params until
    # the step, whose main_grad is the hook's, unreduced)
    shards = [p for p in opt._parameter_list if not p.stop_gradient]

    def before_step(step):
        for p in shards:  # .grad as Paddle's hook leaves it; main_grad float32
            assert p.grad is None and p.main_grad.dtype == paddle.float32, p.name
            assert list(p.main_grad.shape) == list(p.shape), p.name
        paddle_hsdp.finish_grad_sync(opt)  # the step would; the synced main grads, now
        for n, g in paddle_hsdp.full_grads(model).items():
            if g is not None:
                diff = max_rel(g.numpy(), ref_main_grads[step][n])
                worst["main_grad " + n] = max(worst.get("main_grad " + n, 0.0), diff)

    def after_step(step):
        norm = paddle_hsdp.last_global_norm(opt)  # the HSDP clip read the main grads
        worst["norm"] = max(worst["norm"], abs(norm - ref_norms[step]) / ref_norms[step])
        if zero1:
            opt.clear_grad(set_to_zero=False)  # releases main_grad; the engine remakes it
            assert all(p.main_grad is None for p in shards)

    losses = train_loop(opt, data, micro_loss, processes=world, before_step=before_step,
                        after_step=after_step)
    measured = compare_with_reference(f"master_grad {name}", paddle_hsdp.full_state_dict(model),
                                      ref_params, losses, ref_losses, worst)
    print(f"MASTER_GRAD {name}: max rel diff {measured:.2e} (norm {worst['norm']:.2e})",
          flush=True)
    return wrapper, opt


def checkpoint_round_trip(wrapper, opt):
    """Save through the wrappers; a fresh wrapped model and optimizer load it back bit
    for bit (the optimizer's moments under the shards' names)."""
    path = os.path.join(tempfile.gettempdir(), f"hsdp_master_grad_{os.getppid()}")
    paddle_hsdp.save_checkpoint(path, wrapper, opt, extra={"step": STEPS})
    model = shard_tinylm(build_model(seed=3))
    fresh = MixPrecisionLayer(model, dtype="bfloat16")
    fresh_opt = MixPrecisionOptimizer(make_optimizer(model, model.parameters(), CLIP))
    assert paddle_hsdp.load_checkpoint(path, fresh, fresh_opt) == {"step": STEPS}
    saved, loaded = (paddle_hsdp.full_state_dict(w) for w in (wrapper, fresh))
    assert all(np.array_equal(saved[k].numpy(), loaded[k].numpy()) for k in saved)
    a, b = unwrap_optimizer(opt), unwrap_optimizer(fresh_opt)
    for p, q in zip(a._parameter_list, b._parameter_list):
        if p.stop_gradient:
            continue  # no optimizer state
        sa, sb = states_of(a, p), states_of(b, q)
        assert sorted(sa) == sorted(sb) and sa, (p.name, sorted(sa), sorted(sb))
        differ = [k for k in sa if not np.array_equal(sa[k].numpy(), sb[k].numpy())]
        assert not differ, (p.name, list(p.shape), {k: (sa[k].numpy().ravel()[:3],
                                                        sb[k].numpy().ravel()[:3]) for k in differ})
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    print("MASTER_GRAD checkpoint: model and optimizer state back bit for bit", flush=True)


def refused(name, fragment, model):
    """The next forward raises NotImplementedError on every rank, before any
    collective, naming ``fragment`` and MixedPrecisionPolicy."""
    before = comm.counter.snapshot()
    ids = paddle.to_tensor(data[0][0][rank * PER_RANK:(rank + 1) * PER_RANK])
    try:
        lm_loss(model, ids, uses_extra(rank))
    except NotImplementedError as e:
        assert fragment in str(e) and "MixedPrecisionPolicy" in str(e), str(e)
        assert comm.counter.snapshot() == before, "a collective ran before the refusal"
        print(f"MASTER_GRAD refused {name}", flush=True)
        return
    raise AssertionError(f"{name} was not refused")


wrapper, opt = run("after 2x2", "after")
checkpoint_round_trip(wrapper, opt)
run("before 2x2 zero1", "before", zero1=True)
run("after 1x4", "after", mesh=ProcessMesh([0, 1, 2, 3]))
run("decorate_o2 2x2", "after", decorate=True)

model = shard_tinylm(build_model())
MixPrecisionLayer(model.blocks[0].fc1, dtype="bfloat16")  # not fc2, norm, extra: one buffer
refused("part_of_a_buffer", "MixPrecisionLayer covers", model)
model = shard_tinylm(build_model())
amp_initialize(models=[model], dtype="bfloat16", excluded_layers=None)  # decorate's GPU cast
refused("decorate_after_fully_shard", "after fully_shard", model)
print(f"MASTER_GRAD took {time.time() - started:.1f} s", flush=True)
finish()
