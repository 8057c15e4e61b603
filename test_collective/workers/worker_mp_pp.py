"""HSDP next to tensor parallelism (mp) on CPU ranks: training matches an independent
single-process reference (global grad norm per step, every final parameter, the loss)
with clipping active, for a plain and a fleet optimizer.

The mp model's local weights are the mp-rank slices of the reference's full weights.
With ``pp_degree > 1`` each stage would train its own model on its own loss (no
schedule, the global norm spanning the stages); the suite runs pipelines through Paddle's
own schedule instead (worker_pipeline.py).
argv: JSON with the hybrid degrees, ``outer``, ``tag`` (the log prefix) and optionally
``fleet_opt`` (which optimizer set-ups to run: [false, true] by default) and
``dtype`` (default float32), ``seeded_apart`` (every rank but the first of each FSDP group builds other weights:
fully_shard makes them agree, issue 61).
"""

import numpy as np
from common import config_from_argv, finish, init_fleet, max_rel
from parity import report, set_dtype

import paddle
from paddle.distributed import fleet

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from models import shard_tinylm
from tp_model import MICRO, PER_RANK, STEPS, batches, build, full_weights, lm_loss, mp_slice

CLIP = 0.2
# float32, parity.py's bound: the tensor-parallel path's check in the dtype users train in


def make_opt(params):
    return paddle.optimizer.AdamW(learning_rate=0.05, parameters=params, weight_decay=0.1,
                                  grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP))


def train_reference(weights, data, n):
    """One process, one model per stage, one clipped optimizer over all of them: the
    mean loss of the ``n`` data chunks per micro-step, averaged over micro-steps."""
    models = [build(False, w) for w in weights]
    params = [p for m in models for p in m.parameters()]
    opt = make_opt(params)
    losses, norms = np.zeros([len(models), STEPS]), []
    for step in range(STEPS):
        for k in range(MICRO):
            for s, model in enumerate(models):
                chunks = np.split(data[s][step][k], n)
                loss = sum(lm_loss(model, c) for c in chunks) / n
                (loss / MICRO).backward()
                losses[s, step] += float(loss) / MICRO
        norms.append(sum(float((p.grad.astype("float64") ** 2).sum()) for p in params) ** 0.5)
        opt.step()
        opt.clear_grad()
    return losses, norms, [{k: p.numpy() for k, p in m.state_dict().items()} for m in models]


config = config_from_argv()
if "dtype" in config:
    set_dtype(config["dtype"])
hcg = init_fleet(config)
stage, n_stages = hcg.get_stage_id(), hcg.get_pipe_parallel_world_size()
mp_rank, mp_n = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
sharding = hcg.get_sharding_parallel_group()
dp_rank, N = hcg.get_sharding_parallel_rank(), sharding.nranks  # data chunk, chunk count
inner, outer = hcg.get_fsdp_inner_group(), hcg.get_fsdp_outer_group()
for group in (inner, outer):  # HSDP stays inside this stage's (this mp rank's) sharding group
    assert set(group.ranks) <= set(sharding.ranks), (group.ranks, sharding.ranks)

weights = [full_weights(100 + s) for s in range(n_stages)]
data = [batches(7 + s, N) for s in range(n_stages)]
ref_losses, ref_norms, ref_params = train_reference(weights, data, N)
assert min(ref_norms) > CLIP, ref_norms  # clipping is active at every step


def run(via_fleet: bool):
    own = weights[stage]
    if config.get("seeded_apart") and dp_rank != 0:
        # issue 61: every rank but each FSDP group's first builds other weights;
        # fully_shard must take the first rank's (the reference's) slice
        own = full_weights(1000 + 10 * hcg.get_global_rank() + stage)
    model = shard_tinylm(build(mp_n > 1, own, mp_rank, mp_n))
    opt = make_opt(model.parameters())
    if via_fleet:
        opt = fleet.distributed_optimizer(opt)
    worst, losses = {"norm": 0.0}, np.zeros(STEPS)
    for step in range(STEPS):
        for k in range(MICRO):
            loss = lm_loss(model, data[stage][step][k][dp_rank * PER_RANK:][:PER_RANK])
            (loss / MICRO).backward()
            t = paddle.to_tensor([float(loss)])
            comm.all_reduce(t, sharding, tag="log")
            losses[step] += t.item() / N / MICRO
        opt.step()
        norm = paddle_hsdp.last_global_norm(opt)
        worst["norm"] = max(worst["norm"], abs(norm - ref_norms[step]) / ref_norms[step])
        opt.clear_grad()
    full = paddle_hsdp.full_state_dict(model)
    assert set(full) == set(ref_params[stage]), set(full) ^ set(ref_params[stage])
    for name, value in full.items():
        expected = mp_slice(name, ref_params[stage][name], mp_rank, mp_n)
        assert list(value.shape) == list(expected.shape), name
        worst[name] = max_rel(value.numpy(), expected)
    worst["loss"] = max_rel(losses, ref_losses[stage])
    report(f"{config['tag']} fleet_opt={via_fleet}", worst)
    print(f"{config['tag']}_PARITY fleet_opt={via_fleet} (inner {inner.ranks}, outer "
          f"{outer.ranks}): max rel diff {max(worst.values()):.2e} "
          f"(norm {worst['norm']:.2e}, loss {worst['loss']:.2e})", flush=True)


for via_fleet in config.get("fleet_opt", [False, True]):
    run(via_fleet)
finish()
