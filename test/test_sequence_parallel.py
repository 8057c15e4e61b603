"""Sequence parallel next to HSDP in one process (paddle_hsdp/patches/sequence_parallel.py
and the marks shards carry, engine/param.py): which grads get the mp all-reduce and
how often, whichever order Paddle's ``register_sequence_parallel_allreduce_hooks`` is
called in. The mp group is a fake of two ranks whose all-reduce doubles the tensor (two
ranks holding the same part), so a grad reduced once is twice the plain one; Paddle's
own all-reduce records its calls. The numerics on real mp ranks: test_collective/test_3d.py.
"""

import types

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import hybrid_parallel_util as util
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

import paddle_hsdp
from paddle_hsdp.engine.param import MARKS
from paddle_hsdp.patches import sequence_parallel



class _PaddleAllReduce:
    """The fake mp group's process group: Paddle's own hooks call ``allreduce``."""

    def __init__(self):
        self.calls = 0

    def allreduce(self, tensor):
        self.calls += 1
        tensor.scale_(2.0)
        return types.SimpleNamespace(wait=lambda: None)


@pytest.fixture
def mp2(monkeypatch, fake_mesh):  # noqa: F811
    """A fake mp group of 2 ranks behind fleet's HCG; returns (ours, paddle's) counters."""
    group = types.SimpleNamespace(nranks=2, rank=0, ranks=[0, 1], id=-7,
                                  process_group=_PaddleAllReduce())
    hcg = types.SimpleNamespace(get_model_parallel_group=lambda: group)
    monkeypatch.setattr(spu.fleet, "get_hybrid_communicate_group", lambda: hcg)
    monkeypatch.setattr(sequence_parallel, "_mp_group", lambda: group)
    monkeypatch.setattr(paddle.distributed, "is_initialized", lambda: True)
    ours = []

    def all_reduce(tensor, grp, tag):
        assert grp is group
        ours.append(tag)
        tensor.scale_(2.0)
    monkeypatch.setattr(sequence_parallel, "comm", types.SimpleNamespace(all_reduce=all_reduce))
    return ours, group.process_group


def _model(seed=3):
    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.LayerNorm(4), paddle.nn.Linear(4, 4))
    for p in model[0].parameters():
        spu.mark_as_sequence_parallel_parameter(p)
    return model


def _plain_grads(micro: int) -> dict:
    model = _model()
    for k in range(micro):
        model(paddle.full([2, 4], float(k + 1))).sum().backward()
    return {n: p.grad.numpy() for n, p in model.named_parameters()}


def _train(model, micro: int) -> dict:
    for k in range(micro):
        model(paddle.full([2, 4], float(k + 1))).sum().backward()
    paddle_hsdp.finish_grad_sync(model)
    return {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("fused", [False, True])
def test_marked_grads_are_summed_over_mp_once_per_backward_in_either_order(mp2, order, fused):
    ours, paddles = mp2
    micro = 2
    model = _model()
    if order == "before":
        spu.register_sequence_parallel_allreduce_hooks(model, micro, fused)
    paddle_hsdp.fully_shard(model)
    if order == "after":
        spu.register_sequence_parallel_allreduce_hooks(model, micro, fused)
    got, want = _train(model, micro), _plain_grads(micro)
    for name in want:
        factor = 2.0 if name.startswith("0.") else 1.0  # the LayerNorm's: marked
        np.testing.assert_allclose(got[name], factor * want[name], rtol=1e-6, err_msg=name)
    assert len(ours) == 2 * micro  # each marked param, each backward
    assert paddles.calls == 0  # Paddle's own hooks did nothing on HSDP's params


def test_shards_carry_the_sequence_parallel_mark(mp2):
    model = _model()
    paddle_hsdp.fully_shard(model)
    marked = [n for n, p in model.named_parameters() if spu.is_sequence_parallel_parameter(p)]
    assert marked == ["0.weight", "0.bias"]


def test_registering_twice_sums_once(mp2):
    ours, _ = mp2
    model = _model()
    spu.register_sequence_parallel_allreduce_hooks(model, 1, False)
    paddle_hsdp.fully_shard(model)
    spu.register_sequence_parallel_allreduce_hooks(model, 1, True)
    _train(model, 1)
    assert len(ours) == 2


@pytest.mark.parametrize("fused", [False, True])
def test_parameters_hsdp_does_not_manage_keep_paddles_hooks(mp2, monkeypatch, fused):
    ours, paddles = mp2
    fused_calls = []
    monkeypatch.setattr(spu, "fused_allreduce_gradients_with_group",
                        lambda params, group, scale: fused_calls.append(len(params)))
    model = _model()
    spu.register_sequence_parallel_allreduce_hooks(model, 1, fused)
    model(paddle.ones([2, 4])).sum().backward()
    assert ours == []
    # Paddle's non-fused hook: one all-reduce per marked param; the fused one: one call
    # for both, once both fired (Paddle 3.3's own would raise on its missing argument)
    assert (paddles.calls, fused_calls) == ((0, [2]) if fused else (2, []))


@pytest.mark.parametrize("over_mp", [True, False])
def test_a_fused_all_reduce_of_shards_sums_them_over_mp_only(mp2, over_mp):
    """PaddleFormers' SPGradSyncCallback: Paddle's fused all-reduce of the marked params
    over the mp group at the optimizer's start. Over mp, HSDP's shards are summed once
    (after the step's sync); over any other group they are left to HSDP."""
    ours, paddles = mp2
    model = _model()
    paddle_hsdp.fully_shard(model)
    for k in range(2):
        model(paddle.full([2, 4], float(k + 1))).sum().backward()
    marked = [p for p in model.parameters() if spu.is_sequence_parallel_parameter(p)]
    group = sequence_parallel._mp_group() if over_mp else types.SimpleNamespace(nranks=2, id=-8)
    util.fused_allreduce_gradients_with_group(marked, group=group, scale=1.0)
    got, want = {n: p.grad.numpy() for n, p in model.named_parameters()}, _plain_grads(2)
    for name in want:
        factor = 2.0 if over_mp and name.startswith("0.") else 1.0
        np.testing.assert_allclose(got[name], factor * want[name], rtol=1e-6, err_msg=name)
    assert (len(ours), paddles.calls) == ((2 if over_mp else 0), 0)


def test_every_mark_paddle_reads_is_carried_and_tensors_are_not(fake_mesh):  # noqa: F811
    model = paddle.nn.Linear(4, 4)
    for name in MARKS:
        setattr(model.weight, name, f"mark {name}")
    model.weight.some_new_mark = 7
    model.weight.cached_copy = paddle.ones([1])  # per-tensor data, not a mark
    paddle_hsdp.fully_shard(model)
    shard = model.weight
    assert hasattr(shard, "_hsdp_sharded_param")
    for name in MARKS:
        assert getattr(shard, name) == f"mark {name}", name
    assert shard.some_new_mark == 7 and not hasattr(shard, "cached_copy")
