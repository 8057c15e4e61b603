"""Issue 63, item 3: the outer all-reduce across replica groups of different sizes
(paddle_hsdp/ft/degrees.py) on real gloo groups, 4 CPU ranks in the shared 2 x 2
launch. Ranks 0 and 1 play a group of 2 ranks, rank 2 and rank 3 groups of 1 rank
each: outer group 0 is ranks 0, 2, 3 and outer group 1 ranks 1, 2, 3, so ranks 2 and
3 are both in both and all-reduce one half of their shard in each. Each group's full
grad is float64 multiples of 1/8 (every sum exact): after the walk and the divisor
(3 groups) every rank must hold exactly the mean's rows of its shard."""

import time

import numpy as np
from common import finish, init_fleet

import paddle
import paddle.distributed as dist

from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.ft.degrees import OuterPlan, all_reduce_across_degrees

init_fleet({"sharding_degree": 4, "outer": 2})
rank, started = dist.get_rank(), time.perf_counter()  # (what it adds to the launch)
SIZES = {0: 2, 1: 1, 2: 1}  # replica -> ranks per group
PLAYS = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (2, 0)}  # global rank -> (replica, local rank)
plan = OuterPlan(SIZES)
global_rank = {where: g for g, where in PLAYS.items()}
# Paddle's new_group is called by every rank of the launch (in a job each rank creates
# only its own D / d groups on the round's stores, ft/groups.py)
outer = [dist.new_group(sorted(global_rank[m] for m in plan.members(j)))
         for j in range(plan.largest)]
replica, local = PLAYS[rank]
numel = 8 * plan.largest  # one buffer laid out over D segments in every group
grads = {r: np.random.default_rng(63 + r).integers(-64, 64, numel) / 8.0 for r in SIZES}
flat = paddle.to_tensor(grads[replica].reshape(SIZES[replica], -1)[local].copy())


def all_reduce(piece: paddle.Tensor, j: int) -> paddle.Tensor:
    comm.all_reduce(piece, outer[j], tag="outer across sizes")
    return piece


all_reduce_across_degrees(flat, plan, replica, local, all_reduce)
mean = sum(grads.values()) / plan.divisor
np.testing.assert_array_equal(flat.numpy() / plan.divisor,
                              mean.reshape(SIZES[replica], -1)[local])
assert flat.dtype == paddle.float64
print(f"OUTER_DEGREES_OK rank {rank} (replica {replica} rank {local} of "
      f"{SIZES[replica]}, outer groups {list(plan.groups_of(replica, local))}) in "
      f"{time.perf_counter() - started:.2f} s", flush=True)
finish()
