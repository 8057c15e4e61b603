"""No host synchronisation in the hot path (issue 24, item 5).

On a device every read of a tensor's value by the host (``int(t)``, ``bool(t)``,
``t.item()``, ``t.numpy()``, ``t.tolist()``, so also ``t.numel() > 0``) waits for the
device, and ``paddle.to_tensor`` is a synchronous host-to-device copy: one of them per
collective or per parameter would stall the overlap of communication with compute. On
CPU they are cheap, so they are counted instead: every such call made *by paddle_hsdp's
own code* (the calling frame is in the package) during a training step, with overlap
on and the tag comparison kept on the device as it is on a GPU (``DEFER_ON_CPU``).
"""

import os
import sys

import paddle
import pytest

from paddle_hsdp.comm import gather_tags
from paddle_hsdp.engine import trace
from kit import batch_ids, models, shard_tinylm

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "paddle_hsdp") + os.sep
READS = ("__int__", "__bool__", "__float__", "__index__", "item", "numpy", "tolist")


@pytest.fixture
def host_syncs(monkeypatch):
    """A list that collects ``(what, file:line)`` for every host read or ``to_tensor``
    that paddle_hsdp's own code makes."""
    monkeypatch.setattr(gather_tags, "DEFER_ON_CPU", True)
    monkeypatch.setattr(gather_tags, "_pending", [])
    seen = []

    def counted(name, original):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                frame = sys._getframe(1)
                seen.append((name, f"{os.path.relpath(caller, PACKAGE)}:{frame.f_lineno}"))
            return original(*args, **kwargs)
        return call

    for name in READS:
        monkeypatch.setattr(paddle.Tensor, name, counted(name, getattr(paddle.Tensor, name)))
    monkeypatch.setattr(paddle, "to_tensor", counted("to_tensor", paddle.to_tensor))
    return seen


@pytest.mark.parametrize("timeline", [False, True], ids=["plain", "memory_timeline"])
def test_forward_and_backward_make_no_host_sync_and_the_step_one(fake_mesh, host_syncs,
                                                                  timeline):
    """Also with the memory timeline on (engine/trace.py: from shapes, for the benchmark)."""
    if timeline:
        trace.enable(memory=True, rss=True)
    try:
        _step_twice(host_syncs)
    finally:
        trace.disable()
    assert not timeline or len(trace.recorded().timeline) > 0


def _step_twice(host_syncs):
    model = shard_tinylm(models.build_model(), reshard_blocks=True)  # ZeRO-3: most gathers
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))

    def step(seed):
        loss = models.lm_loss(model, batch_ids(seed=seed), True)
        loss.backward()
        passes = list(host_syncs)
        host_syncs.clear()
        opt.step()
        opt.clear_grad()
        boundary = list(host_syncs)
        host_syncs.clear()
        return passes, boundary

    step(0)  # the first step builds what later steps reuse (tag tables, accumulators)
    for seed in (1, 2):
        passes, boundary = step(seed)
        assert passes == [], passes
        # the one stacked read of every all-gather's tag flag (gather_tags.raise_pending)
        assert [what for what, _ in boundary] == ["numpy"], boundary
        assert boundary[0][1].startswith(os.path.join("comm", "gather_tags.py")), boundary


def test_the_counter_sees_a_host_read_in_the_package(fake_mesh, host_syncs):
    """The check above can fail: a read from paddle_hsdp's code is counted."""
    from paddle_hsdp.comm import collectives as comm  # noqa: PLC0415
    t = paddle.ones([3])
    comm.numel_of(t)                        # from shapes: not a read
    assert host_syncs == []
    gather_tags._compare(t.reshape([1, 3]).numpy(), t.numpy(), None)  # reads here: not counted
    assert host_syncs == []
    gather_tags.DEFER_ON_CPU = True
    bad = paddle.to_tensor([[1.0, 2.0]])
    gather_tags._pending.append((paddle.any(bad != bad), bad, bad[0], None, ()))
    gather_tags.raise_pending()             # one stacked read, inside the package
    assert [what for what, _ in host_syncs] == ["numpy"]
