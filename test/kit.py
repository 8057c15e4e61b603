"""The single-process tier's test kit: a one-rank fake mesh, the parity workers' TinyLM
sharded as they shard it, token batches, and a check that a refusal changed nothing.
Imported by test modules (``from kit import ...``; pytest.ini puts test/ on the path);
the fixtures that use it (``registry``, ``fake_mesh``, ``float64``) are in conftest.py."""

import numpy as np
import paddle
import pytest
from paddle.distributed.communication.group import Group

import models  # noqa: F401  (TinyLM, lm_loss, ...: test_collective/workers, on the path)
import paddle_hsdp
import parity  # noqa: F401  (the parity bounds, test_collective/workers/parity.py)
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine.registry import registry as hsdp_registry


def one_rank_group():
    return Group(0, -100, [0], pg=None, name="fake")


class PlainMeshParts:
    """What a fake mesh of neither tensor nor sequence parallelism answers alike: mp
    and sep rank 0, the clip over the whole (fake) job, no outer sharding."""

    def mp_rank(self):
        return 0

    def sep_rank(self):
        return 0

    def clip_group(self):
        """None: the clip all-reduces over the global group."""
        return None

    def outer_sharding(self):
        return "none"

    def outer_policies(self):
        return None, None

    def layout_degree(self, is_expert=False):
        """None: buffers laid out over the inner degree."""
        return None


class FakeMesh(PlainMeshParts):
    """What ``resolve_mesh`` returns, with one-rank groups: inner = outer = fsdp = {0}."""

    def __init__(self):
        self.group = one_rank_group()

    def inner(self, is_expert=False):
        return self.group

    def outer(self, is_expert=False):
        return self.group

    def reduce_scatter_group(self, is_expert=False):
        return self.group

    def fsdp_group(self, is_expert=False):
        return self.group

    def fsdp_size(self, is_expert=False):
        return 1


def two_linears():
    return paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 2))


def shard_tinylm(model, reshard_blocks=None):
    """The layout of the parity workers: embed and each block, then the root."""
    paddle_hsdp.fully_shard(model.embed)
    for block in model.blocks:
        paddle_hsdp.fully_shard(block, reshard_after_forward=reshard_blocks)
    paddle_hsdp.fully_shard(model)
    return model


def batch_ids(seed=7, rows=2):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.integers(0, models.VOCAB, size=(rows, models.SEQ + 1))
                            .astype("int64"))


def assert_raises_without_side_effects(exc, match, module, **kwargs):
    """``fully_shard(module, **kwargs)`` raises ``exc``; no collective, no new unit,
    the module's class is untouched."""
    units_before, cls_before = list(hsdp_registry.units), type(module)
    calls_before = comm.counter.snapshot()
    with pytest.raises(exc, match=match):
        paddle_hsdp.fully_shard(module, **kwargs)
    assert comm.counter.snapshot() == calls_before, "a collective ran before the check"
    assert hsdp_registry.units == units_before
    assert type(module) is cls_before


def reachable(transitions: dict, start) -> set:
    """Every state a transition table reaches from ``start`` (the ft machines' tables:
    no phase written in vain)."""
    reached, frontier = {start}, [start]
    while frontier:
        after = set(transitions[frontier.pop()]) - reached
        reached |= after
        frontier += after
    return reached
