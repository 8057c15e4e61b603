"""The outer sync every H steps (``OuterSyncPolicy``, engine/diloco.py) in one process
(the one-rank fake mesh): ``every=1`` is plain HSDP bit for bit (no DiLoCo state is
made), and with one replica DiLoCo is AdamW for H steps then the outer Nesterov step
on the change since the last sync, against a plain-Paddle reference (float64). The
multi-replica runs are in test_collective/test_diloco.py."""

from __future__ import annotations

import numpy as np

import paddle_hsdp
from kit import batch_ids
from models import build_model, lm_loss, make_optimizer, shard_tinylm as shard_with

EVERY, STEPS, LR, MOMENTUM = 3, 7, 0.7, 0.9


def train(model, steps=STEPS):
    opt = make_optimizer(model, model.parameters(), None)
    for s in range(steps):
        lm_loss(model, batch_ids(seed=s), True).backward()
        opt.step()
        opt.clear_grad()
    return opt


def full(model):
    return {n: v.numpy() for n, v in paddle_hsdp.full_state_dict(model).items()}


def test_every_one_is_plain_hsdp_bit_for_bit(fake_mesh, float64):
    plain = shard_with(build_model())
    train(plain)
    one = shard_with(build_model(), outer_sync_policy=paddle_hsdp.OuterSyncPolicy(every=1))
    assert one.embed._hsdp_unit_.outer_sync is None  # the plain path: nothing else runs
    train(one)
    a, b = full(plain), full(one)
    assert all((a[n] == b[n]).all() for n in a)


def reference_one_replica():
    """AdamW on plain Paddle; every EVERY-th step the outer Nesterov step from the
    anchor on the (one replica's) pseudo-gradient."""
    model = build_model()
    opt = make_optimizer(model, model.parameters(), None)
    params = [p for p in model.parameters() if not p.stop_gradient]
    anchor = [p.numpy().copy() for p in params]
    momentum = [np.zeros_like(a) for a in anchor]
    for s in range(STEPS):
        lm_loss(model, batch_ids(seed=s), True).backward()
        opt.step()
        opt.clear_grad()
        if (s + 1) % EVERY == 0:
            for i, p in enumerate(params):
                delta = anchor[i] - p.numpy()
                momentum[i] = MOMENTUM * momentum[i] + delta
                anchor[i] = anchor[i] - LR * (delta + MOMENTUM * momentum[i])
                p.set_value(anchor[i])
    return {n: v.numpy() for n, v in model.state_dict().items()}


def test_one_replica_is_inner_adamw_then_outer_nesterov(fake_mesh, float64):
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM)
    model = shard_with(build_model(), outer_sync_policy=policy)
    train(model)
    got, want = full(model), reference_one_replica()
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-12, worst
    # the interval's position: 7 steps, syncs after 3 and 6, one step since
    assert model.embed._hsdp_unit_.outer_sync.steps == STEPS % EVERY
    # the check can fail: plain AdamW (no outer step) is far from it
    plain = build_model()
    train(plain)
    apart = max(float(np.abs(p.numpy() - want[n]).max()) for n, p in plain.state_dict().items())
    assert apart > 1e-3, apart
