"""Issue 63, item 3: replica groups of different sizes (ft/degrees.py). The outer
all-reduce across sizes runs here on threads, one per rank, each outer group a barrier
that sums its members' slices (exact: the values are multiples of 1/8); the real gloo
run is workers/worker_outer_degrees.py in the shared 2 x 2 launch."""

import threading

import numpy as np
import pytest

from paddle_hsdp.ft.degrees import (OuterPlan, all_reduce_across_degrees, check_lines_up,
                                    describe_sizes, size_refusal, sizes_fit, transfer_cuts)


def test_sizes_that_divide_one_another_fit_and_others_do_not():
    assert sizes_fit([1, 2, 4, 8]) and sizes_fit({0: 2, 1: 2, 2: 1}) and sizes_fit([3, 6])
    assert not sizes_fit([2, 3]) and not sizes_fit([2, 4, 6]) and not sizes_fit([0, 2])
    with pytest.raises(ValueError, match="PADDLE_HSDP_FT group sizes must divide one "
                                         "another.*6 ranks: replica 0; 4 ranks: replica 1"):
        OuterPlan({0: 6, 1: 4})


def test_a_refusal_names_the_sizes_present_and_allowed():
    sizes = {0: 2, 1: 1, 2: 2}
    assert describe_sizes(sizes) == "2 ranks: replicas 0, 2; 1 rank: replica 1"
    # a job of 1,000 groups: a few named per size, the rest counted
    assert describe_sizes({**{r: 8 for r in range(999)}, 999: 4}) == \
        "8 ranks: replicas 0, 1, 2, 3 and 995 more; 4 ranks: replica 999"
    assert size_refusal(0, sizes, 2) is None
    text = size_refusal(1, sizes, 2)
    assert text.startswith("PADDLE_HSDP_FT group sizes present: 2 ranks: replicas 0, 2; "
                           "1 rank: replica 1; allowed: 2, the running groups' size"), text
    assert "not wired into the rounds yet" in text
    assert "3 and 2 do not divide one another" in size_refusal(1, {0: 2, 1: 3}, 2)


def test_each_outer_group_holds_one_rank_of_every_group_and_ranks_walk_up():
    plan = OuterPlan({0: 2, 1: 1, 2: 4})
    assert plan.largest == 4 and plan.divisor == 3
    assert [plan.members(j) for j in range(4)] == [
        [(0, 0), (1, 0), (2, 0)], [(0, 0), (1, 0), (2, 1)],
        [(0, 1), (1, 0), (2, 2)], [(0, 1), (1, 0), (2, 3)]]
    # the groups a rank creates: D / d of them, whatever the number of groups
    assert list(plan.groups_of(1, 0)) == [0, 1, 2, 3]
    assert list(plan.groups_of(0, 1)) == [2, 3] and list(plan.groups_of(2, 3)) == [3]
    assert plan.slice_of(0, 1, 3, 10) == (5, 10) and plan.slice_of(1, 0, 2, 8) == (4, 6)
    with pytest.raises(ValueError, match="outer groups \\[2, 3\\], not 0"):
        plan.slice_of(0, 1, 0, 10)
    with pytest.raises(ValueError, match="cannot be cut into the 4 slices"):
        plan.slice_of(1, 0, 0, 10)
    with pytest.raises(ValueError, match="replica 5 is not live"):
        plan.groups_of(5, 0)
    check_lines_up(plan, 8)
    with pytest.raises(ValueError, match="multiple of 4 segments, got 6"):
        check_lines_up(plan, 6)


def _threaded_all_reduce(plan: OuterPlan, shards: dict, timeout_s: float = 10.0,
                         walk=all_reduce_across_degrees) -> list:
    """Every rank's ``walk`` on a thread of its own; outer group ``j`` a barrier whose
    members post their slices and take the sum (a member that waits for a rank which
    never comes raises: the deadlock check). The errors the ranks raised."""
    posted = {j: {} for j in range(plan.largest)}
    barriers = {j: threading.Barrier(len(plan.members(j)), timeout=timeout_s)
                for j in range(plan.largest)}
    errors = []

    def rank(replica, local):
        def all_reduce(piece, j):
            posted[j][replica] = piece.copy()
            barriers[j].wait()  # every member posted
            total = sum(posted[j][r] for r, _ in plan.members(j))
            barriers[j].wait()  # every member read
            return total
        try:
            walk(shards[replica, local], plan, replica, local, all_reduce)
        except Exception as e:  # noqa: BLE001 - returned
            errors.append(e)
    threads = [threading.Thread(target=rank, args=key) for key in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout_s)
    assert not any(t.is_alive() for t in threads)
    return errors


@pytest.mark.parametrize("sizes", [{0: 2, 1: 2, 2: 1}, {0: 1, 1: 4, 2: 2, 3: 4}, {0: 1, 1: 1}])
def test_the_outer_all_reduce_across_sizes_is_every_groups_mean(sizes):
    """Each group holds its own full grad (one buffer laid out over D segments), cut
    among its ranks; after the walk and the divisor every rank holds the mean's rows."""
    plan = OuterPlan(sizes)
    full = 8 * plan.largest  # a multiple of D: the common layout's segments
    rng = np.random.default_rng(63)
    grads = {r: rng.integers(-64, 64, full) / 8.0 for r in sizes}
    shards = {(r, i): grads[r].reshape(d, -1)[i].copy() for r, d in sizes.items()
              for i in range(d)}
    assert _threaded_all_reduce(plan, shards) == []
    mean = sum(grads.values()) / plan.divisor
    for (r, i), shard in shards.items():
        np.testing.assert_array_equal(shard / plan.divisor, mean.reshape(sizes[r], -1)[i])


def test_ranks_that_walk_their_outer_groups_in_other_orders_deadlock():
    """Why every rank walks up: the 1-rank group walking down waits in outer group 3
    for rank 1 of the 2-rank group, which waits in group 2 for it."""
    plan = OuterPlan({0: 1, 1: 2, 2: 4})

    def down_for_replica_0(flat, plan, replica, local, all_reduce):
        order = plan.groups_of(replica, local)
        for j in (reversed(order) if replica == 0 else order):
            start, stop = plan.slice_of(replica, local, j, len(flat))
            flat[start:stop] = all_reduce(flat[start:stop], j)
    shards = {(0, 0): np.zeros(8), **{(1, i): np.zeros(4) for i in range(2)},
              **{(2, i): np.zeros(2) for i in range(4)}}
    errors = _threaded_all_reduce(plan, shards, 0.5, down_for_replica_0)
    assert errors and all(isinstance(e, threading.BrokenBarrierError) for e in errors)
    assert _threaded_all_reduce(plan, shards) == []


@pytest.mark.parametrize("donor,joiner", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2), (1, 8)])
def test_a_joiner_of_another_size_receives_exactly_its_rows(donor, joiner):
    segments, numel = 8, 3
    full = np.arange(segments * numel)
    donors = full.reshape(donor, -1)
    for rank in range(joiner):
        cuts = transfer_cuts(donor, joiner, rank, segments, numel)
        got = np.full(segments * numel // joiner, -1)
        for cut in cuts:
            got[cut.at:cut.at + cut.stop - cut.start] = donors[cut.donor_rank][cut.start:cut.stop]
        np.testing.assert_array_equal(got, full.reshape(joiner, -1)[rank])
        assert len(cuts) == max(1, donor // joiner)
    with pytest.raises(ValueError, match="joiner_size must divide segments=8, got 3"):
        transfer_cuts(2, 3, 0, 8, 1)


def test_a_buffer_laid_out_per_inner_degree_cuts_other_rows():
    """[Note: slices line up only on one layout]: the engine lays a group's buffers out
    over its own inner degree, and a 2-rank group's layout of these parameters is not a
    4-rank group's (the second starts one row later, the full buffers differ in size), so
    the slices would sum different rows: why a group of another size is still refused.
    Over one segment count (4) the layout is one, whichever group cuts it: the engine's
    layout degree (PADDLE_HSDP_FT_MAX_GROUP_SIZE) lays the 2-rank group's out so."""
    from paddle_hsdp.engine.layout import buffer_layout, segment_layout
    shapes = [[5, 6], [10, 3]]
    two, four = segment_layout(shapes, 2), segment_layout(shapes, 4)
    assert (two.offsets, two.total_numel) == ((0, 32), 64)
    assert (four.offsets, four.total_numel) == ((0, 33), 72)
    spread = buffer_layout(shapes, 2, degree=4)
    assert (spread.offsets, spread.total_numel, spread.segments) == ((0, 33), 72, 2)
    check_lines_up(OuterPlan({0: 2, 1: 4}), 4)
