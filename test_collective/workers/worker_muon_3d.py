"""Muon over HSDP next to tensor and expert parallelism (issue 53), float64, against
one process running the same Muon on the whole batch with the whole model (global-norm
clip active at every step, decoupled weight decay): losses and every parameter within
workers/parity.py's bound, on every rank (rank 0 reports the worst of them all).

* ``part: "tp"`` (mp2 x sharding4, outer 2: TP 2 x HSDP 2 x 2): tp_model.py's
  column- and row-parallel matrices, each mp slice owned whole by one rank of its inner
  group (``owned_matrices``), Muon's ``tp_mode="duplicated"`` joining the slices over
  the mp group for Newton-Schulz; the replicated head is owned too.
* ``part: "ep"`` (sharding8 x EP 2, moe_sharding 4, outer 2): the experts as 3-D
  stacks ``[local experts, in, out]`` per EP rank (a batch of matrices: the row layout
  keeps each whole), in the expert inner group; the dense matrices owned. Each EP rank
  routes its own tokens to its local experts; on ranks with ``rank % 4 == 1`` local
  expert 1 never gets a token (its grad is zero, its matrix still takes the decay).

argv: JSON with the hybrid degrees, ``outer`` and ``part``.
"""

import time

import numpy as np
from common import config_from_argv, finish, init_fleet, max_rel, report_over, train_loop
from parity import set_dtype

import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F

import paddle_hsdp
from paddle_hsdp.optim import muon_param_info
from paddle_hsdp.optim.muon import newton_schulz_flops
from models import global_norm, shard_tinylm
from moe_model import CLIP as MOE_CLIP
from moe_model import LOCAL_EXPERTS, PER_RANK as MOE_PER_RANK, H, Net, loss_of, make_data
from tp_model import PER_RANK, batches, build, full_weights, lm_loss, mp_slice

CLIP = 0.2
started = time.time()
config = config_from_argv()
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
world_group = dist.collective._get_global_group()
set_dtype("float64")


def muon(model, info, clip=CLIP):
    return paddle_hsdp.Muon(learning_rate=0.05, parameters=model.parameters(), momentum=0.9,
                            weight_decay=0.1, muon_param_info_map=info,
                            grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))



# ------------------------------------------------------------------ TP 2 x HSDP 2 x 2
def tensor_parallel():
    mp_rank, mp_n = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
    n, chunk = hcg.get_sharding_parallel_world_size(), hcg.get_sharding_parallel_rank()
    weights, data = full_weights(100), batches(7, n)
    norms = []
    ref = build(False, weights)
    ref_opt = muon(ref, muon_param_info(ref))
    ref_losses = train_loop(ref_opt, data, lambda micro, _: sum(
        lm_loss(ref, c) for c in np.split(micro, n)) / n,
        before_step=lambda _: norms.append(global_norm(ref)))
    assert min(norms) > CLIP, norms  # the clip is active at every step
    model = build(True, weights, mp_rank, mp_n)
    info = muon_param_info(model)
    shard_tinylm(model, shard_placement_fn=paddle_hsdp.owned_matrices(info=info))
    opt = muon(model, info)
    assert opt._tp_mode == "duplicated"
    losses = train_loop(opt, data, lambda micro, _: lm_loss(
        model, micro[chunk * PER_RANK:][:PER_RANK]), processes=world)
    worst = {"loss": max_rel(np.array(losses), np.array(ref_losses))}
    for name, value in paddle_hsdp.full_state_dict(model).items():
        worst[name] = max_rel(value.numpy(), mp_slice(name, ref.state_dict()[name].numpy(),
                                                      mp_rank, mp_n))
    split = [p.name for p in model.parameters() if getattr(p, "is_distributed", False)
             and opt.updates_as_matrix(p)]
    assert len(split) == 4, split  # every block's up and down: joined over mp
    measured = report_over(world_group, "muon tp2 x hsdp 2x2", worst)
    # issue 65, item 2: each mp-split matrix orthogonalised once per mp group (spread
    # over its mp ranks), the others once per mp rank (their copies); the replicas of a
    # buffer whose owners stay in the inner group each repeat its mp-split matrices
    # and share the others (item 1: each replica does its share, results all-gathered)
    expected = 0
    for p in model.parameters():
        if p.stop_gradient or not opt.updates_as_matrix(p):
            continue
        sp = p._hsdp_sharded_param
        joined = p.name in split
        shape = [int(d) * (mp_n if joined and k == p.split_axis else 1)
                 for k, d in enumerate(sp.shape)]
        replicas = world // (mp_n * sp.buffer.inner.nranks * sp.buffer.parts) if joined else 1
        expected += len(data) * newton_schulz_flops(sorted(shape), opt._ns_steps) * \
            replicas * (1 if joined else mp_n)
    flops = paddle.to_tensor([opt.ns_flops], dtype="int64")
    dist.all_reduce(flops)
    assert int(flops.item()) == expected, (int(flops.item()), expected)
    print(f"MUON_3D tp2 x hsdp 2x2: max rel diff {measured:.2e} over {world} ranks "
          f"({len(split)} mp-split matrices joined for Newton-Schulz, each "
          f"orthogonalised once per mp group)", flush=True)


# ------------------------------------------------------------------ EP 2, 3-D stacks
class StackedExperts(nn.Layer):
    """``count`` experts as two 3-D stacks; routes each token to local expert
    ``token id % 3 == 0`` (1) or not (0)."""

    def __init__(self, count, keep):
        super().__init__()
        # every expert drawn, then this rank's kept: the reference's initial values
        full = [paddle.randn([count, H, 2 * H + 1]) * 0.3, paddle.randn([count, 2 * H + 1, H]) * 0.3]
        self.w1, self.w2 = (self.create_parameter(
            [len(keep)] + w.shape[1:], default_initializer=nn.initializer.Assign(w.numpy()[keep]))
            for w in full)

    def forward(self, x, ids, ep_index):
        flat, out = x.reshape([-1, H]), paddle.zeros([int(np.prod(x.shape[:-1])), H])
        choice = (ids.reshape([-1]) % 3 == 0).astype("int64")
        first = 0 if ep_index is None else ep_index * LOCAL_EXPERTS
        for j in range(LOCAL_EXPERTS):
            rows = paddle.nonzero(choice == j).reshape([-1])
            if rows.shape[0] > 0:  # an expert with no tokens does not run
                y = F.gelu(paddle.gather(flat, rows) @ self.w1[first + j]) @ self.w2[first + j]
                out = paddle.scatter(out, rows, y)
        return x + out.reshape(x.shape)


def expert_parallel():
    ep, ep_rank = config["ep_degree"], hcg.get_expert_parallel_rank()
    assert ep_rank == rank % ep  # the order puts ep innermost: the reference relies on it
    count, data = ep * LOCAL_EXPERTS, make_data(world)
    paddle.seed(5)
    ref = Net(count, list(range(count)), StackedExperts)
    norms = []
    ref_losses = train_loop(muon(ref, muon_param_info(ref), MOE_CLIP), data, lambda micro, _: sum(
        loss_of(ref, paddle.to_tensor(micro[r * MOE_PER_RANK:][:MOE_PER_RANK]), r % ep)
        for r in range(world)) / world, before_step=lambda _: norms.append(global_norm(ref)))
    assert min(norms) > MOE_CLIP, norms
    paddle.seed(5)
    local = list(range(ep_rank * LOCAL_EXPERTS, (ep_rank + 1) * LOCAL_EXPERTS))
    model = Net(count, local, StackedExperts)
    paddle_hsdp.mark_expert_params(model.moe)
    info = muon_param_info(model)
    owned = paddle_hsdp.owned_matrices(info=info)
    for layer in (model.embed, model.block, model.moe, model):
        paddle_hsdp.fully_shard(layer, shard_placement_fn=owned)
    experts = [b for b in model.moe._hsdp_unit.buffers if b.is_expert]
    assert len(experts) == 1 and experts[0].inner.nranks == \
        config["moe_sharding_degree"] // config["outer"], experts
    opt = muon(model, info, MOE_CLIP)
    assert all(opt.updates_as_matrix(p) for p in (model.moe.w1, model.moe.w2))
    losses = train_loop(opt, data, lambda micro, _: loss_of(
        model, paddle.to_tensor(micro[rank * MOE_PER_RANK:][:MOE_PER_RANK])), processes=world)
    worst = {"loss": max_rel(np.array(losses), np.array(ref_losses))}
    expected = {n: p.numpy() for n, p in ref.state_dict().items()}
    for name in ("moe.w1", "moe.w2"):
        expected[name] = expected[name][local]
    for name, value in paddle_hsdp.full_state_dict(model).items():
        worst[name] = max_rel(value.numpy(), expected[name])
    measured = report_over(world_group, "muon ep2 stacks", worst)
    print(f"MUON_3D ep2 3-D stacks: max rel diff {measured:.2e} over {world} ranks "
          f"(expert inner {experts[0].inner.nranks}, outer {experts[0].outer.nranks})",
          flush=True)


{"tp": tensor_parallel, "ep": expert_parallel}[config["part"]]()
print(f"MUON_3D {config['part']} done in {time.time() - started:.1f} s", flush=True)
finish()
