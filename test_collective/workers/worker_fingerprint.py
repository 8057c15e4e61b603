"""The collective fingerprint debug mode on 4 CPU ranks (2 x 2), switched on here with
``check_collectives(True)`` (test_faults checks that PADDLE_HSDP_CHECK_COLLECTIVES=1 at
import switches it on too) and off before the twin trains:

* ranks of an inner group gather *different* units (sizes differ: without the check
  gloo would abort the process): every rank of that group raises
  CollectiveMismatchError naming both ranks' views and the units' parameters, before
  the real all-gather; the other inner group is unaffected;
* an all-reduce with a different element count and dtype on one rank: every rank
  raises, naming both;
* afterwards the model still trains, and its losses and parameters equal a twin's
  trained with the check off, bit for bit (the check changes nothing it checks).
"""

from common import assert_same_params, finish, init_fleet

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.comm import fingerprint
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import batches, build_model, make_optimizer, shard_tinylm, train_steps

paddle_hsdp.check_collectives(True)  # on every rank, before any of the checks below
init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
hcg = paddle.distributed.fleet.get_hybrid_communicate_group()


model = shard_tinylm(build_model())
# rank 1 gathers the embedding's unit while rank 0 gathers block 0's (inner group 0-1)
odd = rank == 1
try:
    (model.embed if odd else model.blocks[0]).unshard()
    assert rank in (2, 3), f"rank {rank}: mismatched all-gathers were not caught"
except paddle_hsdp.CollectiveMismatchError as e:
    text = str(e)
    assert rank in (0, 1) and "rank 0:" in text and "rank 1:" in text, text
    assert "embed" in text and "blocks.0" in text, text
    print(f"CAUGHT_UNITS rank {rank}: {text.splitlines()[1].strip()[:160]}", flush=True)
model.reshard()
for unit in hsdp_registry.units_under(model):
    unit.reshard(force=True)

# an all-reduce of another size and dtype on rank 2 (world group)
group = paddle.distributed.collective._get_global_group()
t = paddle.ones([5 if rank == 2 else 4], dtype="float64" if rank == 2 else "float32")
try:
    comm.all_reduce(t, group, what="a user all-reduce")
    raise AssertionError("mismatched all-reduce was not caught")
except paddle_hsdp.CollectiveMismatchError as e:
    assert "rank 2: all_reduce #0 of 5 elements, paddle.float64" in str(e), e
    assert "rank 0: all_reduce #0 of 4 elements, paddle.float32" in str(e), e
    print(f"CAUGHT_ALL_REDUCE rank {rank}", flush=True)

# still usable, and the check changes nothing
data = batches(2, 2, world, 2)
opt = make_optimizer(model, model.parameters(), 0.2)
checked = train_steps(model, opt, data, rank, world, 2)
fingerprint.check_collectives(False)
twin = shard_tinylm(build_model())
twin_opt = make_optimizer(twin, twin.parameters(), 0.2)
unchecked = train_steps(twin, twin_opt, data, rank, world, 2)
assert checked == unchecked, (checked, unchecked)
assert_same_params(model, twin)
print(f"FINGERPRINT_OK rank {rank}: training with the check == without, bit for bit",
      flush=True)
finish()
