"""comm.* collectives on the inner, outer and FSDP groups: exact values and counted bytes.

Expected values are computed independently in numpy from the group's members; every input
is a small integer so float16 and bfloat16 results must be exact too.
"""

import numpy as np
from common import config_from_argv, finish, init_fleet

import paddle
import paddle.distributed as dist
from paddle_hsdp.comm import collectives as comm

hcg = init_fleet(config_from_argv())
rank = dist.get_rank()
GROUPS = {"inner": hcg.get_fsdp_inner_group(), "outer": hcg.get_fsdp_outer_group(),
          "fsdp": hcg.get_fsdp_group()}
K = 3  # elements per shard


def tensor(values, dtype):
    return paddle.to_tensor(np.asarray(values, dtype="float32")).astype(dtype)


def check(what, out, expected):
    got = out.astype("float32").numpy()
    assert np.isfinite(got).all() and np.array_equal(got, expected), (what, got, expected)


def run(op_name, async_op, *args):
    handle = getattr(comm, op_name)(*args, async_op=async_op)
    if async_op:
        handle.wait()
        handle.wait()  # idempotent
    else:
        assert handle is None


def values_of(r, n):
    return np.arange(n, dtype="float32") * (r + 1) + r


checks = 0
for name, group in GROUPS.items():
    n, me = group.nranks, group.ranks.index(rank)
    for dtype in ("float32", "bfloat16", "float16"):
        for async_op in (False, True):
            what = (name, dtype, "async" if async_op else "sync")
            total = sum(values_of(m, n * K) for m in group.ranks)

            out = tensor(np.zeros(K), dtype)
            run("reduce_scatter", async_op, out, tensor(values_of(rank, n * K), dtype), group)
            check(what + ("reduce_scatter",), out, total[me * K:(me + 1) * K])

            out = tensor(np.zeros(n * K), dtype)
            run("all_gather_into", async_op, out, tensor(np.arange(K) + 10 * rank, dtype), group)
            check(what + ("all_gather",), out,
                  np.concatenate([np.arange(K) + 10 * m for m in group.ranks]))

            x = tensor(values_of(rank, n * K), dtype)
            run("all_reduce", async_op, x, group)
            check(what + ("all_reduce",), x, total)

            src = group.ranks[-1]
            x = tensor(np.arange(K) + 10 * rank, dtype)
            run("broadcast", async_op, x, src, group)
            check(what + ("broadcast",), x, np.arange(K) + 10 * src)
            checks += 4

# Counted traffic of a known sequence: calls, payload bytes and ring wire bytes.
inner, outer, fsdp = GROUPS["inner"], GROUPS["outer"], GROUPS["fsdp"]
assert comm.group_label(inner) == "inner" and comm.group_label(outer) == "outer"
comm.counter.reset()
for _ in range(2):
    comm.all_gather_into(paddle.zeros([1024]), paddle.ones([1024 // inner.nranks]), inner)
comm.all_reduce(paddle.ones([256]), outer)
for _ in range(3):
    comm.reduce_scatter(paddle.zeros([1024 // fsdp.nranks]), paddle.ones([1024]), fsdp)
expected = {
    ("inner", "all_gather"): comm.OpStats(2, 2 * 4096, 2 * 4096 * 1 / 2),
    ("outer", "all_reduce"): comm.OpStats(1, 1024, 2 * 1024 * 1 / 2),
    (comm.group_label(fsdp), "reduce_scatter"): comm.OpStats(3, 3 * 4096, 3 * 4096 * 3 / 4),
}
assert comm.counter.snapshot() == expected, comm.counter.snapshot()
for (label, op), stats in expected.items():
    assert comm.counter.get(label, op) == stats, (label, op, comm.counter.get(label, op))

print(f"rank {rank} comm ops ok: {checks} checks, groups "
      + " ".join(f"{k}={g.ranks}" for k, g in GROUPS.items()), flush=True)
finish()
