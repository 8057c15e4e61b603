"""Resume after a crash reproduces the uninterrupted run, bit for bit (4 CPU ranks, 2 x 2).

argv: a work dir shared by the ranks, then "crash" or "resume".

crash: train STEPS steps, saving a checkpoint after every step (its ``extra`` holds the
step and the losses so far); rank 3 is killed in the middle of the save after step
CRASH_AT + 1 (its pieces written, the ranks' agreement not reached), so the job fails
(the launcher exits non-zero) with the checkpoint of step CRASH_AT in place, and the
survivors' error names the save (``SAVE_FAILED_NAMED``), not a raw gloo error.
resume (a new launch): load that checkpoint, train the remaining steps, then train an
uninterrupted run in this process from scratch; the losses of the crashed run (from
another process), the resumed run and the uninterrupted one must be equal bit for bit,
and so must every final parameter. A save then leaves no ``*.tmp-*`` of the killed save.
"""

import glob
import os
import signal
import sys

from common import assert_same_params, finish, init_fleet

import paddle.distributed as dist

from paddle_hsdp import CollectiveError, checkpoint
from paddle_hsdp.checkpoint import save as checkpoint_save
from models import batches, build_model, make_optimizer, shard_tinylm, train_steps

STEPS, CRASH_AT, PER_RANK, CLIP = 5, 3, 2, 0.2
work, mode = sys.argv[1], sys.argv[2]
CK = os.path.join(work, "last")
init_fleet({"sharding_degree": 4, "outer": 2})
rank, world = dist.get_rank(), dist.get_world_size()
data = batches(STEPS, 2, world, PER_RANK)


def sharded(seed):
    model = shard_tinylm(build_model(seed=seed))
    return model, make_optimizer(model, model.parameters(), CLIP)


if mode == "crash":
    model, opt = sharded(2024)
    losses = []
    for step in range(STEPS):
        if rank == 3 and step == CRASH_AT:  # killed inside this step's save
            write_pieces = checkpoint_save._write_pieces

            def write_then_die(*args, **kwargs):
                write_pieces(*args, **kwargs)
                print(f"CRASH rank {rank} in the save of step {step + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            checkpoint_save._write_pieces = write_then_die
        losses += train_steps(model, opt, [data[step]], rank, world, PER_RANK)
        try:
            checkpoint.save_checkpoint(CK, model, opt,
                                       extra={"step": step + 1, "losses": losses})
        except CollectiveError as e:
            assert f"save_checkpoint({CK!r})" in str(e), e
            print(f"SAVE_FAILED_NAMED rank {rank}: {str(e)[:160]}", flush=True)
            raise
    raise SystemExit("UNEXPECTED: the crash run finished")

model, opt = sharded(7)  # other weights: the checkpoint must bring everything back
assert glob.glob(CK + ".tmp-*"), "the killed save left no temporary directory to sweep"
extra = checkpoint.load_checkpoint(CK, model, opt)
assert extra["step"] == CRASH_AT, extra
losses = extra["losses"] + train_steps(model, opt, data[CRASH_AT:], rank, world, PER_RANK)
ref, ref_opt = sharded(2024)
ref_losses = train_steps(ref, ref_opt, data, rank, world, PER_RANK)
assert losses == ref_losses, (losses, ref_losses)
assert_same_params(model, ref)
print(f"RESUMED_BIT_EXACT from step {CRASH_AT}: losses {['%.7f' % x for x in losses]}",
      flush=True)
checkpoint.save_checkpoint(CK, model, opt, extra={"step": STEPS, "losses": losses})
assert not glob.glob(CK + ".tmp-*") and not glob.glob(CK + ".old-*"), os.listdir(work)
print("SWEPT_THE_KILLED_SAVE", flush=True)
finish()
