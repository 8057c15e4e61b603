"""A short job that creates several gloo sub-groups and exits (argv: "check", "barrier"
or "no_barrier").

check: the store servers this rank hosts are destroyed by gloo_store.stop_servers()
(what the atexit handler runs), which joins their threads, and the groups keep
working after it; then exit without a final barrier (as the last worker of a run_many.py
launch, it also stops the servers of the groups the earlier workers made). barrier /
no_barrier: just exit, with or without a final barrier, leaving it to the atexit
handler; the launcher's exit status is the test.
"""

import os
import sys

import paddle_hsdp  # noqa: F401  (installs the safe gloo sub-groups)
from paddle_hsdp.comm import gloo_store
import paddle
import paddle.distributed as dist

mode = sys.argv[1]
dist.init_parallel_env()
rank = dist.get_rank()
hosted_before = len(gloo_store._servers)  # earlier workers' groups' servers, if any
groups = [dist.new_group(m) for m in ([0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3])]


def check_all():
    for g in groups:
        if rank in g.ranks:
            x = paddle.ones([3])
            dist.all_reduce(x, group=g)
            assert x.numpy().tolist() == [float(len(g.ranks))] * 3, (g.ranks, x.numpy())


check_all()
if mode == "check":
    hosted = len(gloo_store._servers)
    expected = sum(1 for m in ([0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3]) if m[0] == rank)
    assert hosted == hosted_before + expected, (hosted, hosted_before, expected)
    before = len(os.listdir("/proc/self/task"))
    gloo_store.stop_servers()
    after = len(os.listdir("/proc/self/task"))
    assert before - after == hosted, (before, after, hosted)  # each server's thread joined
    check_all()  # rendezvous is done: the groups do not need their servers
if mode == "barrier":
    dist.barrier()
print("WORKER_OK", flush=True)
