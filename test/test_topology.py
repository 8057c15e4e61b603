"""HSDP layout math (paddle_hsdp.topology): pure functions, no processes."""

import pytest
from paddle.distributed.fleet.base.topology import CommunicateTopology

from paddle_hsdp.topology import fleet as hsdp_fleet
from paddle_hsdp.topology.layout import RankGroups, plan_hsdp_layout, split_fsdp_group

NAMES = ["data", "pipe", "sharding", "sep", "model"]


def sharding_lists(dims):
    """Paddle's own sharding groups for hybrid degrees ``dims`` (order of NAMES)."""
    return CommunicateTopology(hybrid_group_names=NAMES, dims=dims).get_comm_list("sharding")


def assert_no_duplicates(layout):
    assert len(layout.creation_order) == len(set(layout.creation_order))


# ---------------------------------------------------------------- worked example, 16 ranks
DENSE_16 = [list(range(16))]


def test_split_fsdp_group_rows_are_inner_columns_are_outer():
    """[0..15] with outer 2 reshapes row-major: inner [0..7], [8..15]; outer [r, r+8]."""
    inner, outer = split_fsdp_group(range(16), 2)
    assert inner == [tuple(range(8)), tuple(range(8, 16))]
    assert outer == [(r, r + 8) for r in range(8)]


def test_dense_only_16_ranks():
    """Without EP, experts use the dense groups; each rank's groups follow the reshape."""
    layout = plan_hsdp_layout(DENSE_16, None, 2)
    for rank in range(16):
        expected = RankGroups(tuple(range(16)), tuple(range(8 * (rank // 8), 8 * (rank // 8) + 8)),
                              (rank % 8, rank % 8 + 8))
        assert layout.groups_of(rank, False) == expected
        assert layout.groups_of(rank, True) == expected
    assert layout.creation_order == ([tuple(range(8)), tuple(range(8, 16))]
                                     + [(r, r + 8) for r in range(8)])


def test_expert_ep2_16_ranks():
    """EP=2: moe_sharding [0,2,..,14] -> inner [0,2,4,6]/[8,..,14]; outer [r, r+8], shared."""
    evens, odds = list(range(0, 16, 2)), list(range(1, 16, 2))
    layout = plan_hsdp_layout(DENSE_16, [evens, odds], 2)
    inner_of = {}
    for members in ([0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]):
        inner_of.update({r: tuple(members) for r in members})
    for rank in range(16):
        g = layout.groups_of(rank, is_expert=True)
        assert g.fsdp == tuple(evens if rank % 2 == 0 else odds)
        assert g.inner == inner_of[rank]
        assert g.outer == (rank % 8, rank % 8 + 8)
        assert layout.groups_of(rank, False).outer == g.outer
    # Dense and expert outer groups with the same ranks are listed (created) once.
    for r in range(8):
        assert layout.creation_order.count((r, r + 8)) == 1
    assert_no_duplicates(layout)
    assert set(layout.creation_order) == ({tuple(range(8)), tuple(range(8, 16))}
                                          | set(inner_of.values())
                                          | {(r, r + 8) for r in range(8)})


def test_expert_ep8_16_ranks():
    """EP=8: moe_sharding [r, r+8] -> inner is one rank, outer [r, r+8] shared with dense."""
    layout = plan_hsdp_layout(DENSE_16, [[r, r + 8] for r in range(8)], 2)
    for rank in range(16):
        g = layout.groups_of(rank, is_expert=True)
        assert g == RankGroups((rank % 8, rank % 8 + 8), (rank,), (rank % 8, rank % 8 + 8))
        assert layout.groups_of(rank, False).outer == g.outer
    for r in range(8):
        assert layout.creation_order.count((r, r + 8)) == 1
    assert_no_duplicates(layout)


# ---------------------------------------------------------------- several sharding groups
@pytest.mark.parametrize("dims, fsdp_groups, inner, outer", [
    ([1, 1, 4, 1, 2], [[0, 2, 4, 6], [1, 3, 5, 7]],             # mp2 x sharding4
     [(0, 2), (4, 6), (1, 3), (5, 7)], [(0, 4), (2, 6), (1, 5), (3, 7)]),
    ([1, 2, 4, 1, 1], [[0, 1, 2, 3], [4, 5, 6, 7]],             # pp2 x sharding4
     [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2), (1, 3), (4, 6), (5, 7)]),
], ids=["mp2", "pp2"])
def test_several_sharding_groups(dims, fsdp_groups, inner, outer):
    """Paddle's sharding groups for mp2/pp2 split independently; no group is reused."""
    lists = sharding_lists(dims)
    assert lists == fsdp_groups
    layout = plan_hsdp_layout(lists, None, 2)
    assert sorted(layout.dense) == list(range(8))  # every rank exactly once
    for rank in range(8):
        g = layout.groups_of(rank)
        assert g.fsdp == tuple(next(f for f in fsdp_groups if rank in f))
        assert g.inner == next(i for i in inner if rank in i)
        assert g.outer == next(o for o in outer if rank in o)
    assert sorted(layout.creation_order) == sorted(inner + outer)
    assert_no_duplicates(layout)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("degree", [0, -1, 3, 2.0, True, "2"])
def test_invalid_outer_degree_message(degree):
    """A bad degree names the value, the FSDP group size and the valid choices."""
    with pytest.raises(ValueError) as err:
        split_fsdp_group(range(8), degree)
    msg = str(err.value)
    assert repr(degree) in msg or f"={degree}" in msg
    assert "size 8" in msg and "[1, 2, 4, 8]" in msg
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 8\]"):
        plan_hsdp_layout([list(range(8))], None, degree)


def test_expert_size_not_divisible():
    """The degree must divide the expert FSDP size too; choices are the common divisors."""
    with pytest.raises(ValueError) as err:
        plan_hsdp_layout([list(range(8))], [[0, 1, 2], [3, 4, 5]], 2)
    msg = str(err.value)
    assert "expert FSDP group size 3" in msg and "dense FSDP group size 8" in msg
    assert "[1]" in msg


@pytest.mark.parametrize("dense, expert", [
    ([[0, 1, 2, 3], [2, 3, 4, 5]], None),         # overlapping dense
    ([[0, 1, 2, 3], [4, 5]], None),               # unequal dense
    ([list(range(8))], [[0, 1], [1, 2]]),         # overlapping expert
    ([list(range(8))], [[0, 1, 2, 3], [4, 5]]),   # unequal expert
])
def test_fsdp_groups_must_partition_ranks(dense, expert):
    """FSDP groups of one kind must be disjoint and equal-sized."""
    with pytest.raises(ValueError, match="overlap|different sizes"):
        plan_hsdp_layout(dense, expert, 2)


def test_reduce_scatter_twins_follow_the_backend_unless_forced(monkeypatch):
    """Issue 24 item 6: on NCCL each inner group gets a twin for its reduce-scatters
    (its own communication stream); on gloo none, unless forced for the tests."""
    env = hsdp_fleet.SEPARATE_REDUCE_SCATTER_ENV
    monkeypatch.delenv(env, raising=False)
    assert hsdp_fleet.separate_reduce_scatter(on_gloo=False)
    assert not hsdp_fleet.separate_reduce_scatter(on_gloo=True)
    monkeypatch.setenv(env, "1")
    assert hsdp_fleet.separate_reduce_scatter(on_gloo=True)
    monkeypatch.setenv(env, "0")
    assert not hsdp_fleet.separate_reduce_scatter(on_gloo=False)
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        hsdp_fleet.separate_reduce_scatter(on_gloo=True)


def test_every_inner_row_gets_one_twin_in_one_order():
    # 8 ranks, EP 2: dense FSDP group of 8 (outer 2 x inner 4), expert groups of 4
    layout = plan_hsdp_layout([list(range(8))], [[0, 2, 4, 6], [1, 3, 5, 7]], 2)
    rows = hsdp_fleet.inner_rows(layout)
    dense = {layout.groups_of(r).inner for r in range(8)}
    expert = {layout.groups_of(r, True).inner for r in range(8)}
    assert set(rows) == dense | expert and len(rows) == len(set(rows))
    assert rows == hsdp_fleet.inner_rows(plan_hsdp_layout(
        [list(range(8))], [[0, 2, 4, 6], [1, 3, 5, 7]], 2))  # the same on every rank
