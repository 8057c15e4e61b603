"""One replica group of a fault-tolerant HSDP job (its ranks: the launch's); the
scenarios of test_fault_tolerance.py start a coordinator and several of these, kill and
restart them, stop (hang) a rank, and kill a joiner or a donor in the state transfer.

Each rank's batches come from a loader whose position is attached to the replica's
state and fetched through train_step's next_batch (a rejoining group must go on
from the donor's position, not train a stale batch). argv: out_dir, steps. Environment (besides paddle_hsdp.ft's own): FT_TEST_KILL_AT=k
(every rank SIGKILLs itself in the middle of step k's backward; with
FT_TEST_KILL_AFTER_ETCD=1 it first writes out_dir/dying<r>_rank<i>, waits for
out_dir/etcd_down, which the test writes once it killed etcd, and dies 3 s after),
FT_TEST_PAUSE_AT=k (before step k every rank writes out_dir/paused<r>_rank<i> and waits
for out_dir/go<k>, which the test writes), FT_TEST_STOP_AT=k@i
(rank i SIGSTOPs itself there: it hangs), FT_TEST_DIE_IN_TRANSFER=n (a joiner
SIGKILLs itself at the n-th state tensor it receives or sends, or the n-th 1 KiB chunk
of a state handed over beside the step; n@k: only once it has taken k steps), FT_TEST_DIE_IN_CONNECT=d@k (every rank SIGKILLs itself d s after it
starts creating a round's outer groups, once it has taken k steps), FT_TEST_WAIT_JOIN=r@k[,r@k...] (before step k every rank waits until
replica r has arrived to join), FT_TEST_OPTIM=1 (fsdp_outer_sharding="optim": HFSDP
with paddle_hsdp.ft's redundancy, PADDLE_HSDP_FT_REDUNDANCY), FT_TEST_PENALTY=c (c x
the squared norm of model.parameters() added to each rank's loss; with
FT_TEST_PENALTY_MIN_GROUPS=g only in rounds of g groups or more: under HFSDP's re-cut a
piece no group holds as its own gets no penalty, docs/fault-tolerance.md), FT_TEST_SAVE=1
(after the last step the live groups save one checkpoint, out_dir/ckpt), FT_TEST_SAVE_AT=k
(after step k the live groups save out_dir/ckpt and each rank writes its results so far,
its parameters as of step k; with FT_TEST_KILL_AT=k+1 every group then dies: the whole
job stops), FT_TEST_RESUME=1 (replica.load_checkpoint(out_dir/ckpt) before the first
step: the job resumes from that joint checkpoint),
FT_TEST_OPTIMIZER=muon (paddle_hsdp.Muon, each matrix owned by one rank of
the group; default adamw), FT_TEST_DILOCO=H (the groups sync every H steps,
ft_common.DILOCO's outer Nesterov step: DiLoCo on replica groups), FT_TEST_FAIL_EACH_STEP=1 (the first attempt of every step after the first fails here, as
a failed collective would: a round that rebuilds the outer groups each step). Each rank writes
out_dir/replica<r>_rank<i>_<pid>.json: its committed losses, the replica's history
(rounds, failures, timings), its open sockets after each step and the final full
parameters; the leader also writes
out_dir/progress<r> (steps done) after each step.
"""

import faulthandler
import hashlib
import json
import logging
import os
import signal
import sys
import time

from common import init_fleet
from ft_common import (DILOCO, OPTIMIZERS, batch, build_model, loss_of, make_optimizer,
                       penalty_of, placement)

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp import ft
from paddle_hsdp.comm.collectives import CollectiveError
from paddle_hsdp.engine import outer_sync
from paddle_hsdp.ft.store import socket_fds

out_dir, steps = sys.argv[1], int(sys.argv[2])
penalty = float(os.environ.get("FT_TEST_PENALTY", 0))
penalty_min_groups = int(os.environ.get("FT_TEST_PENALTY_MIN_GROUPS", 0))
kill_at = int(os.environ.get("FT_TEST_KILL_AT", "0"))
wait_join: dict[int, list[int]] = {}  # step -> the replicas awaited before it
for item in filter(None, os.environ.get("FT_TEST_WAIT_JOIN", "").split(",")):
    joiner, step = item.split("@")
    wait_join.setdefault(int(step), []).append(int(joiner))
pause_at = int(os.environ.get("FT_TEST_PAUSE_AT", "0"))
stop_at = [int(v) for v in os.environ["FT_TEST_STOP_AT"].split("@")] \
    if os.environ.get("FT_TEST_STOP_AT") else None
faulthandler.register(signal.SIGUSR1)  # a stuck rank's stacks, on demand (kill -USR1)
if os.environ.get("FT_DEBUG"):
    logging.getLogger("paddle_hsdp.ft").setLevel(logging.DEBUG)
paddle.set_default_dtype("float64")
init_fleet({"sharding_degree": int(os.environ["PADDLE_TRAINERS_NUM"]), "outer": 1,
            "outer_sharding": "optim" if os.environ.get("FT_TEST_OPTIM") else "none"})
replica = ft.init()
rank = dist.get_rank()
kind = os.environ.get("FT_TEST_OPTIMIZER", "adamw")
assert kind in OPTIMIZERS, kind
model = build_model()
diloco_every = int(os.environ.get("FT_TEST_DILOCO", "1"))
outer_policy = paddle_hsdp.OuterSyncPolicy(every=diloco_every, **DILOCO) \
    if diloco_every > 1 else None
for layer in model.layers:
    paddle_hsdp.fully_shard(layer, shard_placement_fn=placement(kind),
                            outer_sync_policy=outer_policy)
paddle_hsdp.fully_shard(model, shard_placement_fn=placement(kind),
                        outer_sync_policy=outer_policy)
opt, scheduler = make_optimizer(model.parameters(), kind)


class Loader:
    """This rank's batches in order; its position travels with the replica's state
    (a rejoining group takes the donor's and goes on from there)."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        self.position += 1
        return batch(self.position - 1, replica.replica_id, rank)


loader = Loader()
replica.attach(model, opt, lr_scheduler=scheduler,
               state_dict=lambda: {"position": loader.position},
               load_state_dict=lambda state: setattr(loader, "position", state["position"]))
if os.environ.get("FT_TEST_OPTIM"):  # HFSDP as ft cut it: start // redundancy pieces
    from paddle_hsdp.engine.registry import registry
    parts = int(os.environ["PADDLE_HSDP_FT_START_REPLICAS"]) // \
        int(os.environ["PADDLE_HSDP_FT_REDUNDANCY"])
    buffers = [b for u in registry.units_under(model) for b in u.buffers if b.trainable]
    assert buffers and all((b.parts, b.part) == (parts, replica.replica_id % parts) and
                           b.shared_pieces == (parts > 1) for b in buffers), \
        [(b.parts, b.part) for b in buffers]
if os.environ.get("PADDLE_HSDP_FT_MAX_GROUP_SIZE"):  # laid out as the largest group's
    from paddle_hsdp.engine.registry import registry
    largest = int(os.environ["PADDLE_HSDP_FT_MAX_GROUP_SIZE"])  # (inner = the group's ranks)
    sharded = [b for u in registry.units_under(model) for b in u.buffers
               if b.params[0].placement != "replicate"]  # (kept whole: one segment)
    assert replica.layout_degree == largest and sharded and \
        all(b.layout_degree == largest for b in sharded), [b.layout_degree for b in sharded]
save_at = int(os.environ.get("FT_TEST_SAVE_AT", "0"))
resuming = bool(os.environ.get("FT_TEST_RESUME"))
# a save or a resume draws from the RNG each step (the model draws nothing), so the RNG
# state a resume restores is one no fresh start has
draws = bool(save_at or resuming)


def rng_digest() -> str:
    return hashlib.sha256(json.dumps([s.__getstate__() for s in paddle.get_rng_state()])
                          .encode()).hexdigest()[:16]


rng_resumed = None
if resuming:  # the whole job stopped: resume from its joint checkpoint
    replica.load_checkpoint(os.path.join(out_dir, "ckpt"))
    assert loader.position == replica.step > 0, (loader.position, replica.step)
    rng_resumed = rng_digest()
if os.environ.get("FT_TEST_DIE_IN_TRANSFER"):  # die at the n-th tensor moved
    from paddle_hsdp.comm import collectives
    received, broadcast = [0], collectives.broadcast
    nth, _, armed_at = os.environ["FT_TEST_DIE_IN_TRANSFER"].partition("@")

    def count_then_die():
        if replica.step >= int(armed_at or 0):
            received[0] += 1
            if received[0] == int(nth):
                with open(os.path.join(out_dir, f"died_in_transfer_rank{rank}"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    def broadcast_then_die(tensor, *args, tag=None, **kwargs):
        if tag == "ft state":
            count_then_die()
        return broadcast(tensor, *args, tag=tag, **kwargs)
    collectives.broadcast = broadcast_then_die
    # a state handed over beside the step (ft/handoff.py) counts its chunks, small here
    from paddle_hsdp.ft import handoff
    handoff.CHUNK_BYTES = 1024
    handoff._chunk_moved = lambda index: count_then_die()
if os.environ.get("FT_TEST_DIE_IN_CONNECT"):  # die d s into a round's group creation
    import threading

    from paddle_hsdp.ft import groups as ft_groups
    delay, _, connect_armed_at = os.environ["FT_TEST_DIE_IN_CONNECT"].partition("@")
    connect = ft_groups.connect

    def die_now():
        with open(os.path.join(out_dir, f"died_in_connect{replica.replica_id}_rank{rank}"),
                  "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def connect_then_die(*args, **kwargs):
        if replica.step >= int(connect_armed_at or 0):
            threading.Timer(float(delay), die_now).start()
        return connect(*args, **kwargs)
    ft_groups.connect = connect_then_die


_probe = []  # the test's own etcd client (a mate's job store has none: ft/relay.py)


def arrived(replica, number) -> set:
    """The replica groups that have arrived at round ``number`` (read from etcd)."""
    if not _probe:
        from paddle_hsdp.ft.etcd import Etcd
        # it waits for a restarted coordinator, as the job's clients do
        _probe.append(Etcd(os.environ["PADDLE_HSDP_FT_COORDINATOR"], away_s=120))
    found, _ = _probe[0].get_prefix(replica.store.keys.rounds(number) + "arrivals/")
    return {int(k.rsplit("/", 1)[1]) for k in found}


FAILED_ONCE = set()  # steps whose first attempt FT_TEST_FAIL_EACH_STEP failed


def fail_first_attempt():
    if os.environ.get("FT_TEST_FAIL_EACH_STEP") == "1" and replica.step >= 1 and \
            replica.step not in FAILED_ONCE:
        FAILED_ONCE.add(replica.step)
        raise CollectiveError("test: this step's first attempt fails (FT_TEST_FAIL_EACH_STEP)")


def die(_grad):
    if os.environ.get("FT_TEST_KILL_AFTER_ETCD") == "1":  # a death while etcd is away
        open(os.path.join(out_dir, f"dying{replica.replica_id}_rank{rank}"), "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(out_dir, "etcd_down")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(3)
    with open(os.path.join(out_dir, f"killed{replica.replica_id}_rank{rank}"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def hang(_grad):
    with open(os.path.join(out_dir, f"stopped{replica.replica_id}_rank{rank}"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def fault_hook():
    if replica.step + 1 == kill_at:
        return die
    if stop_at and replica.step + 1 == stop_at[0] and rank == stop_at[1]:
        return hang
    return None


def forward_backward(xy):
    fail_first_attempt()
    if draws:
        paddle.rand([1])
    x, y = xy
    loss = loss_of(model, x, y, fault_hook())
    penalised = penalty and len(replica.live_replicas) >= penalty_min_groups
    (loss + penalty_of(model, penalty) if penalised else loss).backward()
    return loss


# outer all-reduces issued during backward (engine/outer_sync.py), counted per step
early_syncs, issued = {}, [0]
_real_issue = outer_sync.OuterSyncSchedule._issue


def counted_issue(self, buf):
    issued[0] += 1
    return _real_issue(self, buf)


outer_sync.OuterSyncSchedule._issue = counted_issue
losses, sockets, history_from = {}, [], 0


def write_results():
    """This rank's losses and history since the last write, and its full parameters
    as of now (``params_step``)."""
    full = {name: t.numpy().tolist() for name, t in paddle_hsdp.full_state_dict(model).items()}
    with open(os.path.join(out_dir, f"replica{replica.replica_id}_rank{rank}_{os.getpid()}_"
                           f"{replica.step}.json"), "w") as f:
        json.dump({"replica": replica.replica_id, "rank": rank, "optimizer": kind,
                   "diloco": diloco_every,
                   "losses": losses, "history": replica.history[history_from:],
                   "params": full, "params_step": replica.step, "sockets": sockets,
                   "groups_freed": replica.outer.freed, "early_syncs": early_syncs,
                   "rng": rng_digest(), "rng_resumed": rng_resumed,
                   "layout_degree": replica.layout_degree}, f)


while replica.step < steps:
    if replica.step + 1 == pause_at:  # the test does something to etcd meanwhile
        open(os.path.join(out_dir, f"paused{replica.replica_id}_rank{rank}"), "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(out_dir, f"go{pause_at}")):
            assert time.time() < deadline, "the test never said go"  # test only
            time.sleep(0.05)
    if replica.step + 1 in wait_join:
        # every rank waits (a rank blocked in a collective with a waiting one would
        # meet the watchdog)
        joiners, deadline = wait_join[replica.step + 1], time.time() + 120
        while not set(joiners) <= arrived(replica, replica._next_round):
            assert time.time() < deadline, f"joiners {joiners} never all arrived"  # test only
            time.sleep(0.1)
        # and the leader's watcher has seen it: this step's vote then calls the round
        # at the next step (its mates wait for it in their first collective)
        while rank == 0 and not replica.control.join_waiting():  # test only
            assert time.time() < deadline, "the watcher never saw the joiner"
            time.sleep(0.05)
    before = issued[0]
    loss = replica.train_step(forward_backward, next_batch=lambda: next(loader))
    early_syncs[replica.step] = issued[0] - before
    # a batch per committed step, whatever rounds, retries and rejoins came between
    assert loader.position == replica.step, (loader.position, replica.step)
    losses[replica.step - 1] = float(loss)  # a joiner learns its step in train_step
    sockets.append(len(socket_fds()))
    if rank == 0:
        with open(os.path.join(out_dir, f"progress{replica.replica_id}"), "w") as f:
            f.write(str(replica.step))
    if replica.step == save_at:  # every live group saves, then trains on (until killed)
        paddle_hsdp.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt,
                                    extra={"step": replica.step})
        write_results()
        losses, history_from = {}, len(replica.history)  # the next file: the steps after


if os.environ.get("FT_TEST_SAVE"):  # every live group, one checkpoint together
    paddle_hsdp.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt,
                                extra={"step": replica.step})
replica.finish()
write_results()
print("WORKER_OK", flush=True)
