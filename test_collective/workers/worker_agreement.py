"""Ranks that start from different weights (issue 61): fully_shard makes every rank of
each FSDP group take the first rank's parameters and buffers before cutting shards, so
training equals the one-process run started from rank 0's weights (float64, parity.py's
bound); with ``sync_module_states=False`` a difference is refused on every rank before
anything changes (the model stays usable), and equal weights pass with nothing but
fingerprints sent.

argv: JSON with the fleet layout (common.init_fleet) and ``outer_sharding`` per run
("none": HSDP, "optim": HFSDP), default ["none"].
"""

import numpy as np
from common import config_from_argv, finish, init_fleet, train_loop
from parity import set_dtype

import paddle
import paddle.distributed as dist

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry
from common import compare_with_reference
from models import HIDDEN, TinyLM, batches, lm_loss, make_optimizer, uses_extra

STEPS, MICRO, PER_RANK, CLIP = 3, 2, 2, 0.2
SOURCE_SEED = 2024  # rank 0's, the FSDP group's first rank

config = config_from_argv()
set_dtype("float64")
hcg = init_fleet(config)
rank, world = dist.get_rank(), dist.get_world_size()
inner, outer = hcg.get_fsdp_inner_group(), hcg.get_fsdp_outer_group()
data = batches(STEPS, MICRO, world, PER_RANK)


class BufferedLM(TinyLM):
    """TinyLM with a module buffer its forward reads (a per-channel scale), drawn at
    construction like the weights: it must agree too."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", paddle.rand([HIDDEN]).astype("float64") + 0.5)

    def forward(self, ids, use_extra, inputs_embeds=None):
        return super().forward(ids, use_extra, inputs_embeds) * self.scale.mean()


def build(seed: int) -> BufferedLM:
    paddle.seed(seed)
    return BufferedLM()


def reference():
    """One process, the whole batch, from rank 0's weights."""
    model = build(SOURCE_SEED)
    opt = make_optimizer(model, model.parameters(), CLIP)

    def micro_loss(micro, _):
        return sum(lm_loss(model, paddle.to_tensor(micro[r * PER_RANK:(r + 1) * PER_RANK]),
                           uses_extra(r)) for r in range(world)) / world

    losses = train_loop(opt, data, micro_loss)
    return losses, {n: p.numpy() for n, p in model.state_dict().items()}


def train(model):
    opt = make_optimizer(model, model.parameters(), CLIP)

    def micro_loss(micro, _):
        return lm_loss(model, paddle.to_tensor(micro[rank * PER_RANK:(rank + 1) * PER_RANK]),
                       uses_extra(rank))

    losses = train_loop(opt, data, micro_loss, processes=world)
    return losses, paddle_hsdp.full_state_dict(model)


def shard(model, **kwargs):
    for layer in [model.embed, *model.blocks]:
        paddle_hsdp.fully_shard(layer, **kwargs)
    return paddle_hsdp.fully_shard(model, **kwargs)


ref_losses, ref_params = reference()
shape = f"{outer.nranks}x{inner.nranks}"


def seeded_apart(outer_sharding: str) -> None:
    """Every rank builds from its own seed; the default sync makes rank 0's the model."""
    model = build(SOURCE_SEED + 1000 * rank)
    comm.counter.reset()
    shard(model, fsdp_outer_sharding=outer_sharding)
    moved = comm.counter.get("agreement", "scatter")
    sent = comm.counter.get("agreement", "broadcast")  # the module buffer: inner, outer
    buffers = [b for u in hsdp_registry.units_under(model) for b in u.buffers]
    scattered = [b for b in buffers if b.inner.nranks > 1]
    losses, full = train(model)
    worst = {}
    compare_with_reference(f"agreement {shape} {outer_sharding} seeded apart", full,
                           ref_params, losses, ref_losses, worst)
    # each rank received its own rows only: one scatter per inner-sharded buffer
    assert moved.calls == len(scattered), (moved, len(scattered))
    assert moved.payload_bytes == sum(b.shard_numel * 8 for b in scattered), moved
    assert sent.calls == 2 and sent.payload_bytes == 2 * HIDDEN * 8, sent
    print(f"AGREEMENT {shape} {outer_sharding}: seeded apart, max rel diff "
          f"{max(worst.values()):.2e}; scattered {moved.payload_bytes} bytes here",
          flush=True)
    paddle_hsdp.forget(model)


def refused_then_usable() -> None:
    """sync_module_states=False: equal weights but one parameter on the last rank; its
    unit's call refuses on every rank, naming it, and leaves the model as it was: the
    same model then shards with the default sync and trains as the reference."""
    model = build(SOURCE_SEED)
    target = model.blocks[1].fc1.weight
    if rank == world - 1:
        target.set_value(target.numpy() + 1.0)
    paddle_hsdp.fully_shard(model.embed, sync_module_states=False)
    paddle_hsdp.fully_shard(model.blocks[0], sync_module_states=False)
    units_before = len(hsdp_registry.units)
    try:
        paddle_hsdp.fully_shard(model.blocks[1], sync_module_states=False)
    except paddle_hsdp.ReplicaMismatchError as e:
        text = str(e)
        assert "'fc1.weight'" in text and f"rank {world - 1} hold" in text, text
        assert "Nothing was sharded" in text, text
    else:
        raise AssertionError("unequal weights were sharded with sync_module_states=False")
    assert len(hsdp_registry.units) == units_before  # nothing changed
    assert list(target.shape) == [HIDDEN, 3 * HIDDEN + 1] and target._is_initialized()
    paddle_hsdp.fully_shard(model.blocks[1])
    paddle_hsdp.fully_shard(model.blocks[2])
    paddle_hsdp.fully_shard(model)
    losses, full = train(model)
    worst = {}
    compare_with_reference(f"agreement {shape} refused then synced", full, ref_params,
                           losses, ref_losses, worst)
    print(f"AGREEMENT {shape}: refused on rank {rank}, then usable: max rel diff "
          f"{max(worst.values()):.2e}", flush=True)
    paddle_hsdp.forget(model)


def equal_unsynced() -> None:
    """sync_module_states=False on equal weights: no refusal, no weights sent (the
    fingerprints only), training equal to the reference."""
    model = build(SOURCE_SEED)
    comm.counter.reset()
    shard(model, sync_module_states=False)
    assert comm.counter.get("agreement", "scatter").calls == 0
    fingerprints = comm.counter.get("agreement", "broadcast")
    n_tensors = sum(len(u.params) for u in hsdp_registry.units_under(model)) + 1
    assert fingerprints.payload_bytes == 2 * 8 * n_tensors, fingerprints  # inner, outer
    losses, full = train(model)
    worst = {}
    compare_with_reference(f"agreement {shape} equal, unsynced", full, ref_params, losses,
                           ref_losses, worst)
    print(f"AGREEMENT {shape}: equal weights, no sync: max rel diff "
          f"{max(worst.values()):.2e}; {fingerprints.payload_bytes} fingerprint bytes",
          flush=True)
    paddle_hsdp.forget(model)


for outer_sharding in config.get("runs", ["none"]):
    seeded_apart(outer_sharding)
if config.get("refusal", True):
    refused_then_usable()
    equal_unsynced()
assert np.isfinite(ref_losses).all()
finish()
