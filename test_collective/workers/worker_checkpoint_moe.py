"""Expert checkpoints across expert-parallel degrees, on 4 CPU ranks (sharding 4, EP 2,
moe_sharding 2, fsdp_outer_degree 2).

EP 2 -> EP 1: the sharded EP-2 model (local experts marked with their global indices)
trains 2 steps and saves; a plain model holding all 4 experts (EP 1) loads it and
trains the last 2 steps. EP 1 -> EP 2: the plain model trains 2 steps and saves; the
sharded EP-2 model loads it and trains the last 2 steps. Both match the uninterrupted
4-step single-process run on losses and every parameter (float64, parity.py's bound), AdamW state
included (the last steps would differ without it).

Then Paddle's master-grad wrappers (MixPrecisionLayer / MixPrecisionOptimizer) over the
sharded EP-2 model, after and before fully_shard, against the plain model under the same
wrappers (float32, since main_grad is float32; on CPU bf16 autocast changes nothing, so
this checks the wrapper logic: main_grad float32, filled for dense and expert buffers,
accumulated over 2 micro-steps, read by the active clip; see worker_master_grad.py).

argv: a directory shared by the ranks.
"""

import os
import sys
import time

import numpy as np
from common import finish, init_fleet, max_rel
from parity import report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils.mix_precision_utils import (MixPrecisionLayer,
                                                                 MixPrecisionOptimizer)

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.engine import experts
from moe_model import (CLIP, LOCAL_EXPERTS, STEPS, Net, make_data, make_opt,
                       train_plain, train_sharded)

SAVE_AT = 2
set_dtype("float64")  # parity.py: resumes across EP degrees are held to float64's bound
work = sys.argv[1]
hcg = init_fleet({"sharding_degree": 4, "ep_degree": 2, "moe_sharding_degree": 2, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
ep, ep_rank = 2, hcg.get_expert_parallel_rank()
n_experts = ep * LOCAL_EXPERTS
data = make_data(world)


def plain():
    paddle.seed(5)
    model = Net(n_experts, list(range(n_experts)))
    return model, make_opt(model, CLIP)


def sharded(seed=5, wrap_before=False):
    paddle.seed(seed)
    mine = list(range(ep_rank * LOCAL_EXPERTS, (ep_rank + 1) * LOCAL_EXPERTS))
    model = Net(n_experts, mine)
    paddle_hsdp.mark_expert_params(model.moe.experts, global_indices=mine)
    if wrap_before:
        MixPrecisionLayer(model, dtype="bfloat16")  # hooks on the full params
    for layer in (model.embed, model.block, model.moe):
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    return model, make_opt(model, CLIP)


def check(label, model, losses, ref_losses, ref_params, kind="resume", worst=None):
    """Losses and parameters (local experts under their global names) against the
    reference (``worst``: more entries to report)."""
    renames = experts.global_names(model)
    got = {experts.rename(k, renames): v.numpy()
           for k, v in paddle_hsdp.full_state_dict(model).items()}
    assert set(got) <= set(ref_params), sorted(set(got) - set(ref_params))
    worst = report(f"moe {kind} {label}", dict(
        {k: max_rel(got[k], ref_params[k]) for k in got},
        loss=max_rel(np.array(losses), np.array(ref_losses)), **(worst or {})))
    print(f"MOE_{kind.upper()} {label}: {len(got)} tensors, max rel diff {worst:.2e}", flush=True)


ref, ref_opt = plain()
ref_losses = train_plain(ref, ref_opt, data, world, ep)
ref_params = {k: v.numpy() for k, v in ref.state_dict().items()}

# EP 2 saves, EP 1 (all experts in one plain model) resumes
model, opt = sharded()
train_sharded(model, opt, data[:SAVE_AT], rank, world)
checkpoint.save_checkpoint(os.path.join(work, "ep2"), model, opt, extra={"step": SAVE_AT})
names = checkpoint.read_metadata(os.path.join(work, "ep2"))["tensors"]
assert all(f"moe.experts.{i}.fc1.weight" in names for i in range(n_experts)), sorted(names)
resumed, resumed_opt = plain()
paddle.seed(1)  # other weights than the saved ones: loading must matter
for p in resumed.parameters():
    p.set_value(paddle.randn(p.shape, p.dtype))
assert checkpoint.load_checkpoint(os.path.join(work, "ep2"), resumed, resumed_opt) == \
    {"step": SAVE_AT}
check("ep2->ep1", resumed, train_plain(resumed, resumed_opt, data[SAVE_AT:], world, ep),
      ref_losses[SAVE_AT:], ref_params)

# EP 1 saves (every rank holds the same plain model; rank 0 writes), EP 2 resumes
model, opt = plain()
train_plain(model, opt, data[:SAVE_AT], world, ep)
checkpoint.save_checkpoint(os.path.join(work, "ep1"), model, opt)
resumed, resumed_opt = sharded(seed=123)
checkpoint.load_checkpoint(os.path.join(work, "ep1"), resumed, resumed_opt)
losses = train_sharded(resumed, resumed_opt, data[SAVE_AT:], rank, world)
check("ep1->ep2", resumed, losses, ref_losses[SAVE_AT:], ref_params)

# without global indices, two EP ranks' experts would collide under one name: refused
clash, clash_opt = sharded()
delattr(clash.moe.experts, "_hsdp_global_expert_indices")
try:
    checkpoint.save_checkpoint(os.path.join(work, "clash"), clash, clash_opt)
    raise AssertionError("colliding expert names saved")
except checkpoint.CheckpointError as e:
    assert "global_indices" in str(e), e
assert not os.path.exists(os.path.join(work, "clash"))
print("MOE_CLASH refused", flush=True)
assert STEPS == 4

# ---- Paddle's master-grad wrappers over the sharded EP-2 model
started = time.time()
set_dtype("float32")
ref, ref_opt = plain()
ref_wrapper, ref_opt = MixPrecisionLayer(ref, dtype="bfloat16"), MixPrecisionOptimizer(ref_opt)
ref_norms = []
ref_losses = train_plain(ref_wrapper, ref_opt, data, world, ep, before_step=lambda _: ref_norms.append(
    sum(float((p.main_grad ** 2).sum()) for p in ref.parameters()) ** 0.5))
assert min(ref_norms) > CLIP, ref_norms  # clipping every step
ref_params = {k: v.numpy() for k, v in ref.state_dict().items()}
for order in ("after", "before"):
    model, opt = sharded(wrap_before=order == "before")
    # before: sharded() wrapped it (a pass-through forward: its hooks are what matters)
    wrapper = model if order == "before" else MixPrecisionLayer(model, dtype="bfloat16")
    opt = MixPrecisionOptimizer(opt)
    shards = [p for p in opt._parameter_list if not p.stop_gradient]
    norm = {"norm": 0.0}

    def check_main_grads(_):
        assert all(p.grad is None and p.main_grad.dtype == paddle.float32 for p in shards)

    def check_norm(step):
        norm["norm"] = max(norm["norm"], abs(paddle_hsdp.last_global_norm(opt) - ref_norms[step])
                           / ref_norms[step])

    losses = train_sharded(wrapper, opt, data, rank, world, before_step=check_main_grads,
                           after_step=check_norm)
    check(f"{order} ep2", model, losses, ref_losses, ref_params, kind="master_grad",
          worst=norm)
print(f"MOE_MASTER_GRAD took {time.time() - started:.1f} s", flush=True)
finish()
