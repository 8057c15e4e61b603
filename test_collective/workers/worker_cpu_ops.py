"""The CPU shims of Paddle's tensor-parallel and pipeline ops (issue 32) against each
op's definition, on the 2 ranks of an mp group (float64, workers/parity.py's bound):

* ``c_concat`` (``mp_ops._c_concat``): every rank's piece side by side; its grad, this
  rank's piece of the output grad;
* ``c_softmax_with_cross_entropy`` (``ParallelCrossEntropy``'s op) on vocabulary-split
  logits: the loss and softmax of the whole vocabulary, 0 for ``ignore_index``, the
  grad of the whole-vocabulary cross entropy on this rank's columns;
* ``c_embedding`` (``VocabParallelEmbedding``'s lookup, then its mp all-reduce): the
  lookup of the whole table, and its grad (the CPU kernel's float64 grad is garbage);
* ``paddle.distributed.stream.reduce_scatter`` over the gloo mp group: the sum's slice,
  the input left as it was, from a tensor or a list, synchronous or not;
* the pipeline's final-loss broadcast (``cpu_pipeline.broadcast_loss``) in float64,
  float32 and bfloat16.
Every rank builds the same "whole" tensors from one seed, so each checks its own piece.
"""

import numpy as np
from common import config_from_argv, finish, init_fleet, max_rel
import parity

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed.fleet.layers.mpu import mp_ops

from paddle_hsdp.patches import cpu_pipeline

hcg = init_fleet(config_from_argv())
group = hcg.get_model_parallel_group()
n, r = group.nranks, group.rank
parity.set_dtype("float64")
rng = np.random.default_rng(3)


def whole(*shape):
    return rng.standard_normal(shape)


def piece(a, axis=-1):
    return np.split(a, n, axis=axis)[r]


def check_concat() -> dict:
    pieces = [whole(2, 3, 4) for _ in range(n)]
    x = paddle.to_tensor(pieces[r], stop_gradient=False)
    out = mp_ops._c_concat(x, group=group)
    upstream = whole(2, 3, 4 * n)
    (out * paddle.to_tensor(upstream)).sum().backward()
    return {"concat": max_rel(out.numpy(), np.concatenate(pieces, axis=-1)),
            "concat grad": max_rel(x.grad.numpy(), piece(upstream))}


def check_cross_entropy() -> dict:
    vocab = 6 * n
    logits, weights = whole(3, 5, vocab), whole(3, 5, 1)
    labels = rng.integers(0, vocab, size=(3, 5, 1))
    labels[0, :2] = -100  # ignore_index
    full = paddle.to_tensor(logits, stop_gradient=False)
    lab = paddle.to_tensor(labels)
    want = F.cross_entropy(full, lab, reduction="none", ignore_index=-100)
    (want * paddle.to_tensor(weights)).sum().backward()
    local = paddle.to_tensor(piece(logits), stop_gradient=False)
    loss, softmax = mp_ops._c_softmax_with_cross_entropy(local, lab, group=group,
                                                          return_softmax=True)
    (loss * paddle.to_tensor(weights)).sum().backward()
    assert np.all(loss.numpy()[0, :2] == 0), loss.numpy()[0, :2]
    return {"cross entropy": max_rel(loss.numpy(), want.numpy()),
            "softmax": max_rel(softmax.numpy(), piece(F.softmax(full, -1).numpy())),
            "cross entropy grad": max_rel(local.grad.numpy(), piece(full.grad.numpy()))}


def check_embedding() -> dict:
    rows = 5
    table, upstream = whole(rows * n, 4), whole(3, 7, 4)
    ids = paddle.to_tensor(rng.integers(0, rows * n, size=(3, 7)))
    full = paddle.to_tensor(table, stop_gradient=False)
    (F.embedding(ids, full) * paddle.to_tensor(upstream)).sum().backward()
    local = paddle.to_tensor(piece(table, 0), stop_gradient=False)
    out = mp_ops._c_lookup_table(local, ids, start_index=r * rows, vocab_size=rows * n)
    out = mp_ops._mp_allreduce(out, group=group, use_calc_stream=True, use_model_parallel=True)
    (out * paddle.to_tensor(upstream)).sum().backward()
    return {"embedding": max_rel(out.numpy(), F.embedding(ids, full).numpy()),
            "embedding grad": max_rel(local.grad.numpy(), piece(full.grad.numpy(), 0))}


def check_reduce_scatter() -> dict:
    inputs = [whole(4 * n, 3) for _ in range(n)]
    want = piece(sum(inputs), 0)
    worst = {}
    for as_list in (False, True):
        x = paddle.to_tensor(inputs[r])
        source = list(paddle.split(x, n, axis=0)) if as_list else x
        out = paddle.empty([4, 3], "float64")
        task = dist.stream.reduce_scatter(out, source, group=group, sync_op=as_list is False)
        if task is not None:
            task.wait()
        assert np.array_equal(x.numpy(), inputs[r]), "reduce_scatter changed its input"
        worst[f"reduce_scatter list={as_list}"] = max_rel(out.numpy(), want)
    return worst


def check_loss_broadcast() -> dict:
    src = group.ranks[-1]
    worst = {}
    for dtype in ("float64", "float32", "bfloat16"):
        value = paddle.to_tensor([2.0 / 3.0], dtype=dtype)
        got = cpu_pipeline.broadcast_loss(value if dist.get_rank() == src else None, src, group)
        assert got.dtype == value.dtype and got.shape == [1], (got.dtype, got.shape)
        worst[f"loss broadcast {dtype}"] = float(
            (got.astype("float64") - value.astype("float64")).abs().max())
    return worst


worst = {}
for check in (check_concat, check_cross_entropy, check_embedding, check_reduce_scatter,
              check_loss_broadcast):
    worst.update(check())
parity.report("CPU_OPS mp2 against the ops' definitions", worst)
print(f"CPU_OPS {len(worst)} checks within {parity.bound():.0e}: max {max(worst.values()):.2e}",
      flush=True)
paddle.set_default_dtype("float32")
finish()
