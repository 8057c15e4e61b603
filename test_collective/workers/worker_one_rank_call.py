"""Collective entry points called on some ranks only (issue 19 item 4), 4 CPU ranks
(2 x 2), in the shared launch: ``model.state_dict()`` and ``full_state_dict`` on rank 0
alone, ``save_checkpoint`` on rank 1 alone. Each caller raises
``CollectiveMismatchError`` naming the call and the ranks that did not come, within the
bound (``PADDLE_HSDP_COLLECTIVE_TIMEOUT``, 1 s here), and no rank aborts; then every
rank makes the same calls and they work: the model is unchanged and still trains.
"""

import os
import tempfile
import time

from common import finish, init_fleet

import paddle
import paddle.distributed as dist

import paddle_hsdp
from models import batches, build_model, make_optimizer, shard_tinylm, train_steps

init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
model = shard_tinylm(build_model())
before = {k: v.numpy().copy() for k, v in model.state_dict().items()}  # every rank
work = os.path.join(tempfile.gettempdir(), f"hsdp_one_rank_{os.getppid()}")

BOUND = 1
previous = os.environ.get("PADDLE_HSDP_COLLECTIVE_TIMEOUT")
os.environ["PADDLE_HSDP_COLLECTIVE_TIMEOUT"] = str(BOUND)
CALLS = [(0, "state_dict() of a sharded", lambda: model.state_dict()),
         (0, "full_state_dict(model)", lambda: paddle_hsdp.full_state_dict(model)),
         (1, "save_checkpoint(", lambda: paddle_hsdp.save_checkpoint(work, model))]
for caller, name, call in CALLS:
    if rank == caller:
        start = time.monotonic()
        try:
            call()
        except paddle_hsdp.CollectiveMismatchError as e:
            took = time.monotonic() - start
            assert name in str(e) and "only 1 of them" in str(e), str(e)
            assert f"this rank, {caller}, among them" in str(e), str(e)
            assert BOUND <= took < BOUND + 5, took
            print(f"ONE_RANK_CALL_NAMED {name.strip('(')} rank {rank} after {took:.1f} s: "
                  f"{str(e)[:90]}", flush=True)
        else:
            raise AssertionError(f"{name} on rank {caller} alone was not refused")
    dist.barrier()
os.environ.pop("PADDLE_HSDP_COLLECTIVE_TIMEOUT")
if previous is not None:
    os.environ["PADDLE_HSDP_COLLECTIVE_TIMEOUT"] = previous

# on every rank, the same calls work and nothing changed
after = model.state_dict()
assert all((after[k].numpy() == v).all() for k, v in before.items())
paddle_hsdp.save_checkpoint(work, model)
opt = make_optimizer(model, model.parameters(), 0.2)
train_steps(model, opt, batches(2, 1, world, 2), rank, world, 2)
print("ONE_RANK_CALLS_OK", flush=True)
finish()
