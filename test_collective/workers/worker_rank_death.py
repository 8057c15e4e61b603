"""A rank dies (SIGKILL) or hangs (sleeps) mid-step, after its forward of step 2: the
others must stop within a bound with a message naming the operation and the group,
not wait forever. A dead peer: gloo fails the next collective at once and
paddle_hsdp raises CollectiveError. A hung peer: the watchdog
(PADDLE_HSDP_COLLECTIVE_TIMEOUT, set short by the test) ends the waiting ranks.

argv: the rank that fails, "kill" or "hang", and optionally the fsdp_outer_degree over
sharding 4 (default 2; test_faults runs 1 and 4, so fleet's 1 x 4 and 4 x 1 groups are
built and checked by init_fleet in a real launch). The test checks that the launch ends
non-zero within its bound and that the survivors named the failure.
"""

import os
import signal
import sys
import time

from common import init_fleet

import paddle
import paddle.distributed as dist

import paddle_hsdp
from models import batches, build_model, lm_loss, make_optimizer, shard_tinylm, uses_extra

victim, mode = int(sys.argv[1]), sys.argv[2]
init_fleet({"sharding_degree": 4, "outer": int(sys.argv[3]) if len(sys.argv) > 3 else 2})
rank, world = dist.get_rank(), dist.get_world_size()
model = shard_tinylm(build_model())
opt = make_optimizer(model, model.parameters(), 0.2)
data = batches(4, 1, world, 2)
start = time.time()
try:
    for step, micro_batches in enumerate(data):
        ids = paddle.to_tensor(micro_batches[0][rank * 2:(rank + 1) * 2])
        loss = lm_loss(model, ids, uses_extra(rank))
        if step == 2 and rank == victim:
            print(f"FAULT {mode} at step {step} on rank {rank}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # hang: the others' watchdog must end the job
        loss.backward()
        opt.step()
        opt.clear_grad()
except paddle_hsdp.CollectiveError as e:
    print(f"FAILED after {time.time() - start:.1f} s: {e}", flush=True)
    sys.exit(3)
print("UNEXPECTED: training finished although a rank died", flush=True)
sys.exit(4)
