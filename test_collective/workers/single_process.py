"""One process, no launcher: the same script a user debugs on one GPU. fleet.init with
sharding_degree=1 and fully_shard on every block and the root: nothing to shard, no
collective, and training equals the unsharded model's exactly (float32, rtol 1e-6);
state_dict() and set_state_dict() round-trip."""

import numpy as np

import paddle_hsdp
import paddle
from paddle.distributed import fleet

from common import max_rel
from models import batches, build_model, lm_loss, make_optimizer

strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1,
                           "sharding_configs": {"fsdp_outer_degree": 1}}
fleet.init(is_collective=True, strategy=strategy)
plain, sharded = build_model(), build_model()
for block in sharded.blocks:
    paddle_hsdp.fully_shard(block)
paddle_hsdp.fully_shard(sharded)
opts = [make_optimizer(m, m.parameters(), 0.2) for m in (plain, sharded)]
worst = 0.0
for step in batches(3, 2, 1, 2):
    losses = []
    for model, opt in zip((plain, sharded), opts):
        for micro in step:
            loss = lm_loss(model, paddle.to_tensor(micro), True)
            (loss / 2).backward()
        losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    worst = max(worst, max_rel([losses[1]], [losses[0]]))
full, ref = sharded.state_dict(), plain.state_dict()
assert list(full) == list(ref)
for name in ref:
    worst = max(worst, max_rel(full[name].numpy(), ref[name].numpy()))
assert worst < 1e-6, worst
fresh = build_model(seed=3)
paddle_hsdp.fully_shard(fresh)
fresh.set_state_dict(ref)
assert all(np.array_equal(v.numpy(), ref[k].numpy()) for k, v in fresh.state_dict().items())
print(f"SINGLE_PROCESS_OK max rel diff {worst:.2e}", flush=True)
