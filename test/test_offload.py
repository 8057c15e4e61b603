"""CPUOffloadPolicy: a logged no-op on CPU-only runs; on a device build, shards and
grads live in host memory while compute runs on the device, with unchanged results.

The device test needs a CUDA build of Paddle and a GPU; it is skipped elsewhere (the
CPU-only CI included) with that reason. Both run on the one-rank fake mesh of
test_engine_single, so every collective is a copy: this checks placement and
plumbing, not multi-rank numerics.
"""

import logging

import numpy as np
import pytest

import paddle

import paddle_hsdp
from paddle_hsdp.engine import policies
from paddle_hsdp.engine.registry import registry as hsdp_registry
from test_engine_single import _ids, fake_mesh, models, registry  # noqa: F401  (fixtures)

HAS_GPU = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def _train(offload_policy, steps=3):
    model = models.build_model()
    for layer in [model.embed] + list(model.blocks):
        paddle_hsdp.fully_shard(layer, offload_policy=offload_policy)
    paddle_hsdp.fully_shard(model, offload_policy=offload_policy)
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    losses = []
    for step in range(steps):
        loss = models.lm_loss(model, _ids(seed=step), True)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return model, losses


def test_cpu_offload_on_a_cpu_run_is_a_logged_no_op(fake_mesh, caplog, monkeypatch):
    """Accepted, warned about once, and training is exactly the no-offload training."""
    monkeypatch.setattr(policies, "_warned_cpu_offload", False)
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


@pytest.mark.skipif(not HAS_GPU, reason="CPUOffloadPolicy's device path needs a CUDA build "
                    "of Paddle and a GPU; this run has neither (CPU-only Paddle)")
def test_cpu_offload_on_a_device_keeps_shards_on_host(fake_mesh):
    """Shard params and their grads are host tensors, gathered params device tensors,
    and the losses and params equal the no-offload run's."""
    model, losses = _train(paddle_hsdp.CPUOffloadPolicy(pin_memory=True))
    for p in model.parameters():
        assert not p.place.is_gpu_place(), p.name
        if p.grad is not None:
            assert not p.grad.place.is_gpu_place(), p.name
    units = hsdp_registry.units_under(model)
    for u in units:
        u.unshard()
    assert all(sp.full.place.is_gpu_place() for u in units for sp in u.params)
    for u in units:
        u.reshard(force=True)
    ref_model, ref_losses = _train(None)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    ref = paddle_hsdp.full_state_dict(ref_model)
    for name, value in paddle_hsdp.full_state_dict(model).items():
        np.testing.assert_allclose(value.numpy(), ref[name].numpy(), rtol=1e-6, atol=1e-7)
