"""CPUOffloadPolicy: a logged no-op on CPU-only runs; on a device build, shards, grads
and optimizer state live in host storage while compute runs on the device.

``offload.EXERCISE_ON_CPU`` runs the offload path here with the CPU as the device, so
every upload and download is a real copy: who owns which storage, which copies happen
and how often the host waits are checked, and training must equal the no-offload run
bit for bit. On the one-rank fake mesh of kit.py every collective is a
copy: this checks placement and bookkeeping, not multi-rank numerics (the forced path
also runs in a 2x2 launch). What only a GPU can show (pinned staging, events, the
optimizer's kernels on the host of a device build) is in tools/gpu_check.py.
"""

import logging

import numpy as np
import pytest

import paddle

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import offload
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry
from kit import batch_ids, models

def _train(offload_policy, steps=3):
    model = models.build_model()
    for layer in [model.embed] + list(model.blocks):
        paddle_hsdp.fully_shard(layer, offload_policy=offload_policy)
    paddle_hsdp.fully_shard(model, offload_policy=offload_policy)
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    losses = []
    for step in range(steps):
        loss = models.lm_loss(model, batch_ids(seed=step), True)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return model, losses


def test_cpu_offload_on_a_cpu_run_is_a_logged_no_op(fake_mesh, caplog, monkeypatch):
    """Accepted, warned about once, and training is exactly the no-offload training."""
    monkeypatch.setattr(context, "warned_cpu_offload", False)
    with caplog.at_level(logging.WARNING, logger="paddle_hsdp.engine.policies"):
        model, losses = _train(paddle_hsdp.CPUOffloadPolicy())
    assert sum("no-op" in r.message for r in caplog.records) == 1
    assert not any(b.offload for u in hsdp_registry.units_under(model) for b in u.buffers)
    ref_model, ref_losses = _train(None)
    assert losses == ref_losses
    ref = paddle_hsdp.full_state_dict(ref_model)
    for name, value in paddle_hsdp.full_state_dict(model).items():
        np.testing.assert_array_equal(value.numpy(), ref[name].numpy(), err_msg=name)


def test_offload_policy_of_the_wrong_kind_is_refused(fake_mesh):
    with pytest.raises(TypeError, match="offload_policy"):
        paddle_hsdp.fully_shard(paddle.nn.Linear(2, 2), offload_policy="cpu")


@pytest.fixture
def exercised(monkeypatch):
    """The offload path run on CPU: host and "device" both the CPU, every upload and
    download a real copy, counted."""
    monkeypatch.setattr(offload, "EXERCISE_ON_CPU", True)
    offload.reset_counters()
    yield offload
    offload.reset_counters()


def _all_gathers() -> int:
    return sum(s.calls for (_, op), s in comm.counter.snapshot().items() if op == "all_gather")


def _buffers(model):
    return [b for u in hsdp_registry.units_under(model) for b in u.buffers]


def test_offload_keeps_the_optimizers_storage_on_the_host_and_trains_identically(
        fake_mesh, exercised):
    """Shards and grads are views of host storage that never moves (the optimizer's
    ``.grad`` views stay valid); what the collectives send is an uploaded copy; reduced
    grads come back by download; the optimizer steps on the host, after waits that are
    counted; and training equals the no-offload run bit for bit."""
    model = models.build_model()
    for layer in [model.embed] + list(model.blocks):
        paddle_hsdp.fully_shard(layer, offload_policy=paddle_hsdp.CPUOffloadPolicy())
    paddle_hsdp.fully_shard(model, offload_policy=paddle_hsdp.CPUOffloadPolicy())
    buffers = _buffers(model)
    trainable = [b for b in buffers if b.trainable]
    assert buffers and all(b.host is not None for b in buffers)
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    storage, losses = None, []
    for step in range(3):
        before = (offload.counters().uploads, offload.counters().downloads,
                  offload.counters().waits, offload.counters().host_steps)
        gathers = _all_gathers()
        loss = models.lm_loss(model, batch_ids(seed=step), True)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        uploads, downloads, waits, steps = (
            offload.counters().uploads - before[0], offload.counters().downloads - before[1],
            offload.counters().waits - before[2], offload.counters().host_steps - before[3])
        # one upload per all-gather (outer degree 1: no outer all-reduce to move),
        # one download per reduce-scatter, one wait before the grads are read
        assert uploads == _all_gathers() - gathers
        assert downloads == len(trainable)
        assert (waits, steps) == (1, 1)
        now = [(b.storage.flat.data_ptr(), b.grads.flat.data_ptr()) for b in trainable]
        assert storage in (None, now), "the host storage moved"
        storage = now
        for b in trainable:
            assert b.storage.flat.place.is_cpu_place() and b.grads.flat.place.is_cpu_place()
            for sp in b.params:
                assert sp.shard_is_view_of(b.storage.flat) and sp.grad_is_view_of(b.grads.flat)
    ref_model, ref_losses = _train(None)
    assert losses == ref_losses
    ref = paddle_hsdp.full_state_dict(ref_model)
    for name, value in paddle_hsdp.full_state_dict(model).items():
        np.testing.assert_array_equal(value.numpy(), ref[name].numpy(), err_msg=name)


def test_offload_with_accumulation_and_a_skipped_batch(fake_mesh, exercised):
    """Accumulated micro-steps add on the host in order; grads still on their way when
    clear_grad skips a batch are dropped, not added into the next step."""
    def run(offload_policy):
        model = models.build_model()
        for layer in list(model.blocks):
            paddle_hsdp.fully_shard(layer, offload_policy=offload_policy)
        paddle_hsdp.fully_shard(model, offload_policy=offload_policy)
        opt = models.make_optimizer(model, model.parameters(), 0.2)
        models.lm_loss(model, batch_ids(seed=9), True).backward()
        opt.clear_grad()  # the skipped batch
        for step in range(2):
            for micro in range(2):
                (models.lm_loss(model, batch_ids(seed=10 * step + micro), True) / 2).backward()
            opt.step()
            opt.clear_grad()
        return paddle_hsdp.full_state_dict(model)

    got = run(paddle_hsdp.CPUOffloadPolicy(pin_memory=False))
    assert offload.counters().host_steps == 2
    want = run(None)
    for name, value in got.items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)


def test_one_optimizer_over_offloaded_and_device_shards_is_refused(fake_mesh, exercised):
    model = models.build_model()
    paddle_hsdp.fully_shard(model.blocks[0], offload_policy=paddle_hsdp.CPUOffloadPolicy())
    paddle_hsdp.fully_shard(model)
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    models.lm_loss(model, batch_ids(), True).backward()
    before = {name: v.numpy() for name, v in paddle_hsdp.full_state_dict(model).items()}
    with pytest.raises(NotImplementedError, match="same offload_policy"):
        opt.step()
    for name, value in paddle_hsdp.full_state_dict(model).items():  # nothing updated
        np.testing.assert_array_equal(value.numpy(), before[name], err_msg=name)
