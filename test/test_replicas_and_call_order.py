"""Every rank of a 2 x 2 HSDP job issues the same collectives, in the same order.

One process plays each rank of the job in turn: global ranks 0..3, dense inner groups
``[0, 1]``, ``[2, 3]`` (rows of ``[outer, inner]``) and outer groups ``[0, 2]``,
``[1, 3]`` (columns). The "moe" variant adds expert groups of their own, as
:func:`paddle_hsdp.topology.plan_hsdp_layout` plans them for EP 2 (expert FSDP groups
``[0, 2]``, ``[1, 3]``: one-rank expert inner groups, outer ``[0, 2]``, ``[1, 3]``).

For each simulated rank ``fully_shard`` gets a fake mesh whose groups carry that rank's
``rank``/``ranks``/``nranks``/``id``, and the collectives of :mod:`paddle_hsdp.comm` are
replaced by recorders that log ``(op, group ranks, numel, dtype, tag)`` and produce a
locally consistent fake result. Numerics are meaningless here; what is checked is the
contract a real job depends on to neither hang nor double-count:

1. outer replicas (outer rank != 0: ranks 2 and 3) mark every shard param
   ``is_firstly_shared=False`` (dense and expert buffers), the others do not;
2. every rank makes the same sequence of collectives (op, numel, dtype, group size),
   each in a group it belongs to and whose other members make the same call with the
   same group at the same position, including the clip's world all-reduce each step,
   although the data differ per rank: a parameter unused on ranks 1 and 3, an expert
   that gets tokens on ranks 0 and 3 only, and a one-row parameter whose shard on inner
   rank 1 is all padding;
3. per optimizer step: one outer all-reduce per trainable buffer, and one
   reduce-scatter per trainable buffer per micro-step; from step 2 on the outer
   all-reduces are issued during the step's last backward (engine/outer_sync.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import paddle
import paddle.nn as nn
import pytest
from paddle.distributed.communication.group import Group

import paddle_hsdp
from paddle_hsdp.comm import collectives as comm
from paddle_hsdp.engine import api
from paddle_hsdp.engine.context import context
from paddle_hsdp.engine.registry import registry as hsdp_registry
from paddle_hsdp.topology import layout as topology

from kit import PlainMeshParts

WORLD = 4
OUTER = 2
HIDDEN = 4
STEPS = 2
MICRO_STEPS = 2
FSDP_GROUPS = [[0, 1, 2, 3]]
LAYOUTS = {
    # experts use the dense groups
    "dense": lambda: topology.plan_hsdp_layout(FSDP_GROUPS, None, OUTER),
    # EP 2: experts shard in moe_sharding groups [0, 2], [1, 3] of their own
    "moe": lambda: topology.plan_hsdp_layout(FSDP_GROUPS, [[0, 2], [1, 3]], OUTER),
}
WORLD_GROUP_ID = 1000  # the fake global group the clip all-reduces over


# ---------------------------------------------------------------- rank-dependent data


def outer_rank(rank: int) -> int:
    return rank // (WORLD // OUTER)


def inner_rank(rank: int) -> int:
    return rank % (WORLD // OUTER)


def uses_extra(rank: int) -> bool:
    """``DenseBlock.extra`` is unused on ranks 1 and 3 (a data-dependent branch)."""
    return rank in (0, 2)


def expert_has_tokens(rank: int) -> bool:
    """The router sends tokens to the expert on ranks 0 and 3 only."""
    return rank in (0, 3)


# ---------------------------------------------------------------- the model


class DenseBlock(nn.Layer):
    """A linear layer, a one-row ``gate`` (with inner size 2, inner rank 1's shard of it
    is all padding) and ``extra``, a bias only some ranks use."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.gate = self.create_parameter([1, HIDDEN])
        self.extra = self.create_parameter([HIDDEN], is_bias=True)

    def forward(self, x, use_extra: bool):
        y = self.fc(x) * self.gate
        if use_extra:
            y = y + self.extra
        return x + paddle.tanh(y)


class MoEBlock(nn.Layer):
    """A dense router (its bias has one row) and one expert, flagged with
    ``mark_expert_params``, that only gets tokens on some ranks.

    ``expert_unit=False``: the expert shares the block's unit and is skipped where it
    has no tokens; the unit's expert buffer is gathered and reduced all the same.
    ``expert_unit=True``: the expert is a unit of its own, so it must be entered on
    every rank: with no tokens it runs on an empty batch (a rank that skipped it would
    skip its all-gathers, and a real job would hang).
    """

    def __init__(self, expert_unit: bool = False):
        super().__init__()
        self.expert_unit = expert_unit
        self.router = nn.Linear(HIDDEN, 1)
        self.expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(),
                                    nn.Linear(2 * HIDDEN, HIDDEN))
        paddle_hsdp.mark_expert_params(self.expert)

    def forward(self, x, has_tokens: bool):
        weight = paddle.nn.functional.sigmoid(self.router(x))  # the router reads x
        if has_tokens:
            return x + weight * self.expert(x)  # ... and so does the expert
        if self.expert_unit:
            return x * weight + self.expert(x[:0]).sum() * 0.0
        return x * weight


class ToyMoE(nn.Layer):
    """Two dense blocks, an MoE block, a head and a frozen offset (a non-trainable
    buffer in the root unit, which joins all-gathers but no gradient collective)."""

    def __init__(self, expert_unit: bool = False):
        super().__init__()
        self.offset = self.create_parameter([HIDDEN])
        self.offset.stop_gradient = True
        self.blocks = nn.LayerList([DenseBlock(), DenseBlock()])
        self.moe = MoEBlock(expert_unit)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x, rank: int):
        x = x + self.offset
        for block in self.blocks:
            x = block(x, uses_extra(rank))
        x = self.moe(x, expert_has_tokens(rank))
        return self.head(x)


def build_sharded_model(expert_unit: bool = False) -> ToyMoE:
    """The same initial model on every rank; one unit per block (and per expert with
    ``expert_unit``), then the root."""
    paddle.seed(2024)
    model = ToyMoE(expert_unit)
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    if expert_unit:
        paddle_hsdp.fully_shard(model.moe.expert)
    paddle_hsdp.fully_shard(model.moe)
    paddle_hsdp.fully_shard(model)
    return model


# ---------------------------------------------------------------- fake groups and mesh


class FakeMesh(PlainMeshParts):
    """What ``resolve_mesh`` returns for simulated ``rank``: the dense and expert
    inner/outer/FSDP groups of ``layout``, one :class:`Group` per member tuple (as
    ``fleet_ext`` builds them), with ``rank`` set to this rank's index in the group."""

    def __init__(self, rank: int, layout: topology.HSDPLayout):
        self.rank = rank
        self.layout = layout
        ids = {members: i for i, members in enumerate(layout.creation_order)}
        ids[tuple(range(WORLD))] = WORLD_GROUP_ID
        self._groups: dict[tuple, Group] = {}
        self._ids = ids
        self.world = self._group(tuple(range(WORLD)))

    def _group(self, members: tuple) -> Group:
        if members not in self._groups:
            self._groups[members] = Group(members.index(self.rank), self._ids[members],
                                          list(members), pg=None, name=f"fake{members}")
        return self._groups[members]

    def inner(self, is_expert=False):
        return self._group(self.layout.groups_of(self.rank, is_expert).inner)

    def outer(self, is_expert=False):
        return self._group(self.layout.groups_of(self.rank, is_expert).outer)

    def reduce_scatter_group(self, is_expert=False):
        return self.inner(is_expert)

    def fsdp_group(self, is_expert=False):
        return self._group(self.layout.groups_of(self.rank, is_expert).fsdp)

    def fsdp_size(self, is_expert=False):
        return WORLD


# ---------------------------------------------------------------- recording collectives


class Call(NamedTuple):
    op: str
    ranks: tuple
    numel: int  # of the full tensor the op is about (all-gather output, r-s input)
    dtype: str
    tag: str | None

    def signature(self) -> tuple:
        """What must agree across ranks: everything but the members themselves."""
        return (self.op, self.numel, self.dtype, len(self.ranks), self.tag)


class Recorder:
    """Stand-ins for the five collectives of ``comm``, for one simulated rank: each logs
    a :class:`Call` and fakes a result that has the right shape (numbers are
    meaningless: a tile, a slice times n, a product by n, a no-op)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls: list[Call] = []

    def _log(self, op, group, tensor, tag):
        ranks = tuple(group.ranks)
        assert self.rank in ranks, f"rank {self.rank} issued {op} in a group {ranks} it is not in"
        assert ranks[group.rank] == self.rank, f"group {ranks} has rank {group.rank} for {self.rank}"
        assert group.nranks == len(ranks)
        self.calls.append(Call(op, ranks, int(tensor.numel()), str(tensor.dtype), tag))

    def all_gather_into(self, out_flat, shard, group, async_op=False, tag=None, what=None,
                        counted_as="all_gather"):
        self._log("all_gather", group, out_flat, tag)
        assert int(out_flat.numel()) == group.nranks * int(shard.numel())
        tiled = paddle.tile(shard.reshape([-1]), [group.nranks])
        paddle.assign(tiled.reshape(out_flat.shape), output=out_flat)
        return comm._finish(comm.Handle(), async_op)

    def reduce_scatter(self, out_shard, in_flat, group, async_op=False, tag=None, what=None,
                       on_thread=False):
        self._log("reduce_scatter", group, in_flat, tag)
        assert int(in_flat.numel()) == group.nranks * int(out_shard.numel())
        mine = in_flat.reshape([group.nranks, -1])[group.rank] * group.nranks
        paddle.assign(mine.reshape(out_shard.shape), output=out_shard)
        return comm._finish(comm.Handle(), async_op)

    def all_reduce(self, tensor, group, async_op=False, tag=None, op="sum", what=None,
                   on_thread=False):
        self._log("all_reduce", group, tensor, tag)
        if tag == "grads present":
            # the max over the group, as a real job gets it: every parameter of this
            # model gets a grad on some rank (extra on 0 and 2, the expert on 0 and 3)
            paddle.assign(paddle.ones_like(tensor), output=tensor)
        else:
            paddle.assign(tensor * group.nranks, output=tensor)
        return comm._finish(comm.Handle(), async_op)

    def scatter(self, out, full, src, group, tag=None, what=None):
        self._log("scatter", group, out, tag)
        assert src == group.ranks[0], f"scatter from {src}, not inner rank 0 of {group.ranks}"
        assert (full is not None) == (self.rank == src), "the source alone passes the full"
        if full is not None:
            assert int(full.numel()) == group.nranks * int(out.numel())
            paddle.assign(full.reshape([group.nranks, -1])[group.rank], output=out)

    def broadcast(self, tensor, src, group, async_op=False, tag=None, what=None):
        self._log("broadcast", group, tensor, tag)
        assert src == group.ranks[0], f"broadcast from {src}, not outer rank 0 of {group.ranks}"
        return comm._finish(comm.Handle(), async_op)


# ---------------------------------------------------------------- one simulated rank


@dataclass
class RankTrace:
    """What one simulated rank did and ended with."""

    rank: int
    setup: list[Call]  # the collectives of the fully_shard calls
    steps: list[list[Call]]  # the collectives of each optimizer step (micro-steps + step)
    mesh: FakeMesh
    # "unit index:fqn" -> the shard's is_firstly_shared (None: absent)
    firstly_shared: dict[str, object] = field(default_factory=dict)
    expert_keys: set = field(default_factory=set)
    all_padding: set = field(default_factory=set)  # shards holding no row
    trainable_buffers: int = 0
    frozen_buffers: int = 0
    expert_buffers: int = 0
    buffer_inner_sizes: list[int] = field(default_factory=list)  # in sharding order

    @property
    def calls(self) -> list[Call]:
        return self.setup + [c for step in self.steps for c in step]


def _clear_engine_state() -> None:
    hsdp_registry.clear()
    context.backward.active.clear()
    context.backward.roots_in_backward.clear()


def simulate_rank(rank: int, layout: topology.HSDPLayout, expert_unit: bool = False
                  ) -> RankTrace:
    """Shard the model and train ``STEPS`` AdamW steps of ``MICRO_STEPS`` micro-steps
    (global-norm clip on) as simulated ``rank``, logging every collective."""
    _clear_engine_state()
    mesh, recorder = FakeMesh(rank, layout), Recorder(rank)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "resolve_mesh", lambda m: mesh)
        for op in ("all_gather_into", "reduce_scatter", "all_reduce", "broadcast", "scatter"):
            mp.setattr(comm, op, getattr(recorder, op))
        mp.setattr(paddle.distributed.collective, "_get_global_group", lambda: mesh.world)

        model = build_sharded_model(expert_unit)
        setup = list(recorder.calls)
        opt = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters(),
                                     grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
        rng = np.random.default_rng(rank)
        steps = []
        for _ in range(STEPS):
            start = len(recorder.calls)
            for _ in range(MICRO_STEPS):
                x = paddle.to_tensor(rng.standard_normal((3, HIDDEN)).astype("float32"))
                model(x, rank).mean().backward()
            opt.step()
            opt.clear_grad()
            steps.append(recorder.calls[start:])
        assert isinstance(opt._grad_clip, paddle_hsdp.HSDPClipGradByGlobalNorm)

    trace = RankTrace(rank, setup, steps, mesh)
    for unit in hsdp_registry.units:
        for buf in unit.buffers:
            trace.trainable_buffers += buf.trainable
            trace.frozen_buffers += not buf.trainable
            trace.expert_buffers += buf.is_expert
            trace.buffer_inner_sizes.append(buf.inner.nranks)
            for sp in buf.params:
                key = f"{unit.index}:{sp.fqn}"
                trace.firstly_shared[key] = getattr(sp.shard, "is_firstly_shared", None)
                if buf.is_expert:
                    trace.expert_keys.add(key)
                if sp.inner_numel == 0:
                    trace.all_padding.add(key)
    _clear_engine_state()
    return trace


def simulate_all_ranks(layout_name: str, expert_unit: bool = False) -> dict[int, RankTrace]:
    """Every simulated rank's trace for one layout; the engine's global registry is
    emptied for each rank and restored afterwards."""
    saved = hsdp_registry.saved()
    try:
        layout = LAYOUTS[layout_name]()
        return {rank: simulate_rank(rank, layout, expert_unit) for rank in range(WORLD)}
    finally:
        _clear_engine_state()
        hsdp_registry.restore(saved)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def traces(request) -> dict[int, RankTrace]:
    return simulate_all_ranks(request.param)


# ---------------------------------------------------------------- the checks


def test_layout_has_the_awkward_cases(traces):
    """Sanity of the setup: 4 units with 5 trainable buffers (2 dense blocks, router and
    expert, head), 1 frozen one, 1 expert one; the one-row params (each block's
    ``gate``, ``router.bias``) have a 0-row shard on one of the two inner ranks."""
    one_row = {"0:gate", "1:gate", "2:router.bias"}
    empty_on = {}
    for rank, trace in traces.items():
        assert (trace.trainable_buffers, trace.frozen_buffers, trace.expert_buffers) == (5, 1, 1)
        assert trace.expert_keys == {"2:expert.0.weight", "2:expert.0.bias",
                                     "2:expert.2.weight", "2:expert.2.bias"}
        for key in trace.all_padding:
            empty_on.setdefault(key, set()).add(inner_rank(rank))
    assert all(len(empty_on.get(key, ())) == 1 for key in one_row), empty_on


def test_only_outer_replicas_mark_shards_not_firstly_shared(traces):
    """Ranks 2 and 3 (outer rank 1) mark every shard param, dense and expert,
    ``is_firstly_shared=False``, so the global-norm clip skips them; on ranks 0 and 1
    the mark is absent or True."""
    for rank, trace in traces.items():
        assert trace.expert_keys and set(trace.firstly_shared) > trace.expert_keys
        if outer_rank(rank) != 0:
            wrong = {n: v for n, v in trace.firstly_shared.items() if v is not False}
        else:
            wrong = {n: v for n, v in trace.firstly_shared.items() if v not in (None, True)}
        assert not wrong, f"rank {rank} (outer rank {outer_rank(rank)}): {wrong}"


def test_every_rank_makes_the_same_collectives_in_the_same_order(traces):
    """Same (op, numel, dtype, group size, tag) sequence on every rank, however the data
    differ; at each position every peer in a rank's group calls with the same group
    (else a real job would hang or mix buffers); the clip all-reduces over the world
    once per step, last."""
    assert_same_collectives(traces)


def assert_same_collectives(traces: dict[int, RankTrace]) -> None:
    """The checks of the test above, for any set of traces."""
    reference = [c.signature() for c in traces[0].calls]
    for rank, trace in traces.items():
        assert [c.signature() for c in trace.calls] == reference, f"rank {rank} diverges"
        assert len(trace.steps) == STEPS
        for step in trace.steps:
            clip_calls = [c for c in step if c.tag == "clip"]
            assert clip_calls == [Call("all_reduce", tuple(range(WORLD)), 1, "paddle.float32",
                                       "clip")]
            assert step[-1] is clip_calls[0]
    for i in range(len(reference)):
        for rank, trace in traces.items():
            members = trace.calls[i].ranks
            for peer in members:
                assert traces[peer].calls[i].ranks == members, (
                    f"call {i} ({trace.calls[i].op}): rank {rank} uses group {members}, "
                    f"rank {peer} uses {traces[peer].calls[i].ranks}")


def test_outer_all_reduce_once_per_buffer_per_step_reduce_scatter_per_micro_step(traces):
    """Per optimizer step: one outer all-reduce per trainable buffer (4 dense in the dense
    outer group, 1 expert in the expert one), ``MICRO_STEPS`` reduce-scatters per
    trainable buffer in the matching inner groups, and no broadcast (fully_shard made
    one per buffer, frozen included) but the first backward's end, where every rank
    adopts the first FSDP rank's outer-sync order (one broadcast over the FSDP group)."""
    for rank, trace in traces.items():
        mesh = trace.mesh
        n_dense = trace.trainable_buffers - trace.expert_buffers
        # fully_shard: per buffer, its rows from the inner group's first rank (issue
        # 61's agreement), then the outer replicas from outer rank 0
        assert [c.op for c in trace.setup] == [
            op for inner in trace.buffer_inner_sizes
            for op in (["scatter"] if inner > 1 else []) + ["broadcast"]]
        assert len(trace.buffer_inner_sizes) == trace.trainable_buffers + trace.frozen_buffers
        inner_groups = {tuple(mesh.inner(e).ranks) for e in (False, True)}
        assert {c.ranks for c in trace.setup if c.op == "scatter"} <= inner_groups
        assert {c.tag for c in trace.setup if c.op == "scatter"} == {"agreement"}
        for step in trace.steps:
            outer = [c.ranks for c in step if c.op == "all_reduce" and c.tag is None]
            scatters = [c.ranks for c in step if c.op == "reduce_scatter"]
            assert len(outer) == trace.trainable_buffers, (rank, outer)
            assert len(scatters) == MICRO_STEPS * trace.trainable_buffers, (rank, scatters)
            assert Counter(outer) == _tally([(mesh.outer(False), n_dense),
                                             (mesh.outer(True), 1)]), rank
            assert Counter(scatters) == _tally([(mesh.inner(False), MICRO_STEPS * n_dense),
                                                (mesh.inner(True), MICRO_STEPS)]), rank
            broadcasts = [(c.ranks, c.tag) for c in step if c.op == "broadcast"]
            first = step is trace.steps[0]
            assert broadcasts == ([(tuple(mesh.fsdp_group(False).ranks), "outer sync order")]
                                  if first else []), (rank, broadcasts)


def test_the_grads_present_flags_go_over_the_inner_then_the_outer_group(traces):
    """Issue 51: which parameters got a grad is agreed over each FSDP group's inner,
    then its outer group (max of max), never in a communicator of the FSDP group's size
    (with pure HSDP on NCCL, the world)."""
    for rank, trace in traces.items():
        mesh = trace.mesh
        flags = [c.ranks for c in trace.calls if c.tag == "grads present"]
        assert flags, rank
        allowed = {tuple(g.ranks) for e in (False, True) for g in (mesh.inner(e), mesh.outer(e))
                   if g.nranks > 1}
        assert set(flags) <= allowed, (rank, flags, allowed)
        assert all(len(ranks) < len(mesh.fsdp_group(False).ranks) for ranks in flags), rank


def test_outer_all_reduce_of_the_steps_last_backward_is_issued_during_it(traces):
    """Step 1 has no count of its backwards yet: its outer all-reduces come after every
    reduce-scatter (at the step). Step 2's last micro-step is predicted (2 backwards,
    like step 1): buffers' outer all-reduces are issued as their reduce-scatters finish,
    so the first of them comes before that backward's last reduce-scatter, still one
    per buffer, every rank in the same order (the test above)."""
    for rank, trace in traces.items():
        for number, step in enumerate(trace.steps, start=1):
            outer = [i for i, c in enumerate(step) if c.op == "all_reduce" and c.tag is None]
            scatters = [i for i, c in enumerate(step) if c.op == "reduce_scatter"]
            assert len(outer) == trace.trainable_buffers, (rank, number)
            if number == 1:
                assert min(outer) > max(scatters), (rank, step)
            else:
                assert min(outer) < max(scatters), (rank, step)
                last_backward = scatters[len(scatters) // MICRO_STEPS:]
                assert min(outer) > min(last_backward), (rank, step)  # not micro-step 1


def _tally(groups_and_counts) -> Counter:
    """``Counter`` of member tuples: the same group listed twice adds up."""
    tally = Counter()
    for group, n in groups_and_counts:
        tally[tuple(group.ranks)] += n
    return tally


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_expert_as_its_own_unit_on_an_empty_batch(layout_name):
    """The expert as a unit of its own, entered on every rank (an empty batch where it
    has no tokens), after the router read the same input: training runs and every rank
    makes the same collectives, with the same per-step counts. (Regression: the unit
    hooks' identity PyLayers used to return their inputs, an in-place op to Paddle, so
    the router's saved x was "modified by an inplace operation" in backward.)"""
    traces = simulate_all_ranks(layout_name, expert_unit=True)
    assert_same_collectives(traces)
    for trace in traces.values():
        assert len(trace.steps) == STEPS and trace.trainable_buffers == 5
        for step in trace.steps:
            assert sum(c.op == "reduce_scatter" for c in step) == MICRO_STEPS * 5
            assert sum(c.op == "all_reduce" and c.tag is None for c in step) == 5
