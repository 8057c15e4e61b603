"""The HFSDP re-cut's assignment (ft/pieces.py: ``recut``, ``piece_copies``): which
pieces of the optimizer state each live group holds after a death or a rejoin, and
which copies that takes. Pure functions: no Paddle, no processes."""

import itertools
import random

import pytest

from paddle_hsdp.ft.pieces import piece_copies, recut


def _holders(members, extra, parts):
    """piece -> the members holding it (their own piece and their extra ones)."""
    held = {q: set() for q in range(parts)}
    for r in members:
        held[r % parts].add(r)
        for q in extra.get(r, ()):
            held[q].add(r)
    return held


def test_four_groups_at_redundancy_2_one_dies_its_piece_gets_a_second_holder():
    # pieces {0, 2} and {1, 3}; group 1 dies: piece 1 is left with group 3
    extra = recut([0, 2, 3], {}, parts=2, redundancy=2)
    # groups 0 and 2 are equally loaded (one piece each): the lower id takes piece 1
    assert extra == {0: {1}, 2: set(), 3: set()}
    assert _holders([0, 2, 3], extra, 2) == {0: {0, 2}, 1: {0, 3}}
    # group 0 takes piece 1 from its one valid holder, group 3
    assert piece_copies({0: [0], 2: [0], 3: [1]}, {0: [0, 1], 2: [0], 3: [1]}) == [(1, 3, 0)]


def test_a_former_co_holder_dies_next_and_no_piece_is_lost():
    extra = recut([0, 2, 3], {}, parts=2, redundancy=2)
    # group 3, piece 1's other holder before the re-cut, dies: group 0 holds piece 1
    after = recut([0, 2], extra, parts=2, redundancy=2)
    assert after == {0: {1}, 2: {1}}  # two groups left: each holds both pieces
    assert all(len(h) == 2 for h in _holders([0, 2], after, 2).values())
    assert piece_copies({0: [0, 1], 2: [0]}, {0: [0, 1], 2: [0, 1]}) == [(1, 0, 2)]


def test_the_least_loaded_group_takes_the_piece_whatever_its_id():
    # six groups, three pieces; group 0 already holds piece 1 besides its own
    members = [0, 2, 3, 4, 5]  # group 1 died: piece 1 is held by 4 and group 0's extra
    assert recut(members, {0: [1]}, parts=3, redundancy=2) == {
        0: {1}, 2: set(), 3: set(), 4: set(), 5: set()}
    # now 4 dies as well: piece 1 is left with group 0 alone; 0 holds two pieces, so
    # the least loaded lowest id without it, group 2, takes it
    assert recut([0, 2, 3, 5], {0: [1]}, parts=3, redundancy=2) == {
        0: {1}, 2: {1}, 3: set(), 5: set()}


def test_extra_holdings_are_dropped_once_a_holder_rejoins():
    extra = recut([0, 2, 3], {}, parts=2, redundancy=2)  # 0 holds piece 1 too
    # group 1 rejoins (fresh: it takes its own piece); piece 1 has three holders
    back = recut([0, 1, 2, 3], extra, parts=2, redundancy=2)
    assert back == {0: set(), 1: set(), 2: set(), 3: set()}
    # of two extra holders the more loaded one drops first, then the higher id
    assert recut([0, 1, 2, 3], {0: [1], 2: [1, 3]}, parts=4, redundancy=1) == {
        0: set(), 1: set(), 2: set(), 3: set()}
    # pieces 0..3 held by {0, 4}, {1}, {2, 6}, {3} plus extras 0: 1 and 2: 1; piece 1
    # has one holder too many: of 0 and 2 (two pieces each) the higher id drops it;
    # piece 3 is one short: the least loaded without it, lowest id first, is group 1
    assert recut([0, 1, 2, 3, 4, 6], {0: [1], 2: [1]}, parts=4, redundancy=2) == {
        0: {1}, 1: {3}, 2: set(), 3: set(), 4: set(), 6: set()}


def test_one_group_left_holds_every_piece():
    assert recut([5], {}, parts=4, redundancy=2) == {5: {0, 2, 3}}
    assert recut([], {}, parts=4, redundancy=2) == {}


def test_the_assignment_is_the_same_whatever_the_order_it_is_given_in():
    rng = random.Random(63)
    for _ in range(200):
        parts = rng.randint(1, 6)
        members = rng.sample(range(3 * parts), rng.randint(1, 3 * parts))
        extra = {r: rng.sample(range(parts), rng.randint(0, parts)) for r in members
                 if rng.random() < 0.5}
        expected = recut(members, extra, parts, 2)
        shuffled = dict(reversed(list(extra.items())))
        assert recut(list(reversed(members)), shuffled, parts, 2) == expected
        assert recut(set(members), {r: set(v) for r, v in extra.items()}, parts, 2) == expected


@pytest.mark.parametrize("groups,redundancy", [(4, 2), (6, 2), (6, 3), (9, 3), (16, 2)])
def test_every_piece_is_back_to_its_redundancy_after_each_death_and_rejoin(groups, redundancy):
    """A random life of a job: one group dies or one comes back per round. After each
    round's re-cut every piece has ``redundancy`` holders (every member when fewer are
    left), each member keeps its own piece, the copies come from valid holders only,
    and no member holds more than it must (at most one piece over the fair share)."""
    parts = groups // redundancy
    rng = random.Random(groups * 10 + redundancy)
    live, extra = list(range(groups)), {}
    for _ in range(60):
        dead = sorted(set(range(groups)) - set(live))
        if len(live) > 1 and (not dead or rng.random() < 0.5):
            live.remove(rng.choice(live))
        else:
            live.append(rng.choice(dead))  # a rejoin: fresh, no extra pieces
        valid = {r: [r % parts, *extra.get(r, ())] for r in live}
        if any(not any(q in v for v in valid.values()) for q in range(parts)):
            extra = {}  # a piece was lost (its holders died): the job restarts from a save
            continue
        new = recut(live, extra, parts, redundancy)
        target = min(redundancy, len(live))
        assert all(len(h) == target for h in _holders(live, new, parts).values())
        assert all(r % parts not in new[r] for r in live)
        held = {r: [r % parts, *new[r]] for r in live}
        fair = -(-parts * target // len(live))  # the holdings spread evenly, rounded up
        assert max(len(h) for h in held.values()) <= fair + 1
        for q, donor, taker in piece_copies(valid, held):
            assert q in valid[donor] and q not in valid[taker] and q in held[taker]
        extra = new


def test_with_redundancy_2_no_single_death_after_a_re_cut_loses_a_piece():
    """Two deaths one after the other (a round between them) lose nothing: after the
    first round's re-cut every piece has two holders again."""
    for first, second in itertools.permutations(range(4), 2):
        live = [r for r in range(4) if r != first]
        extra = recut(live, {}, parts=2, redundancy=2)
        live.remove(second)
        held = _holders(live, {r: extra[r] for r in live}, 2)
        assert all(held.values()), (first, second, held)


def test_a_piece_outside_the_cut_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"replica 3 says it holds pieces \[2\] .* "
                                         r"outside 0\.\.1"):
        recut([0, 3], {3: [2]}, parts=2, redundancy=2)


def test_copies_spread_takers_over_the_valid_holders():
    valid = {0: [0], 2: [0], 4: [0]}
    held = {0: [0], 1: [0], 2: [0], 3: [0], 4: [0], 5: [0]}
    assert piece_copies(valid, held) == [(0, 0, 1), (0, 2, 3), (0, 4, 5)]
    # a piece no member holds validly is left out (the caller calls it lost)
    assert piece_copies({0: [0]}, {0: [0, 1], 1: [1]}) == []


def test_a_copy_of_the_optimizer_over_another_piece_steps_it_as_its_holder_does():
    """engine/piece_optimizer.py: a group's optimizer copied over a second piece (no
    clip, its own state, the scheduler shared), loaded with a holder's state of that
    piece (its accumulators named otherwise by Paddle), steps the piece exactly as the
    holder's own optimizer does (float64), and its state reads as the holder's."""
    import numpy as np
    import paddle
    from paddle.base import framework
    from paddle.base.framework import EagerParamBase

    from paddle_hsdp.engine.piece_optimizer import _copy_over, load_renamed

    def param(name, value):
        p = EagerParamBase(shape=list(value.shape), dtype="float64", name=name,
                           trainable=True)
        p.set_value(value)
        return p

    def backward(p, grad):  # p's grad becomes ``grad``
        (p * paddle.to_tensor(grad)).sum().backward()

    def adamw(params, scheduler, clip):
        return paddle.optimizer.AdamW(scheduler, parameters=params, weight_decay=0.1,
                                      grad_clip=clip)

    rng = np.random.RandomState(63)
    grads = [rng.rand(3, 3) for t in range(5)]
    own_scheduler, holder_scheduler = (paddle.optimizer.lr.StepDecay(0.1, 2, 0.5)
                                       for _ in range(2))
    # this group's own piece (2 rows, clipped), and the other piece at its holder: the
    # copy does not clip (the HSDP clip scaled every piece's grads already)
    own_piece, holder_piece = param("recut_w", rng.rand(2, 3)), param("recut_w", rng.rand(3, 3))
    own = adamw([own_piece], own_scheduler, paddle.nn.ClipGradByGlobalNorm(1e-3))
    holder = adamw([holder_piece], holder_scheduler, None)
    for t in range(2):  # both train; then this group takes the holder's piece
        backward(holder_piece, grads[t]), backward(own_piece, grads[t][:2])
        holder.step(), own.step(), holder_scheduler.step(), own_scheduler.step()
        holder.clear_grad(), own.clear_grad()
    mine = param("recut_w", holder_piece.numpy())
    copy = _copy_over(own, [mine])
    copy._create_accumulators(framework.default_main_program().global_block(), [mine])
    assert sorted(copy.state_dict()) != sorted(holder.state_dict())  # Paddle's names
    load_renamed(copy, holder.state_dict())
    assert sorted(copy.state_dict()) == sorted(holder.state_dict())
    for t in range(2, 5):
        backward(holder_piece, grads[t]), backward(mine, grads[t])
        holder.step(), copy.step(), holder_scheduler.step(), own_scheduler.step()
        holder.clear_grad(), copy.clear_grad()
    np.testing.assert_array_equal(mine.numpy(), holder_piece.numpy())
    for key, value in holder.state_dict().items():
        if isinstance(value, paddle.Tensor):
            np.testing.assert_array_equal(copy.state_dict()[key].numpy(), value.numpy())
    assert own._grad_clip is not None and copy._grad_clip is None


def test_the_leader_logs_each_round_that_changes_who_holds_which_piece(caplog):
    """The done-when's "logged": one line per change of the holders, with the copies."""
    from paddle_hsdp.comm.traits import declare
    from paddle_hsdp.ft import replica
    from paddle_hsdp.ft.pieces import PiecePlan
    from paddle_hsdp.ft.protocol import Arrival, Round

    class Outer:  # a stand-in for the live outer group (traits attach to it)
        pass
    ft = object.__new__(replica.Replica)
    ft.outer, ft._logged_holding = Outer(), {}
    plan = PiecePlan(2, 0, lambda r: r)
    declare(ft.outer, pieces=plan)
    lines = []
    for number, members in ((3, {0: Arrival(2), 2: Arrival(2), 3: Arrival(2)}),
                            (4, {0: Arrival(3, extra=(1,)), 2: Arrival(3), 3: Arrival(3)})):
        record = Round(number, members, True, pieces=2)
        plan.arrange(record)
        with caplog.at_level("WARNING", logger="paddle_hsdp.ft"):
            ft._log_holders(record)
        lines = [r.getMessage() for r in caplog.records]
    assert lines == ["paddle_hsdp.ft: round 3: piece holders {0: [0, 2], 1: [0, 3]} "
                     "(copies: piece 1 3 -> 0)"], lines  # round 4 changed nothing


def test_a_group_that_cannot_step_a_second_piece_says_why():
    """ft's attach turns the re-cut off (warned) for these, where every round that
    re-cut would fail its set-up."""
    import paddle

    from paddle_hsdp.engine.replication import why_no_second_piece
    params = paddle.nn.Linear(3, 3).parameters()
    assert why_no_second_piece(paddle.optimizer.AdamW(0.1, parameters=params)) is None
    assert "master weights" in why_no_second_piece(
        paddle.optimizer.AdamW(0.1, parameters=params, multi_precision=True))
    assert "parameter groups" in why_no_second_piece(
        paddle.optimizer.AdamW(0.1, parameters=[{"params": params}]))
