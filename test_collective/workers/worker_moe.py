"""MoE with HSDP == single-process training on the whole batch.

Each EP rank holds its own experts and routes its own tokens locally (no all-to-all).
Expert params are sharded in the expert inner group and all-reduced over the outer
group; their gradient must be the mean over *all* data-parallel ranks. On ranks with
``rank % 4 == 1`` local expert 1 gets no tokens at all (it never runs), for every step.
Clipping is active; both clip set-ups run; the global norm and every synced gradient
are checked every step, the parameters at the end. A third run shards with
``fsdp_outer_sharding="optim"`` (HFSDP, float32): dense and expert buffers each cut
across their own outer group, every rank's optimizer state its own sub-blocks.

argv: JSON with sharding_degree, ep_degree, moe_sharding_degree, outer, dtype (float64
by default; the run through fleet's optimizer is float32, see parity.py).
"""

from common import config_from_argv, finish, init_fleet, max_rel
from parity import FLEET_OPTIMIZER_DTYPE, report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

import paddle_hsdp

from models import global_norm
from moe_model import (CLIP, LOCAL_EXPERTS, Net, make_data, make_opt, train_plain,
                       train_sharded)


def reference(data, world, ep, n_experts):
    paddle.seed(5)
    model = Net(n_experts, list(range(n_experts)))
    norms, grads = [], []

    def record(_):
        norms.append(global_norm(model))
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters()})

    losses = train_plain(model, make_opt(model, CLIP), data, world, ep, before_step=record)
    return losses, norms, grads, {n: p.numpy() for n, p in model.state_dict().items()}


def expert_name_in_reference(name, ep_rank):
    parts = name.split(".")
    if parts[:2] == ["moe", "experts"]:
        parts[2] = str(ep_rank * LOCAL_EXPERTS + int(parts[2]))
    return ".".join(parts)


config = config_from_argv()
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
ep = config["ep_degree"]
ep_rank = hcg.get_expert_parallel_rank()
assert ep_rank == rank % ep  # the order puts ep innermost: the reference relies on it
n_experts = ep * LOCAL_EXPERTS
data = make_data(world)
_references = {}


def run(via_fleet, outer_sharding="none"):
    dtype = set_dtype(FLEET_OPTIMIZER_DTYPE if via_fleet or outer_sharding == "optim"
                      else config.get("dtype", "float64"))
    if dtype not in _references:
        _references[dtype] = reference(data, world, ep, n_experts)
        assert min(_references[dtype][1]) > CLIP, _references[dtype][1]
    ref_losses, ref_norms, ref_grads, ref_params = _references[dtype]
    paddle.seed(5)
    model = Net(n_experts, list(range(ep_rank * LOCAL_EXPERTS, (ep_rank + 1) * LOCAL_EXPERTS)))
    paddle_hsdp.mark_expert_params(model.moe.experts)
    for layer in (model.embed, model.block, model.moe):
        paddle_hsdp.fully_shard(layer, fsdp_outer_sharding=outer_sharding)
    paddle_hsdp.fully_shard(model, fsdp_outer_sharding=outer_sharding)
    unit = model.moe._hsdp_unit
    kinds = sorted((b.is_expert, b.inner.nranks) for b in unit.buffers)
    assert kinds == [(False, world // config["outer"]),
                     (True, config["moe_sharding_degree"] // config["outer"])], kinds
    for buf in unit.buffers:  # HFSDP: each cut across its own outer group
        assert buf.parts == (buf.outer.nranks if outer_sharding == "optim" else 1)
        assert buf.outer is hcg.get_fsdp_outer_group(buf.is_expert)
    opt = make_opt(model, CLIP)
    if via_fleet:
        opt = fleet.distributed_optimizer(opt)
    worst = {"loss": 0.0, "norm": 0.0}

    def check_grads(step):
        paddle_hsdp.finish_grad_sync(opt)  # the step would run it; run it first to read grads
        for name, g in paddle_hsdp.full_grads(model).items():
            ref = ref_grads[step][expert_name_in_reference(name, ep_rank)]
            worst["grad " + name] = max(worst.get("grad " + name, 0.0), max_rel(g.numpy(), ref))

    def check_norm(step):
        worst["norm"] = max(worst["norm"], abs(paddle_hsdp.last_global_norm(opt)
                                               - ref_norms[step]) / ref_norms[step])

    losses = train_sharded(model, opt, data, rank, world, before_step=check_grads,
                           after_step=check_norm)
    worst["loss"] = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    for name, value in paddle_hsdp.full_state_dict(model).items():
        ref = ref_params[expert_name_in_reference(name, ep_rank)]
        worst[name] = max_rel(value.numpy(), ref)
    tag = f"fleet_opt={via_fleet}" + (" hfsdp" if outer_sharding == "optim" else "")
    report(f"moe {tag}", worst)
    print(f"MOE_PARITY {dtype} {tag}: max rel diff {max(worst.values()):.2e} "
          f"(norm {worst['norm']:.2e})", flush=True)


run(via_fleet=False)
run(via_fleet=True)
run(via_fleet=False, outer_sharding="optim")
finish()
