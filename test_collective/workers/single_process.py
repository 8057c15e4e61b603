"""One process, no launcher: the same script a user debugs on one GPU. fleet.init with
sharding_degree=1 and fully_shard on every block and the root: nothing to shard, no
collective, and training equals the unsharded model's (float64, parity.py's bound: the
sharded params are views of a flat buffer, which may change float32 matmul rounding,
so bit-equality is not guaranteed); state_dict() and set_state_dict() round-trip."""

import numpy as np

import paddle_hsdp
import paddle
from paddle.distributed import fleet

from common import max_rel
from parity import report, set_dtype
from models import batches, build_model, lm_loss, make_optimizer

strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1,
                           "sharding_configs": {"fsdp_outer_degree": 1}}
fleet.init(is_collective=True, strategy=strategy)
set_dtype("float64")
plain, sharded = build_model(), build_model()
for block in sharded.blocks:
    paddle_hsdp.fully_shard(block)
paddle_hsdp.fully_shard(sharded)
opts = [make_optimizer(m, m.parameters(), 0.2) for m in (plain, sharded)]
worst = {"loss": 0.0}
for step in batches(3, 2, 1, 2):
    losses = []
    for model, opt in zip((plain, sharded), opts):
        for micro in step:
            loss = lm_loss(model, paddle.to_tensor(micro), True)
            (loss / 2).backward()
        losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    worst["loss"] = max(worst["loss"], max_rel([losses[1]], [losses[0]]))
full, ref = sharded.state_dict(), plain.state_dict()
assert list(full) == list(ref)
for name in ref:
    worst[name] = max_rel(full[name].numpy(), ref[name].numpy())
worst = report("one process, sharding_degree 1", worst)
fresh = build_model(seed=3)
paddle_hsdp.fully_shard(fresh)
fresh.set_state_dict(ref)
assert all(np.array_equal(v.numpy(), ref[k].numpy()) for k, v in fresh.state_dict().items())
print(f"SINGLE_PROCESS_OK max rel diff {worst:.2e}", flush=True)
