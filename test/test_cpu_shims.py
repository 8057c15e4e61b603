"""The CPU shims of issue 32 in one process (paddle_hsdp/patches/cpu_compat.py,
cpu_mp_ops.py, cpu_pipeline.py, pipeline.py).

Numerics against each op's definition where one process can hold the op (the global
group of an unlaunched process has one rank, so the collectives short-circuit): the
vocabulary-parallel lookup and its float64 grad, the vocabulary-parallel cross entropy,
``c_concat``, the gloo ``reduce_scatter``. Across real ranks, the same checks run on 2
mp ranks in test_collective/test_3d.py (workers/worker_cpu_ops.py). The rest proves
which calls and flags: device tensors and NCCL groups reach Paddle's own functions, the
pipeline's p2p order, the final loss's header, a sharded ``PipelineLayer``'s forward
through its hooks.
"""


import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle.distributed import fleet

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import trace
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.patches import cpu_compat, cpu_pipeline

import parity  # test_collective/workers/parity.py (test/conftest.py puts it on the path)


def _embedding_grad(ids, upstream, start, rows):
    """The definition: row ``id - start`` of the table gets every upstream vector of the
    ids in ``[start, start + rows)``."""
    grad = np.zeros([rows, upstream.shape[-1]])
    for index in np.ndindex(ids.shape):
        if start <= ids[index] < start + rows:
            grad[ids[index] - start] += upstream[index]
    return grad


def test_c_embedding_float64_grad_is_the_definitions_over_accumulating_backwards(float64):
    rng = np.random.default_rng(0)
    table = paddle.create_parameter([6, 4], "float64")
    want = np.zeros([6, 4])
    for _ in range(4):  # the CPU kernel's float64 grad goes wrong here (garbage rows)
        ids = rng.integers(0, 18, size=(3, 5))
        upstream = rng.standard_normal([3, 5, 4])
        out = paddle._C_ops.c_embedding(table, paddle.to_tensor(ids), 6, 18)
        rows = np.where(((ids >= 6) & (ids < 12))[..., None], table.numpy()[np.clip(ids - 6, 0, 5)], 0)
        assert np.array_equal(out.numpy(), rows)
        (out * paddle.to_tensor(upstream)).sum().backward()
        want += _embedding_grad(ids, upstream, 6, 6)
        parity.assert_close(table.grad.numpy(), want, "c_embedding grad")


def test_vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy(float64):
    rng = np.random.default_rng(1)
    logits, weights = rng.standard_normal([2, 5, 7]), rng.standard_normal([2, 5, 1])
    labels = rng.integers(0, 7, size=(2, 5, 1))
    labels[1, 3] = -100
    full = paddle.to_tensor(logits, stop_gradient=False)
    want = F.cross_entropy(full, paddle.to_tensor(labels), reduction="none", ignore_index=-100)
    (want * paddle.to_tensor(weights)).sum().backward()
    mine = paddle.to_tensor(logits, stop_gradient=False)
    softmax, loss = paddle._C_ops.c_softmax_with_cross_entropy(
        mine, paddle.to_tensor(labels), -100, 0, 0, 1)  # ring 0: this process's group
    (loss * paddle.to_tensor(weights)).sum().backward()
    assert loss.numpy()[1, 3] == 0
    parity.assert_close(loss.numpy(), want.numpy(), "loss")
    parity.assert_close(softmax.numpy(), F.softmax(full, -1).numpy(), "softmax")
    parity.assert_close(mine.grad.numpy(), full.grad.numpy(), "logits grad")


def test_c_concat_on_one_rank_is_the_piece_and_its_grad(float64):
    x = paddle.to_tensor(np.arange(6.0).reshape([2, 3]), stop_gradient=False)
    out = paddle._C_ops.c_concat(x, 0, 1, 0, True, True)
    (out * 3).sum().backward()
    assert np.array_equal(out.numpy(), x.numpy())
    assert np.array_equal(x.grad.numpy(), np.full([2, 3], 3.0))


def test_gloo_reduce_scatter_leaves_its_input_and_returns_a_waitable(float64):
    x = paddle.to_tensor(np.arange(4.0))
    out = paddle.empty([4], "float64")
    group = paddle.distributed.collective._get_global_group()  # one rank, gloo
    assert paddle.distributed.stream.reduce_scatter(out, x, group=group) is None
    paddle.distributed.stream.reduce_scatter(out, [x], group=group, sync_op=False).wait()
    assert np.array_equal(out.numpy(), np.arange(4.0)) and np.array_equal(x.numpy(), np.arange(4.0))
    with pytest.raises(NotImplementedError, match="sums only"):
        paddle.distributed.stream.reduce_scatter(out, x, op=paddle.distributed.ReduceOp.MAX,
                                                 group=group)


class _StaticValue:
    """Stands for a static graph's value (to_static, no place): Paddle's op, untouched."""


@pytest.mark.parametrize("op,args", [
    ("c_identity", (0, True, True)), ("c_concat", (0, 2, 0, True, True)),
    ("c_softmax_with_cross_entropy", (None, -100, 0, 0, 2)), ("c_embedding", (None, 0, -1))])
@pytest.mark.parametrize("where", ["device", "static graph"])
def test_device_tensors_and_static_values_reach_paddles_own_kernel(monkeypatch, op, args,
                                                                   where):
    calls = []
    monkeypatch.setitem(cpu_compat.PADDLE, op, lambda *a, **k: calls.append(a) or "paddle")
    x = _StaticValue()
    if where == "device":  # a dygraph tensor whose place is not the CPU
        x = paddle.ones([1])
        monkeypatch.setattr(cpu_compat, "_on_cpu", lambda t: False)
    assert getattr(paddle._C_ops, op)(x, *args) == "paddle"
    assert len(calls) == 1


def test_reduce_scatter_over_nccl_is_paddles(monkeypatch):
    calls = []
    monkeypatch.setattr(comm, "is_gloo", lambda group: False)
    monkeypatch.setitem(cpu_compat.PADDLE, "reduce_scatter", lambda *a: calls.append(a) or "paddle")
    group = object()
    assert paddle.distributed.stream.reduce_scatter("out", "in", group=group) == "paddle"
    assert calls[0][3] is group


def test_tensor_parallel_input_broadcast_runs_on_cpu(monkeypatch):
    """fleet's TensorParallel wrapper broadcasts every forward's inputs over the mp group;
    Paddle asserts a GPU, XPU or custom device there. On CPU the shim makes Paddle's own
    per-element broadcasts (here recorded), in place, and returns the inputs as they were;
    on a device Paddle's function runs."""
    from paddle.distributed.fleet.meta_parallel import tensor_parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util as util

    seen = []
    monkeypatch.setattr(util, "_broadcast_nested_data",
                        lambda hcg, dev, place, data: seen.append((dev, data)))
    x, kw = paddle.ones([2, 3]), {"labels": paddle.zeros([2])}
    assert tensor_parallel.broadcast_input_data("hcg", x, labels=kw["labels"]) == ((x,), kw)
    assert [dev for dev, _ in seen] == ["cpu", "cpu"] and seen[0][1] == (x,)
    monkeypatch.setitem(cpu_compat.PADDLE, "broadcast_input_data", lambda *a, **k: "paddle")
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    assert util.broadcast_input_data("hcg", x) == "paddle"


def test_parallel_env_device_id_answers_on_a_cpu_build():
    assert paddle.distributed.ParallelEnv().device_id == 0


class _FakeHCG:
    def __init__(self, stage):
        self.stage = stage

    def get_pipe_parallel_group(self):
        return "pipe"

    def _get_p2p_prev_rank(self):
        return 10

    def _get_p2p_next_rank(self):
        return 11

    def get_stage_id(self):
        return self.stage


def _record_p2p(monkeypatch):
    calls = []
    monkeypatch.setattr(comm, "send", lambda t, peer, group, tag: calls.append(("send", t, peer)))
    monkeypatch.setattr(comm, "recv", lambda t, peer, group, tag: calls.append(("recv", t, peer)))
    return calls


@pytest.mark.parametrize("stage,order", [
    (0, [("send", "a", 11), ("recv", "b", 10), ("send", "c", 10), ("recv", "d", 11)]),
    (1, [("recv", "b", 10), ("send", "a", 11), ("recv", "d", 11), ("send", "c", 10)])])
def test_pipeline_p2p_order_cannot_deadlock(monkeypatch, stage, order):
    """Towards the next stage first, then towards the previous one; even stages send
    first, odd stages receive first: each link has one sender and one receiver."""
    calls = _record_p2p(monkeypatch)
    assert cpu_pipeline.gloo_p2p("c", "b", "a", "d", _FakeHCG(stage)) == []
    assert calls == order


def test_pipeline_p2p_sends_tuples_in_order_and_skips_none(monkeypatch):
    calls = _record_p2p(monkeypatch)
    cpu_pipeline.gloo_p2p(None, None, ("x", "y"), None, _FakeHCG(2))
    assert calls == [("send", "x", 11), ("send", "y", 11)]


def test_pipeline_p2p_over_nccl_is_paddles(monkeypatch):
    monkeypatch.setattr(comm, "is_gloo", lambda group: False)
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p
    for name in ("_batched_p2p_ops", "_p2p_ops"):
        monkeypatch.setitem(cpu_pipeline.PADDLE, name, lambda *a: ["paddle"])
        assert getattr(p2p, name)(None, None, None, None, _FakeHCG(0)) == ["paddle"]


@pytest.mark.parametrize("dtype,index", [("float32", 0), ("float16", 1), ("bfloat16", 2),
                                         ("float64", 3)])
@pytest.mark.parametrize("shape", [[1], []])
def test_final_loss_travels_in_its_own_dtype_and_shape(monkeypatch, dtype, index, shape):
    """A 0-d loss stays 0-d on the other stages: PaddleFormers' Trainer adds it to a 0-d
    running loss and all-gathers that over the job (a [1] loss on some ranks made
    those ranks' sum float32 [1] and the others' float64 [], and gloo aborted)."""
    sent = []
    monkeypatch.setattr(comm, "broadcast", lambda t, src, group, tag: sent.append(t.numpy().copy()))
    loss = paddle.full(shape, 1.5, dtype=dtype)
    assert cpu_pipeline.broadcast_loss(loss, 3, "pipe") is loss
    assert sent[0].tolist() == [index, 1, int(shape == [])]

    def receive(t, src, group, tag):  # a peer: the header arrives, then the values
        if t.dtype == paddle.int64:
            paddle.assign(paddle.to_tensor(sent[0], dtype="int64"), output=t)
    monkeypatch.setattr(comm, "broadcast", receive)
    got = cpu_pipeline.broadcast_loss(None, 3, "pipe")
    assert got.dtype == loss.dtype and got.shape == shape


def _pipeline_layer():
    from paddle.distributed.fleet.base.topology import CommunicateTopology
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
    topology = CommunicateTopology(["data", "pipe", "model"], [1, 1, 1])
    return PipelineLayer(layers=[LayerDesc(paddle.nn.Linear, 4, 4) for _ in range(3)],
                         num_stages=1, topology=topology)


@pytest.mark.parametrize("direct", [True, False])
def test_a_sharded_pipeline_layer_is_one_root_however_its_forward_is_called(
        fake_mesh, direct):  # noqa: F811
    """PipelineParallel calls ``PipelineLayer.forward`` directly: on a sharded one it
    runs the hooks once, so the stage is the root and its blocks are not roots; a
    ``model(x)`` call runs them once too."""
    model = _pipeline_layer()
    for layer in model.run_function[:2]:
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    trace.enable()
    try:
        out = model.forward(paddle.ones([2, 4])) if direct else model(paddle.ones([2, 4]))
        out.sum().backward()
        root = model._hsdp_unit
        starts = [e for e in trace.recorded().events if e == ("forward", "compute", root.index)]
    finally:
        trace.disable()
    assert root.is_root and len(starts) == 1, trace.recorded().events
    assert not any(u.is_root for u in hsdp_registry.units if u is not root)
    assert model.__dict__["_hsdp_calls_in_progress"] == 0


def test_an_unsharded_pipeline_layer_keeps_its_forward():
    model = _pipeline_layer()
    assert model.forward(paddle.ones([2, 4])).shape == [2, 4]
    assert "_hsdp_calls_in_progress" not in model.__dict__


class _FleetPipeGroups:
    """fleet's HCG of pp2 x sharding2: sharding inside pipe (ranks 0, 1 are stage 0)."""

    def __init__(self):
        from paddle.distributed.fleet.base.topology import CommunicateTopology
        self.topo = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"],
                                        [1, 2, 2, 1, 1])

    def get_pipe_parallel_world_size(self):
        return 2

    def topology(self):
        return self.topo


def test_a_pipeline_layer_whose_stages_are_not_fleets_is_refused(monkeypatch):
    from paddle.distributed.fleet.base import topology as fleet_topology
    from paddle.distributed.fleet.base.topology import CommunicateTopology
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer
    fleet_groups = _FleetPipeGroups()
    monkeypatch.setattr(fleet_topology, "_HYBRID_PARALLEL_GROUP", fleet_groups)
    # PipelineLayer reads fleet's strategy when it has several stages
    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", fleet.DistributedStrategy(),
                        raising=False)
    layers = [LayerDesc(paddle.nn.Linear, 4, 4) for _ in range(2)]
    own = CommunicateTopology(["data", "pipe", "model"], [2, 2, 1])  # PipelineLayer's default
    with pytest.raises(ValueError, match=r"rank 1 is stage 1 here, stage 0 in fleet's.*"
                                         r"topology=fleet.get_hybrid_communicate_group"):
        PipelineLayer(layers=layers, topology=own)
    assert PipelineLayer(layers=layers, topology=fleet_groups.topo)._num_stages == 2
