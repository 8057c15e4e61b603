"""Resume on another world size: 2 ranks (1x2) load the checkpoint 4 ranks saved in
2x2 (workers/worker_checkpoint.py), train the last 2 steps on the same global batch
(each rank takes the rows two of the four ranks had) and match the uninterrupted
4-rank run (float64, parity.py's bound); bfloat16 parameters saved in 1x2 load bit for bit in 2x1.
argv: the work dir."""

import os
import sys

import numpy as np
from common import finish, init_fleet, max_rel
from parity import report, set_dtype

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp import checkpoint
from models import batches, build_model, make_optimizer, shard_tinylm, train_on_chunks

STEPS, SAVE_AT, MICRO, PER_RANK, SAVED_WORLD, CLIP = 5, 3, 2, 2, 4, 0.2
work = sys.argv[1]
set_dtype("float64")  # as worker_checkpoint.py saved it
init_fleet({"sharding_degree": 2, "outer": 1})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, MICRO, SAVED_WORLD, PER_RANK)
model = shard_tinylm(build_model(seed=11))
opt = make_optimizer(model, model.parameters(), CLIP)
assert checkpoint.load_checkpoint(os.path.join(work, "ckpt"), model, opt) == {"step": SAVE_AT}
# each rank takes the rows two of the saved run's four ranks had
losses = train_on_chunks(model, opt, data[SAVE_AT:], [2 * rank, 2 * rank + 1], PER_RANK, world)
ref = np.load(os.path.join(work, "reference.npz"))
worst = {"loss": max_rel(np.array(losses), ref["losses"])}
for name, value in paddle_hsdp.full_state_dict(model).items():
    if name != "head.weight":  # the tied alias of embed.weight
        worst[name] = max_rel(value.numpy(), ref[name.replace(".", "__")])
worst = report("resume 1x2 on 2 ranks", worst)
print(f"RESUME 1x2 (2 ranks): max rel diff {worst:.2e}", flush=True)

# bfloat16 parameters (CPU Paddle cannot train them: no bf16 matmul here) survive a
# save in 1x2 and a load in 2x1 bit for bit, odd row counts and padding included
bits = {}
for label, mesh in (("1x2", None), ("2x1", ProcessMesh([[0], [1]], dim_names=["outer", "inner"]))):
    paddle.seed(3 if label == "1x2" else 4)
    net = paddle.nn.Sequential(paddle.nn.Linear(5, 7), paddle.nn.Linear(7, 3))
    net.to(dtype="bfloat16")
    paddle_hsdp.fully_shard(net, mesh=mesh)
    if label == "1x2":
        checkpoint.save_checkpoint(os.path.join(work, "bf16"), net)
    else:
        checkpoint.load_checkpoint(os.path.join(work, "bf16"), net)
    bits[label] = {k: v.numpy() for k, v in paddle_hsdp.full_state_dict(net).items()}
assert all(v.dtype == np.uint16 for v in bits["1x2"].values())  # bf16's raw bits
assert all(np.array_equal(bits["1x2"][k], bits["2x1"][k]) for k in bits["1x2"])
print("BF16 1x2 -> 2x1 bit-identical", flush=True)
finish()
