"""The recipes Paddle users already have in their scripts, on HSDP 2 x 2 (4 CPU ranks,
sharding 4, fsdp_outer_degree 2): each one trains right (losses and every parameter
against single-process training on the whole batch, float64 and parity.py's bound; the
recipe through fleet.distributed_optimizer in float32, see parity.py) or is refused
on every rank with a clear error, leaving the model usable.

1. ``fleet.distributed_model`` after and before ``fully_shard`` (+ distributed_optimizer);
2. ``paddle.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (2-norm and inf);
3. a sub-module of a unit called on its own (``model.embed(ids)`` -> ``inputs_embeds``,
   ``model.head(h)`` under no_grad);
4. a unit that runs on some ranks only: CollectiveMismatchError everywhere, then the
   model trains on as if nothing happened;
5. an optimizer built before fully_shard (it takes the shards), one built after a
   forward that raised; Lamb and LBFGS refused;
6. ``state_dict()`` / ``paddle.save`` / a plain model's ``set_state_dict``, and
   ``set_state_dict`` of a full dict into a sharded model;
7. Paddle's fused gradient all-reduce over ``list(model.parameters())`` after backward,
   as PaddleFormers' Trainer and Paddle's DataParallel ``no_sync`` recipe call it: HSDP's
   shards are left to HSDP (summing them would add other ranks' row blocks).
"""

import os
import tempfile

import numpy as np
from common import finish, init_fleet, max_rel
from parity import FLEET_OPTIMIZER_DTYPE, report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

import paddle_hsdp
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.comm.gather_tags import CollectiveMismatchError
from models import batches, build_model, lm_loss, make_optimizer, train_reference, uses_extra

STEPS, MICRO, PER_RANK, CLIP = 3, 2, 2, 0.2

hcg = init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, MICRO, world, PER_RANK)


def my_ids(micro):
    return paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK])


def reference(clip: str):
    """Single process, whole batch; ``clip``: "opt" (ClipGradByGlobalNorm in the
    optimizer), "norm2" / "norminf" (paddle.nn.utils.clip_grad_norm_ before step)."""
    if clip == "opt":
        return train_reference(data, world, PER_RANK, CLIP)
    kind = float("inf") if clip == "norminf" else 2.0
    return train_reference(data, world, PER_RANK, 0, before_step=lambda m: float(
        paddle.nn.utils.clip_grad_norm_(m.parameters(), CLIP, kind)))


_references = {}


def ref_of(kind: str):
    """The reference for ``kind`` in the current default dtype (trained once)."""
    key = (paddle.get_default_dtype(), kind)
    if key not in _references:
        _references[key] = reference(kind)
    return _references[key]


def shard(model, blocks_only=False):
    """One unit per block (and the embedding unless ``blocks_only``), the root last."""
    for layer in (list(model.blocks) if blocks_only else [model.embed, *model.blocks]):
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    return model


def global_loss(loss) -> float:
    t = paddle.to_tensor([float(loss)])
    dist.all_reduce(t)  # for the log only
    return t.item() / world


def train(model, opt, step_fn=None, forward=None):
    """STEPS steps of MICRO micro-steps; ``step_fn(opt)`` runs before ``opt.step()``
    (a norm it returns is recorded; None records nothing);
    (returns a norm to record); ``forward(model, ids)`` replaces the plain call."""
    losses, norms = [], []
    for step in data:
        total = 0.0
        for micro in step:
            ids = my_ids(micro)
            loss = forward(model, ids) if forward else lm_loss(model, ids, uses_extra(rank))
            (loss / MICRO).backward()
            total += global_loss(loss) / MICRO
        norm = step_fn(opt) if step_fn is not None else None
        if norm is not None:
            norms.append(norm)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses, norms


def check(name, model, run, ref_kind, strip=""):
    losses, norms = run
    ref_losses, ref_params, ref_norms = ref_of(ref_kind)
    full = {k[len(strip):] if k.startswith(strip) else k: v
            for k, v in paddle_hsdp.full_state_dict(model).items()}
    assert set(full) == set(ref_params), set(full) ^ set(ref_params)
    worst = {n: max_rel(full[n].numpy(), ref_params[n]) for n in ref_params}
    worst["loss"] = max_rel(np.array(losses), np.array(ref_losses))
    if norms:
        worst["norm"] = max_rel(np.array(norms), np.array(ref_norms))
    report(f"recipe {name}", worst)
    print(f"RECIPE {name}: max rel diff {max(worst.values()):.2e}", flush=True)


def expect_error(kind, fragment, fn):
    try:
        fn()
    except kind as e:
        assert fragment in str(e), (fragment, str(e))
        return e
    raise AssertionError(f"expected {kind.__name__} ({fragment!r})")


def all_shards(model) -> bool:
    return all(hasattr(p, "_hsdp_sharded_param") for p in model.parameters())


# ---- 1. fleet.distributed_model after fully_shard, with fleet.distributed_optimizer
set_dtype(FLEET_OPTIMIZER_DTYPE)
model = fleet.distributed_model(shard(build_model()))
opt = fleet.distributed_optimizer(make_optimizer(model, model.parameters(), CLIP))
check("distributed_model_after_fully_shard", model, train(model, opt), "opt", "_layers.")
set_dtype("float64")  # every later recipe

# ... and before: Paddle's wrapper first, then fully_shard inside it and on it
wrapped = fleet.distributed_model(build_model())
for layer in [wrapped._layers.embed, *wrapped._layers.blocks]:
    paddle_hsdp.fully_shard(layer)
paddle_hsdp.fully_shard(wrapped)
opt = make_optimizer(wrapped._layers, wrapped.parameters(), CLIP)
check("distributed_model_before_fully_shard", wrapped, train(wrapped, opt), "opt", "_layers.")

# ---- 2. paddle.nn.utils.clip_grad_norm_ over model.parameters()
for kind, norm_type in (("norm2", 2.0), ("norminf", float("inf"))):
    model = shard(build_model())
    opt = make_optimizer(model, model.parameters(), 0)
    clip = lambda o, m=model, t=norm_type: float(  # noqa: E731
        paddle.nn.utils.clip_grad_norm_(m.parameters(), CLIP, t))
    check(f"clip_grad_norm_{kind}", model, train(model, opt, clip), kind)

# ---- 3. sub-modules of a unit called on their own
model = shard(build_model(), blocks_only=True)  # embed and head belong to the root unit


def embeds_first(m, ids):
    emb = m.embed(ids[:, :-1])  # computed outside the model's forward
    logits = m(ids[:, :-1], uses_extra(rank), inputs_embeds=emb)
    return paddle.nn.functional.cross_entropy(logits.reshape([-1, 37]),
                                              ids[:, 1:].reshape([-1, 1]))


opt = make_optimizer(model, model.parameters(), CLIP)
run = train(model, opt, forward=embeds_first)
with paddle.no_grad():  # the tied head alone, as a generation loop calls it
    h = paddle.ones([1, 2, 8])
    logits = model.head(h)
    assert list(logits.shape) == [1, 2, 37], logits.shape  # full vocab, not a shard's rows
    expected = paddle.matmul(h, paddle_hsdp.full_state_dict(model)["embed.weight"],
                             transpose_y=True)
    assert max_rel(logits.numpy(), expected.numpy()) < 1e-6
assert all_shards(model)  # the direct calls resharded after themselves
check("direct_submodule_calls", model, run, "opt")

# ---- 4. a unit that runs on some ranks only (equal-sized blocks: nothing else fails)
model = shard(build_model())
opt = make_optimizer(model, model.parameters(), CLIP)
original_forward = type(model).forward


def skip_block_1_on_odd_ranks(self, ids, use_extra, inputs_embeds=None):
    x = self.embed(ids) + self.pos
    for i, block in enumerate(self.blocks):
        if i != 1 or rank % 2 == 0:
            x = block(x, use_extra)
    return self.head(self.final_norm(x))


type(model).forward = skip_block_1_on_odd_ranks
err = expect_error(CollectiveMismatchError, "Ranks disagree on an all-gather",
                   lambda: lm_loss(model, my_ids(data[0][0]), uses_extra(rank)))
assert "blocks." in str(err), str(err)
if rank == 0:
    print("MISMATCH_MESSAGE " + str(err).replace("\n", "\n    "), flush=True)
type(model).forward = original_forward
assert all_shards(model) and all(u.state.value == "sharded"
                                 for u in hsdp_registry.units_under(model))
check("after_mismatch_error", model, train(model, opt), "opt")

# ---- 5. an optimizer built before fully_shard takes the shards (issue 64); optimizers
# that cannot be right are refused at the step on every rank
model = build_model()
early = make_optimizer(model, model.parameters(), CLIP)  # from the full params
shard(model)
check("optimizer_built_first", model, train(model, early), "opt")
# a forward that raised leaves the shards in place: an optimizer built now is right
expect_error(ValueError, "", lambda: model(paddle.zeros([2, 99], "int64"), True))
assert all_shards(model)
for cls, call in ((paddle.optimizer.Lamb, lambda o: o.step()),
                  (paddle.optimizer.LBFGS, lambda o: o.step(
                      lambda: lm_loss(model, my_ids(data[0][0]), uses_extra(rank))))):
    o = cls(parameters=model.parameters())
    lm_loss(model, my_ids(data[0][0]), uses_extra(rank)).backward()
    expect_error(NotImplementedError, "not element-wise", lambda: call(o))
    o.clear_grad()
print("RECIPE optimizer_checks: refused on every rank", flush=True)

# ---- 6. state_dict on every rank, saved on one; a plain model loads it
model = shard(build_model())
opt = make_optimizer(model, model.parameters(), CLIP)
train(model, opt)
sd = model.state_dict()
plain = build_model(seed=1)
assert list(sd) == list(plain.state_dict()), (list(sd), list(plain.state_dict()))
ref_params = ref_of("opt")[1]
for name, value in sd.items():
    assert list(value.shape) == list(plain.state_dict()[name].shape), name
path = os.path.join(tempfile.gettempdir(), f"hsdp_recipes_{os.getppid()}.pdparams")
if rank == 0:
    paddle.save(sd, path)
dist.barrier()
missing, unexpected = plain.set_state_dict(paddle.load(path))
assert not missing and not unexpected, (missing, unexpected)
worst = {n: max_rel(p.numpy(), ref_params[n]) for n, p in plain.named_parameters()}
report("recipe state_dict_round_trip", worst)
# a fresh sharded model takes its blocks of the full dict, bit for bit
fresh = shard(build_model(seed=5))
expect_error(ValueError, "expects the full parameter",
             lambda: fresh.set_state_dict({"embed.weight": paddle.zeros([3, 8])}))
missing, unexpected = fresh.set_state_dict(paddle.load(path))
assert not missing and not unexpected, (missing, unexpected)
loaded = paddle_hsdp.full_state_dict(fresh)
for name, value in paddle_hsdp.full_state_dict(model).items():
    assert np.array_equal(loaded[name].numpy(), value.numpy()), name
ids = my_ids(data[0][0])
assert float(lm_loss(fresh, ids, True)) == float(lm_loss(model, ids, True))
dist.barrier()
if rank == 0:
    os.remove(path)
print(f"RECIPE state_dict_round_trip: max rel diff {max(worst.values()):.2e}", flush=True)

# ---- 7. the Trainer's fused all-reduce of every parameter's grad, before each step
model = shard(build_model())
opt = make_optimizer(model, model.parameters(), CLIP)
check("fused_allreduce_gradients", model, train(
    model, opt, lambda o: fused_allreduce_gradients(list(model.parameters()), None)), "opt")
finish()
