"""The outer sync every H steps (``OuterSyncPolicy``, engine/diloco.py) in one process
(the one-rank fake mesh): ``every=1`` is plain HSDP bit for bit (no DiLoCo state is
made), and with one replica DiLoCo is AdamW for H steps then the outer Nesterov step
on the change since the last sync, against a plain-Paddle reference (float64), also
streaming (fragments synced in turn) and after ``load_checkpoint`` without the
optimizer (the anchor moves to the loaded params); the config file's keys and fleet's
``sharding_configs`` keys reach ``fully_shard``. The
multi-replica runs are in test_collective/test_diloco.py."""

from __future__ import annotations

import itertools
import re

import numpy as np
import paddle
import pytest
from paddle.distributed import fleet

import paddle_hsdp
from kit import batch_ids
from paddle_hsdp.config.plan import outer_sync_policy_of
from paddle_hsdp.config.schema import ConfigError, load_config
from paddle_hsdp.engine.diloco import deal_fragments
from models import (build_model, fragment_of, lm_loss, make_optimizer,
                    shard_tinylm as shard_with)

EVERY, STEPS, LR, MOMENTUM = 3, 7, 0.7, 0.9
CLIP = 0.5  # below every step's grad norm here: the clip is active


def train(model, steps=STEPS, clip=None):
    opt = make_optimizer(model, model.parameters(), clip)
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


def reference_one_replica(clip=None, start=None, position=0, seeds=range(STEPS),
                          fragments=None):
    """AdamW on plain Paddle (from ``start``'s values, if given); every EVERY-th step
    (``position`` steps into the interval at the start) the outer Nesterov step from the
    anchor on the (one replica's) pseudo-gradient. ``fragments``: ``(F, {name:
    fragment})``, fragment f's params stepped where the position comes round to
    f EVERY // F."""
    count, fragment = fragments or (1, {})
    model = build_model()
    if start is not None:
        model.set_state_dict({n: paddle.to_tensor(v) for n, v in start.items()})
    opt = make_optimizer(model, model.parameters(), clip)
    named = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
    params = [p for _, p in named]
    anchor = [p.numpy().copy() for p in params]
    momentum = [np.zeros_like(a) for a in anchor]
    for k, s in enumerate(seeds):
        lm_loss(model, batch_ids(seed=s), True).backward()
        opt.step()
        opt.clear_grad()
        phase = (position + k + 1) % EVERY
        for i, (name, p) in enumerate(named):
            if phase == fragment.get(name, 0) * EVERY // count:
                delta = anchor[i] - p.numpy()
                momentum[i] = MOMENTUM * momentum[i] + delta
                anchor[i] = anchor[i] - LR * (delta + MOMENTUM * momentum[i])
                p.set_value(anchor[i])
    return {n: v.numpy() for n, v in model.state_dict().items()}


@pytest.mark.parametrize("clip", [None, CLIP])
def test_one_replica_is_inner_adamw_then_outer_nesterov(fake_mesh, float64, clip):
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM)
    model = shard_with(build_model(), outer_sync_policy=policy)
    opt = train(model, clip=clip)
    if clip:  # the replica's own norm (one replica: the whole model's), and it clipped
        assert paddle_hsdp.last_global_norm(opt) > CLIP
        assert opt._grad_clip.per_replica
    got, want = full(model), reference_one_replica(clip)
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-12, worst
    # the interval's position: 7 steps, syncs after 3 and 6, one step since
    assert model.embed._hsdp_unit_.outer_sync.steps == STEPS % EVERY
    # the check can fail: plain AdamW (no outer step) is far from it
    plain = build_model()
    train(plain)
    apart = max(float(np.abs(p.numpy() - want[n]).max()) for n, p in plain.state_dict().items())
    assert apart > 1e-3, apart


@pytest.mark.parametrize("fragments", [2, 3])
def test_fragments_sync_in_turn(fake_mesh, float64, fragments):
    """Streaming DiLoCo, one replica: the units dealt by size (models.fragment_of, the
    schedule written apart from the engine's), fragment f stepped by the outer
    optimizer after the steps where step % EVERY == f EVERY // F (F = 3: one fragment
    after every step), against the plain-Paddle reference."""
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM,
                                         fragments=fragments)
    model = shard_with(build_model(), outer_sync_policy=policy)
    train(model)
    by_name = fragment_of(model, fragments)
    assert set(by_name.values()) == set(range(fragments))  # every fragment has units
    got = full(model)
    want = reference_one_replica(fragments=(fragments, by_name))
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-12, worst
    # the check can fail: all units synced together (one fragment) is far from it
    together = reference_one_replica()
    apart = max(float(np.abs(together[n] - want[n]).max()) for n in want)
    assert apart > 1e-3, apart


def test_fragments_are_dealt_by_size():
    """``deal_fragments``: the largest unit first, each into the lightest fragment
    (ties: the earlier unit, the lower fragment). The two-host demo's model (three
    layers of 0.66M parameters, then the root's 2.05M) in two fragments: the root
    alone, where dealing by index (unit i in fragment i % F) put it with a layer (a
    peak of 0.67 of the model, not 0.51). On random sizes the largest fragment is
    within Graham's 4/3 of the best split (found by trying every one)."""
    layers_then_root = [660_000, 660_000, 660_000, 2_050_000]
    assert deal_fragments(layers_then_root, 2) == [1, 1, 1, 0]
    assert deal_fragments(layers_then_root, 4) == [1, 2, 3, 0]
    assert deal_fragments([5, 5, 5], 2) == [0, 1, 0]  # ties: by unit, then fragment
    assert deal_fragments([3, 1], 3) == [0, 1]  # fewer units than fragments
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 100, size=int(rng.integers(1, 7))).tolist()
        count = int(rng.integers(2, 4))
        dealt = deal_fragments(sizes, count)
        assert dealt == deal_fragments(list(sizes), count)  # deterministic
        peak = max(sum(s for s, f in zip(sizes, dealt) if f == g) for g in range(count))
        best = min(max(sum(s for s, f in zip(sizes, split) if f == g) for g in range(count))
                   for split in itertools.product(range(count), repeat=len(sizes)))
        assert best <= peak <= best * 4 / 3, (sizes, count, dealt, best)


def test_config_keys_make_the_policy():
    config = load_config({"fsdp_outer_sync_every": 16, "fsdp_outer_sync_fragments": 4,
                          "fsdp_outer_optimizer": {"lr": 0.5, "nesterov": False}})
    assert outer_sync_policy_of(config) == paddle_hsdp.OuterSyncPolicy(
        every=16, lr=0.5, momentum=0.9, nesterov=False, fragments=4)
    assert outer_sync_policy_of(load_config({})) is None  # every 1: plain HSDP
    for bad, says in (({"fsdp_outer_sync_every": 0}, "an int >= 1"),
                      ({"fsdp_outer_optimizer": {"lr": 0.5}}, "unused with"),
                      ({"fsdp_outer_sync_every": 4, "fsdp_outer_optimizer": {"lrr": 1}},
                       "unknown keys ['lrr']; allowed: lr, momentum, nesterov"),
                      ({"fsdp_outer_sync_every": 4, "fsdp_outer_optimizer": {"momentum": 1}},
                       "momentum"),
                      ({"fsdp_outer_sync_fragments": 2},
                       "fsdp_outer_sync_fragments: 2 needs fsdp_outer_sync_every >= 2"),
                      ({"fsdp_outer_sync_every": 4, "fsdp_outer_sync_fragments": 0},
                       "an int from 1 to fsdp_outer_sync_every"),
                      ({"fsdp_outer_sync_every": 4, "fsdp_outer_sharding": "optim"},
                       "conflicts with fsdp_outer_sharding: optim")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(bad)


def test_sharding_configs_keys_reach_fully_shard(fake_mesh, monkeypatch):
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"sharding_degree": 1, "sharding_configs": {
        "fsdp_outer_compress": "int8", "fsdp_outer_compress_block": 64,
        "fsdp_outer_sync_every": 8, "fsdp_outer_optimizer": {"lr": 0.5},
        "fsdp_outer_sync_fragments": 2}}
    mp, outer = strategy._hsdp_outer_policies
    assert (mp.outer_compress, mp.outer_compress_block) == ("int8", 64)
    assert outer == paddle_hsdp.OuterSyncPolicy(every=8, lr=0.5, fragments=2)
    # fully_shard on fleet's mesh takes them where its own arguments set none
    monkeypatch.setattr(fake_mesh, "outer_policies", lambda: (mp, outer), raising=False)
    model = paddle_hsdp.fully_shard(build_model())
    unit = model._hsdp_unit_
    assert unit.outer_sync.policy == outer and unit.buffers[0].pieces.compress == "int8"
    own = paddle_hsdp.OuterSyncPolicy(every=2)
    bf16 = paddle_hsdp.MixedPrecisionPolicy(reduce_dtype="float32")
    other = paddle_hsdp.fully_shard(build_model(), outer_sync_policy=own, mp_policy=bf16)
    assert other._hsdp_unit_.outer_sync.policy == own
    assert other._hsdp_unit_.policies.mp.outer_compress == "int8"
    with pytest.raises(ValueError, match=r"sharding_configs.*fsdp_outer_optimizer.*unused"):
        strategy.hybrid_configs = {"sharding_configs": {"fsdp_outer_optimizer": {"lr": 1.0}}}
    with pytest.raises(ValueError, match=re.escape("fragments=...) must be an int from 1 to "
                                                   "every (4;")):
        strategy.hybrid_configs = {"sharding_configs": {"fsdp_outer_sync_every": 4,
                                                        "fsdp_outer_sync_fragments": 5}}
    with pytest.raises(ValueError, match=r"sharding_configs.*outer_compress.*'int4'"):
        strategy.hybrid_configs = {"sharding_configs": {"fsdp_outer_compress": "int4"}}


@pytest.mark.parametrize("fragments", [1, 2])
def test_checkpoint_mid_interval_resumes_bit_for_bit(fake_mesh, float64, tmp_path, fragments):
    """Saved after 5 steps (a sync after 3, two steps into the next interval), loaded
    into a fresh model and optimizer, 4 more steps (a sync at 6): the same bits as 9
    steps at once (also streaming, two fragments: the position is every fragment's
    turn). Without the outer state (a fresh interval) it must differ."""
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM,
                                         fragments=fragments)

    def run(model, opt, steps):
        for s in steps:
            lm_loss(model, batch_ids(seed=s), True).backward()
            opt.step()
            opt.clear_grad()

    whole = shard_with(build_model(), outer_sync_policy=policy)
    opt = make_optimizer(whole, whole.parameters(), None)
    run(whole, opt, range(5))
    paddle_hsdp.save_checkpoint(tmp_path / "ckpt", whole, opt)
    run(whole, opt, range(5, 9))
    resumed = shard_with(build_model(seed=5), outer_sync_policy=policy)
    opt2 = make_optimizer(resumed, resumed.parameters(), None)
    paddle_hsdp.load_checkpoint(tmp_path / "ckpt", resumed, opt2)
    assert resumed.embed._hsdp_unit_.outer_sync.steps == 5 % EVERY
    run(resumed, opt2, range(5, 9))
    a, b = full(whole), full(resumed)
    assert all((a[n] == b[n]).all() for n in a)
    # the check can fail: a load that drops the outer state starts a fresh interval
    fresh = shard_with(build_model(seed=5), outer_sync_policy=policy)
    opt3 = make_optimizer(fresh, fresh.parameters(), None)
    paddle_hsdp.load_checkpoint(tmp_path / "ckpt", fresh, opt3)
    for unit in paddle_hsdp.engine.registry.registry.units_under(fresh):
        unit.outer_sync.steps, unit.outer_sync.anchors, unit.outer_sync.momentum = 0, {}, {}
    run(fresh, opt3, range(5, 9))
    c = full(fresh)
    assert any(not (a[n] == c[n]).all() for n in a)


def test_load_without_optimizer_moves_the_anchor(fake_mesh, float64, tmp_path):
    """``load_checkpoint(optimizer=None)`` mid-interval: the params change, so the
    anchor (the params at the last sync) must move with them, or the next sync's
    pseudo-gradient is the loaded params' distance from another run's. A model two
    steps into its interval loads another run's params, a fresh AdamW, then 4 steps
    (syncs after 1 and 4): one-process DiLoCo from the loaded params, position 2."""
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM)
    saved = shard_with(build_model(), outer_sync_policy=policy)
    train(saved, steps=4)
    paddle_hsdp.save_checkpoint(tmp_path / "ckpt", saved)
    start = full(saved)
    model = shard_with(build_model(seed=5), outer_sync_policy=policy)
    first = make_optimizer(model, model.parameters(), None)
    for s in (10, 11):  # its anchor: its own init; two steps into the interval
        lm_loss(model, batch_ids(seed=s), True).backward()
        first.step()
        first.clear_grad()
    paddle_hsdp.load_checkpoint(tmp_path / "ckpt", model)
    sync = model.embed._hsdp_unit_.outer_sync
    assert sync.steps == 2  # the position is optimizer state: kept
    opt = make_optimizer(model, model.parameters(), None)
    for s in range(4, 8):
        lm_loss(model, batch_ids(seed=s), True).backward()
        opt.step()
        opt.clear_grad()
    want = reference_one_replica(start=start, position=2, seeds=range(4, 8))
    got = full(model)
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-12, worst


def test_ft_sync_owed_runs_next_attempt_undone_on_failure(fake_mesh, float64):
    """Under paddle_hsdp.ft (engine/replication.py): the outer state whole on every
    group, and the sync a step comes to owed to the next attempt, which runs it
    before its forward; a failed attempt undoes it to the bit (shards, anchors,
    momentum) and the retry runs it again; committed, the run equals the one-process
    reference (one replica: the sync over the live groups is its own). A receiver
    of the outer state (as ft's transfer writes it) takes the anchor as its params and
    the position."""
    from paddle_hsdp.engine import replication
    policy = paddle_hsdp.OuterSyncPolicy(every=EVERY, lr=LR, momentum=MOMENTUM)
    model = shard_with(build_model(), outer_sync_policy=policy)
    replication.keep_outer_state_on_every_replica(model)
    opt = make_optimizer(model, model.parameters(), None)
    before = full(model)
    for s in range(STEPS):
        replication.run_owed_outer_syncs(model)
        if s == EVERY:  # the attempt that ran the sync fails, then is retried
            owed = full(model)
            replication.settle_outer_syncs(model, committed=False)
            back = full(model)
            assert all((back[n] == before[n]).all() for n in back)
            assert any((owed[n] != before[n]).any() for n in owed)  # it had synced
            replication.run_owed_outer_syncs(model)
        lm_loss(model, batch_ids(seed=s), True).backward()
        replication.settle_outer_syncs(model, committed=True)
        opt.step()
        opt.clear_grad()
        before = full(model)
    sync = model.embed._hsdp_unit_.outer_sync
    assert sync.owed is (STEPS % EVERY == 0)
    sync.owed = True  # a save after a step that comes to a sync would lose it
    with pytest.raises(ValueError, match="comes to an outer sync .* would lose it"):
        sync.gather_momentum(model.embed._hsdp_unit_)
    sync.owed = False
    want = reference_one_replica(seeds=range(STEPS))
    got = full(model)
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-12, worst
    # a rejoiner: its state tensors written with the donor's, then state_replaced
    joiner = shard_with(build_model(seed=5), outer_sync_policy=policy)
    replication.keep_outer_state_on_every_replica(joiner)
    for (name, mine), (_, theirs) in zip(replication.state_tensors(joiner),
                                         replication.state_tensors(model), strict=True):
        paddle.assign(theirs, output=mine)
    replication.state_replaced(joiner)
    taken, anchors = joiner.embed._hsdp_unit_.outer_sync, sync.anchors
    assert taken.steps == sync.steps and taken.owed == sync.owed
    for buf in joiner.embed._hsdp_unit_.buffers:
        if buf.trainable:
            assert (buf.storage.raw[:buf.shard_numel].numpy() ==
                    anchors[buf.index].numpy()).all()
