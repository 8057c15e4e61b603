"""Resume on another world size: 2 ranks (1x2) load the checkpoint 4 ranks saved in
2x2 (workers/worker_checkpoint.py), train the last 2 steps on the same global batch
(each rank takes the rows two of the four ranks had) and match the uninterrupted
4-rank run (rtol 1e-5). argv: the work dir."""

import os
import sys

import numpy as np
from common import finish, init_fleet, max_rel

import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp import checkpoint
from models import batches, build_model, make_optimizer, train_on_chunks

STEPS, SAVE_AT, MICRO, PER_RANK, SAVED_WORLD, CLIP = 5, 3, 2, 2, 4, 0.2
work = sys.argv[1]
init_fleet({"sharding_degree": 2, "outer": 1})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, MICRO, SAVED_WORLD, PER_RANK)
model = build_model(seed=11)
for layer in [model.embed, *model.blocks]:
    paddle_hsdp.fully_shard(layer)
paddle_hsdp.fully_shard(model)
opt = make_optimizer(model, model.parameters(), CLIP)
assert checkpoint.load_checkpoint(os.path.join(work, "ckpt"), model, opt) == {"step": SAVE_AT}
# each rank takes the rows two of the saved run's four ranks had
losses = train_on_chunks(model, opt, data[SAVE_AT:], [2 * rank, 2 * rank + 1], PER_RANK, world)
ref = np.load(os.path.join(work, "reference.npz"))
worst = max_rel(np.array(losses), ref["losses"])
for name, value in paddle_hsdp.full_state_dict(model).items():
    if name != "head.weight":  # the tied alias of embed.weight
        worst = max(worst, max_rel(value.numpy(), ref[name.replace(".", "__")]))
assert worst < 1e-5, worst
print(f"RESUME 1x2 (2 ranks): max rel diff {worst:.2e}", flush=True)
finish()
