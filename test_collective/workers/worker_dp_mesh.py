"""fleet.init with dp_degree=2 x sharding_degree=2 on 4 CPU ranks, then an explicit mesh:

* a 1-D mesh over this rank's sharding group only leaves out the other data-parallel
  copy, which would drift apart: ValueError on every rank, before any group exists;
* the 2-D mesh [[0, 1], [2, 3]] (rows = sharding groups, columns = dp groups) covers
  every data-parallel rank and matches single-process training on the whole batch
  (losses, every parameter, grad norm; float32: the dtype users train in, parity.py's
  bound).
"""

from common import compare_with_reference, finish, init_fleet

import paddle
import paddle.distributed as dist
from paddle.distributed import ProcessMesh

import paddle_hsdp
from paddle_hsdp.engine.registry import registry as hsdp_registry
from models import batches, build_model, make_optimizer, shard_tinylm, train_reference, train_steps

STEPS, MICRO, PER_RANK, CLIP = 3, 2, 2, 0.2

# outer 2 over sharding 2: init_fleet also checks the dp x sharding x outer groups
hcg = init_fleet({"dp_degree": 2, "sharding_degree": 2, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
sharding_ranks = hcg.get_sharding_parallel_group().ranks
groups_before = len(paddle.distributed.collective._group_map)
units_before = len(hsdp_registry.units)  # an earlier worker's, in a run_many.py launch
try:
    paddle_hsdp.fully_shard(build_model(), mesh=ProcessMesh(sharding_ranks))
    raise AssertionError("a mesh that leaves out the dp copy was accepted")
except ValueError as e:
    assert "drift apart" in str(e) and "dp_degree=2" in str(e), e
assert len(paddle.distributed.collective._group_map) == groups_before  # nothing created
assert len(hsdp_registry.units) == units_before  # nor any unit registered

data = batches(STEPS, MICRO, world, PER_RANK)
ref_losses, ref_params, ref_norms = train_reference(data, world, PER_RANK, CLIP)
mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["outer", "inner"])
model = shard_tinylm(build_model(), mesh=mesh)
opt = make_optimizer(model, model.parameters(), CLIP)
worst = {}


def record_norm(step):
    norm = paddle_hsdp.last_global_norm(opt)
    worst["norm"] = max(worst.get("norm", 0), abs(norm - ref_norms[step]) / ref_norms[step])


losses = train_steps(model, opt, data, rank, world, PER_RANK, record_norm)
compare_with_reference("dp2 x sharding2 mesh 2x2", paddle_hsdp.full_state_dict(model),
                       ref_params, losses, ref_losses, worst)
print(f"PARITY dp2 x sharding2 mesh 2x2: max rel diff {max(worst.values()):.2e}", flush=True)
finish()
