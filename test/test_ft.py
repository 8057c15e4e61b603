"""paddle_hsdp.ft in one process: the round's record (who gives and who takes the
state), the live outer group, the transfer, joint saves, and the refusals (the round
protocol itself, against a real etcd: test_ft_protocol.py). The multi-process behaviour (a killed and a hung replica group, a rejoin,
parity with a single-process reference) is test_collective/test_fault_tolerance.py."""

import json
import os
import socket
import threading
import time
import types

import numpy as np
import paddle
import pytest
import kit

from paddle_hsdp.comm.traits import declare, traits_of
from paddle_hsdp.ft import groups, transfer
from paddle_hsdp.ft.protocol import Arrival, FaultToleranceError, Round


class MemoryStore:
    """The job's shared data (set, get, add) as ft.kv.JobStore has it, in memory and
    thread-safe."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()
        self.generation = 0

    def set(self, name, value, retry=True, lease=0):
        with self.lock:
            self.data[name] = value.encode() if isinstance(value, str) else value

    def get(self, name, timeout_s=None, abort=None):
        # as JobStore: TimeoutError after timeout_s (a test's own bound without one)
        deadline = time.monotonic() + (timeout_s or 5)
        while True:
            with self.lock:
                if name in self.data:
                    return self.data[name]
            if timeout_s is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"paddle_hsdp.ft: waited {timeout_s:g} s for {name}")
            assert time.monotonic() < deadline, f"get({name!r}) never answered"
            time.sleep(0.001)

    def lease(self, ttl_s):
        return 0  # nothing expires in memory

    def add(self, name, amount, retry=True, lease=0):
        with self.lock:
            value = int(self.data.get(name, b"0")) + amount
            self.data[name] = str(value).encode()
            return value


# ---------------------------------------------------------------- the record
def test_the_first_round_copies_the_lowest_replica_to_every_other():
    record = Round(0, {r: Arrival(0, fresh=True) for r in (2, 0, 1)}, rebuild=True)
    assert record.replicas == [0, 1, 2] and record.step == 0
    assert record.donor == 0 and record.receivers == [1, 2]


def test_a_replica_behind_or_fresh_takes_the_state_of_one_at_the_furthest_step():
    record = Round(5, {0: Arrival(7), 1: Arrival(6, failed=True), 2: Arrival(0, fresh=True),
                       3: Arrival(7)}, rebuild=True)
    assert record.step == 7 and record.donor == 0
    assert record.receivers == [1, 2]
    same = Round(6, {0: Arrival(7), 3: Arrival(7)}, rebuild=False)
    assert same.receivers == []


def test_a_record_survives_its_json():
    record = Round(3, {0: Arrival(4), 2: Arrival(0, fresh=True)}, rebuild=True, failures=2)
    assert Round.from_json(record.to_json()) == record


# ---------------------------------------------------------------- the protocol
def test_with_pieces_the_round_trains_the_furthest_step_every_piece_reached():
    # replica 0 (piece 0) committed step 8; its piece-mate 2 and the holder of piece 1
    # (replica 1) failed it: step 8 has no piece 1, so the round trains step 7 and
    # replica 0 is taken back to it
    members = {0: Arrival(8), 1: Arrival(7, failed=True), 2: Arrival(7, failed=True)}
    record = Round(4, members, True, pieces=2)
    assert record.step == 7 and record.donor == 1 and record.receivers == [0]
    assert Round(4, members, True).step == 8  # without pieces: the furthest
    assert Round.from_json(record.to_json()) == record
    from paddle_hsdp.ft.pieces import PiecePlan
    plan = PiecePlan(2, 0, lambda r: r)
    plan.arrange(record)
    assert plan.donor(0) == 2 and plan.holders == 2 and not plan.keeps(0)


def test_a_group_store_that_is_gone_is_an_error_not_a_wait():
    # Paddle's client would retry a refused connection for minutes
    from paddle_hsdp.comm.gloo_store import wait_until_listening
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"nothing listens at 127.0.0.1:{port}"):
            wait_until_listening("127.0.0.1", port, 0.3)
        assert time.monotonic() - started < 3
        sock.listen()
        wait_until_listening("127.0.0.1", port, 0.3)


# ---------------------------------------------------------------- the outer group
def test_the_live_outer_group_follows_the_rounds():
    group = groups.LiveOuterGroup(replica=2, local_rank=1, inner=4)
    assert group.ranks == [9] and group.nranks == 1 and group.rank == 0
    traits = traits_of(group)  # declared, not attributes of Paddle's Group
    assert traits.early_sync and traits.order_agreed_on_it and traits.watchdog_exempt
    assert traits.failure_advice.startswith("A replica group of this outer group died")
    group.adopt([0, 2, 3], ("pg", {}), 4)
    assert group.ranks == [1, 9, 13] and group.rank == 1 and group.replicas == [0, 2, 3]
    assert group.process_group == "pg"
    # a step a receiver sits out: its members' grads' divisor counts the others only,
    # what the engine's divisor reads (topology/mesh.py, engine/unit.py)
    from paddle_hsdp.comm.traits import contributing
    assert contributing(group) == 3
    declare(group, contributing=2)
    assert contributing(group) == 2 and traits_of(group).early_sync
    declare(group, contributing=None)
    assert contributing(group) == 3
    group.abandon()
    assert group.ranks == [9] and group.process_group is None
    assert group.broken == [("pg", groups.group_id(4, 1))]
    # the next rebuild keeps the groups of the round before it and destroys older ones
    group.adopt([2, 3], ("pg5", {}), 5)
    group.adopt([2, 3], ("pg6", {}), 6)
    assert group.retired == [("pg5", groups.group_id(5, 1))] and group.broken == []
    assert group.freed == 1 and group.process_group == "pg6"


def test_shutting_an_outer_group_down_ends_its_peers_reads():
    ours, theirs = socket.socketpair()
    try:
        group = groups.LiveOuterGroup(replica=0, local_rank=0, inner=1)
        group.adopt([0, 1], ("pg", {ours.fileno()}), 7)
        group.shut_down(6)  # a watcher's judgement of an earlier round: not this group's
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # still connected, nothing sent
        group.carry_into(8)  # a round that kept the group: the watcher judges round 8
        group.shut_down(8)
        theirs.settimeout(2)
        assert theirs.recv(1) == b""  # the peer sees the connection end at once
        assert ours.fileno() >= 0  # the descriptor itself stays open (gloo's)
    finally:
        ours.close()
        theirs.close()


def test_a_failure_cuts_short_the_creation_of_its_rounds_group():
    from paddle_hsdp.ft.store import socket_fds
    group = groups.LiveOuterGroup(replica=0, local_rank=0, inner=1)
    with group.creating(9, socket_fds()):
        ours, theirs = socket.socketpair()  # what the creation opened
        try:
            group.shut_down(8)  # another round's failure: left alone
            theirs.setblocking(False)
            with pytest.raises(BlockingIOError):
                theirs.recv(1)
            group.shut_down(9)  # gloo's rendezvous would wait for a peer that left
            theirs.settimeout(2)
            assert theirs.recv(1) == b""
        finally:
            ours.close()
            theirs.close()


# ---------------------------------------------------------------- state and refusals
def test_optimizer_state_flattens_to_tensors_and_back():
    a, b = paddle.ones([2]), paddle.zeros([3])
    state = {"w_moment1_0": a, "master_weights": {"w": b}, "LR_Scheduler": {"last_epoch": 3}}
    pairs, rest = transfer._flatten(state)
    assert [p for p, _ in pairs] == [("master_weights", "w"), ("w_moment1_0",)]
    assert rest == {"LR_Scheduler": {"last_epoch": 3}}
    back = transfer._unflatten(pairs, rest)
    assert back["master_weights"]["w"] is b and back["w_moment1_0"] is a
    # a transfer's checks: CRC-32 without the job's secret, a keyed digest with it that
    # another secret, another round or another place does not reproduce (empty: none);
    # one per block: a large tensor alone, a run of small ones together
    from paddle_hsdp.ft.trust import Signer
    plain, keyed = MemoryStore(), MemoryStore()
    plain.signer, keyed.signer = Signer(), Signer("a-job-secret-of-32-characters-ok")
    large = paddle.to_tensor(np.arange(transfer.THREAD_MIN_BYTES // 4, dtype="float32"))
    tensors = [paddle.to_tensor(np.arange(4.0)), paddle.zeros([0]), paddle.ones([3]), large,
               paddle.ones([2])]
    assert transfer._blocks(tensors) == 3
    # the bytes hashed, read in place: a tensor's, and a slice's (an offset view)
    for t in (large, large[5:9], paddle.ones([3], dtype="bfloat16")):
        assert bytes(transfer._bytes_of(t)) == t.numpy().tobytes()
    crcs = transfer._checksums(plain, 5, ("model",), tensors)
    assert len(crcs) == 3 and all(0 <= c < 2 ** 32 for c in crcs)
    sums = transfer._checksums(keyed, 5, ("model",), tensors)
    assert sums == transfer._checksums(keyed, 5, ("model",), tensors) and sums != crcs
    assert sums != transfer._checksums(keyed, 6, ("model",), tensors)
    # computed on the digest thread while tensors move: the same checks
    with transfer._Digests(keyed, 5, ("model",)) as digests:
        for tensor in tensors:
            digests.add(tensor)
        assert digests.result() == sums
    # a byte changed in a small tensor or the large one: that block's check differs
    for i in (2, 3):
        torn = [paddle.to_tensor(t.numpy().copy()) for t in tensors]
        torn[i][1] = 7.0
        got = transfer._checksums(keyed, 5, ("model",), torn)
        assert [a != b for a, b in zip(got, sums, strict=True)] == \
            [i == 2, i == 3, False]
    # bytes moved from one small tensor to the next (a torn boundary) do not match
    moved = [paddle.to_tensor(np.arange(3.0)), paddle.zeros([0]),
             paddle.to_tensor(np.array([3.0, 1.0, 1.0, 1.0])), large, paddle.ones([2])]
    assert transfer._checksums(keyed, 5, ("model",), moved)[0] != sums[0]
    keyed.signer = Signer("another-secret-of-the-same-size")
    assert sums != transfer._checksums(keyed, 5, ("model",), tensors)


def test_ft_init_refuses_a_fleet_outer_degree(monkeypatch):
    from paddle_hsdp.ft import replica
    hcg = types.SimpleNamespace(_hsdp_groups=types.SimpleNamespace(outer_degree=2))
    monkeypatch.setattr(replica.fleet, "get_hybrid_communicate_group", lambda: hcg)
    with pytest.raises(ValueError, match="fsdp_outer_degree'\\] must be 1"):
        replica.Replica(0, "127.0.0.1:1", 1, 1, 5.0, 3)


def test_ft_init_needs_a_replica_id(monkeypatch):
    from paddle_hsdp.ft import replica
    monkeypatch.delenv("PADDLE_HSDP_FT_REPLICA_ID", raising=False)
    with pytest.raises(ValueError, match="PADDLE_HSDP_FT_REPLICA_ID"):
        replica.init()
    monkeypatch.setenv("PADDLE_HSDP_FT_REPLICA_ID", "two")
    with pytest.raises(ValueError, match="integer >= 0"):
        replica.init()


def test_attach_refuses_unshared_outer_pieces_unsharded_buffers_and_compressed_diloco(
        monkeypatch):
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft.outer, ft.rank = object(), 1  # not the leader: it publishes no configuration
    buffers = [types.SimpleNamespace(outer=ft.outer, parts=2, shared_pieces=False,
                                     describe=lambda: "buffer 0",
                                     pieces=types.SimpleNamespace(compress=None))]
    unit = types.SimpleNamespace(buffers=buffers, outer_sync=None, label="unit 0")
    monkeypatch.setattr(replica.replication.registry, "units_under", lambda model: [unit])
    with pytest.raises(NotImplementedError, match="outer sub-shards of its own"):
        ft.attach(object(), object())
    buffers[0].shared_pieces = True  # cut by ft.init's plan: taken
    ft.attach(object(), object())
    # DiLoCo: taken, its outer state kept whole on every group (not 1/O)
    unit.outer_sync = types.SimpleNamespace(policy=types.SimpleNamespace(every=16),
                                            replicated=False)
    ft.attach(object(), object())
    assert unit.outer_sync.replicated
    # ... but not with a compressed reduce: its error feedback is each group's own
    buffers[0].pieces.compress = "int8"
    with pytest.raises(NotImplementedError, match="every 16 steps with a compressed reduce"
                                                  ".*fsdp_outer_compress: null"):
        ft.attach(object(), object())
    unit.outer_sync = None
    buffers[0] = types.SimpleNamespace(outer=object(), parts=1, describe=lambda: "buffer 0")
    with pytest.raises(NotImplementedError, match="not sharded over the inner group"):
        ft.attach(object(), object())


def test_hfsdp_needs_a_redundancy_of_two_or_more():
    from paddle_hsdp.ft.replica import _pieces_of
    assert _pieces_of("none", 4, 1) == 1  # HSDP: every replica holds everything
    assert _pieces_of("optim", 4, 2) == 2 and _pieces_of("optim", 5, 2) == 2
    assert _pieces_of("optim", 3, 2) == 1  # one piece, held by all: plain HSDP
    for bad in (1, 0, 5, "2"):
        with pytest.raises(ValueError, match="needs a redundancy .* from 2 to "
                                             "start_replicas=4, got"):
            _pieces_of("optim", 4, bad)


def _round(number, arrivals):
    return Round(number, {r: Arrival(*a) for r, a in arrivals.items()}, True)


def test_each_piece_is_served_by_its_lowest_valid_holder():
    from paddle_hsdp.ft.pieces import PiecePlan
    plan = PiecePlan(2, 3, lambda r: 10 * r)  # replica 3 holds piece 1
    assert (plan.parts, plan.part) == (2, 1)
    # the first round: every state fresh, each piece from its lowest holder
    first = _round(0, {r: (0, True) for r in range(4)})
    plan.arrange(first)
    assert [plan.donor(q) for q in (0, 1)] == [0, 1] and plan.src(1) == 10
    assert plan.receivers(first, 0) == [2] and plan.receivers(first, 1) == [3]
    assert plan.keeps(1) and not plan.keeps(0)
    # replica 0 (the model's donor) and 1 are gone; 3 was restarted (fresh)
    later = _round(5, {2: (7,), 3: (0, True)})
    with pytest.raises(FaultToleranceError, match="piece 1 of 2 .* has no live holder in "
                                                  "round 5: .*\[3\] hold it without a "
                                                  "valid copy"):
        plan.arrange(later)
    # with replica 1 alive, piece 1 comes from it, piece 0 from replica 2; 3 takes
    # piece 1 and does not keep its own (it is a receiver); piece 0, held by 2 alone,
    # is re-cut: replica 1 (as loaded as 3, the lower id) takes it besides its own
    later = _round(6, {1: (7,), 2: (7,), 3: (0, True)})
    plan.arrange(later)
    assert [plan.donor(q) for q in (0, 1)] == [2, 1] and later.donor == 1
    assert plan.receivers(later, 0) == [1] and plan.receivers(later, 1) == [3]
    assert plan.copies == [(0, 2, 1), (1, 1, 3)]
    assert plan.holding == {0: [1, 2], 1: [1, 3]} and plan.extra == frozenset()
    assert not plan.keeps(1)
    plan.committed()  # after a committed step, replica 3 keeps its own piece
    assert plan.keeps(1) and not plan.keeps(0) and plan.valid_extra() == ()


def test_each_piece_with_a_receiver_is_one_optimizer_copy():
    from paddle_hsdp.ft.pieces import PiecePlan
    record = _round(6, {0: (0, True), 1: (7,), 2: (7,), 3: (7,)})
    assert transfer._optimizer_phases(record, None) == [(0, 1, [0])]
    plan = PiecePlan(2, 1, lambda r: r)
    plan.arrange(record)
    assert transfer._optimizer_phases(record, plan) == [(0, 2, [0])]


def test_joiners_are_spread_over_donors_point_to_point_and_the_first_round_broadcasts():
    """A rejoin is fed point to point, each receiver by its own up-to-date member (the
    others start the step at once); where one member holds the state for all the rest
    (the first round) one broadcast over the outer group serves every receiver."""
    from paddle_hsdp.ft.pieces import PiecePlan
    Phase = transfer.Phase
    first = _round(0, {r: (0, True) for r in range(3)})
    assert transfer.plan_transfer(first, None) == (
        [Phase(("model",), 0, (1, 2)), Phase(("optimizer", 0), 0, (1, 2))], False)
    rejoin = _round(4, {0: (7,), 1: (7,), 2: (0, True), 3: (5,), 5: (7,)})
    assert rejoin.up_to_date == [0, 1, 5] and rejoin.receivers == [2, 3]
    assert [rejoin.donor_of(r) for r in (2, 3)] == [0, 1]
    phases, p2p = transfer.plan_transfer(rejoin, None)
    assert p2p and phases == [Phase(("model",), 0, (2,)), Phase(("model",), 1, (3,)),
                              Phase(("optimizer", 0), 0, (2,)), Phase(("optimizer", 0), 1, (3,))]
    assert transfer._pairs(phases) == [(0, 2), (1, 3)]
    # HFSDP: the model from the receiver's donor, its piece from the piece's holder
    plan = PiecePlan(2, 0, lambda r: r)
    hfsdp = _round(6, {0: (7,), 1: (7,), 2: (7,), 3: (0, True)})
    plan.arrange(hfsdp)
    phases, p2p = transfer.plan_transfer(hfsdp, plan)
    assert p2p and phases == [Phase(("model",), 0, (3,)), Phase(("optimizer", 1), 1, (3,))]
    assert transfer._pairs(phases) == [(0, 3), (1, 3)]
    # one up-to-date member, several receivers: nobody is left to go on, so broadcast
    lone = _round(8, {0: (7,), 1: (0, True), 2: (0, True)})
    assert transfer.plan_transfer(lone, None)[1] is False


def test_pair_group_ids_are_distinct_and_fit_a_c_int():
    ids = {groups.pair_id(n, lr, i) for n in (0, 1, groups.PAIR_ROUNDS - 1)
           for lr in (0, 1023) for i in range(groups.MAX_PAIRS)}
    assert len(ids) == 3 * 2 * groups.MAX_PAIRS and max(ids) < 2 ** 31
    assert not ids & {groups.group_id(n, lr) for n in range(3) for lr in (0, 1023)}
    with pytest.raises(ValueError, match="pair index 40"):
        groups.pair_id(0, 0, groups.MAX_PAIRS)
    # a resume's piece groups: above every pair's, distinct per round and local rank
    pieces = {groups.piece_group_id(n, lr) for n in (0, 1, groups.PIECE_ROUNDS - 1)
              for lr in (0, 1023)}
    assert len(pieces) == 6 and min(pieces) > max(groups.pair_id(
        groups.PAIR_ROUNDS - 1, 1023, groups.MAX_PAIRS - 1), max(ids)) and max(pieces) < 2 ** 31


def test_an_exempt_group_is_not_watched_and_others_are(monkeypatch):
    from paddle_hsdp.comm import collectives, watchdog
    watched = []
    real = watchdog.watched

    def spy(describe):
        watched.append(describe)
        return real(describe)
    monkeypatch.setattr(watchdog, "watched", spy)
    group = groups.LiveOuterGroup(replica=0, local_rank=0, inner=1)
    assert collectives._issue("all_reduce", group, None, lambda: "done") == "done"
    assert watched == []
    plain = types.SimpleNamespace(id=-5, ranks=[0, 1])
    assert collectives._issue("all_reduce", plain, None, lambda: "done") == "done"
    assert len(watched) == 1


def test_the_coordinator_refuses_a_bad_port():
    from paddle_hsdp.ft import coordinator
    with pytest.raises(SystemExit):
        coordinator.main(["--port", "70000"])


@pytest.mark.parametrize("raised", [ValueError("(InvalidArgument) TCP receive error ... "
                                               "Connection reset by peer"),
                                    RuntimeError("connect failed"), TimeoutError("late"),
                                    OSError("broken pipe")])
def test_a_death_during_a_rounds_set_up_is_a_failed_round_whatever_paddle_raises(
        monkeypatch, raised):
    """Issue 49: a donor that dies while its peers create the round's groups reached
    the survivors as a ValueError from ProcessGroupGloo.create, which the set-up did
    not catch: the rank died and its mate with it. Every error there is the round's
    failure (the next round goes on without the dead), caught at one place."""
    from paddle_hsdp.ft import replica

    def connect(*args, **kwargs):
        raise raised

    monkeypatch.setattr(replica.groups, "connect", connect)
    ft = object.__new__(replica.Replica)
    ft.rank, ft.store, ft.round_timeout_s, ft._handoff = 0, None, 1.0, None
    ft.outer = types.SimpleNamespace(adopt=lambda *args: None)
    record = types.SimpleNamespace(number=4, rebuild=True, replicas=[0, 1], receivers=[])
    error = ft._set_up_round(record, receiving=False)
    assert isinstance(error, replica.FaultToleranceError), error
    assert "round 4 set-up failed" in str(error) and type(raised).__name__ in str(error)


def test_unknown_ft_variables_are_named_with_the_closest_known_one():
    """A misspelt variable (PADDLE_HSDP_FT_START_REPLICA) was ignored in silence, so one
    group trained the whole job alone; ft.init warns with the name it meant."""
    from paddle_hsdp.ft import replica
    found = replica.unknown_env_names({"PADDLE_HSDP_FT_START_REPLICA": "3",
                                       "PADDLE_HSDP_FT_REPLICA_ID": "1", "OTHER": "x"})
    assert found == [("PADDLE_HSDP_FT_START_REPLICA",
                      "; did you mean 'PADDLE_HSDP_FT_START_REPLICAS'?")]


def test_the_largest_group_size_sets_the_layout_degree_or_is_refused_by_name():
    """Issue 63 item 3: PADDLE_HSDP_FT_MAX_GROUP_SIZE lays every group's buffers out as
    the largest group's (its inner degree scaled alike: with tensor parallelism a
    group's inner degree is a fraction of its ranks); unset, the group's own."""
    from paddle_hsdp.ft import replica
    assert replica.layout_degree_of(None, 2, 2) == 2
    assert replica.layout_degree_of(4, 2, 2) == 4 and replica.layout_degree_of(4, 1, 1) == 4
    assert replica.layout_degree_of(8, 4, 2) == 4  # (mp 2)
    for bad in (3, 1, 0, True, "4"):
        with pytest.raises(ValueError, match=r"max_group_size \(PADDLE_HSDP_FT_MAX_GROUP_SIZE\) "
                                             r"must be a multiple of this group's 2 ranks"):
            replica.layout_degree_of(bad, 2, 2)
    assert "PADDLE_HSDP_FT_MAX_GROUP_SIZE" in replica.KNOWN_ENV


def test_a_round_that_changes_who_trains_is_logged_with_who_left_and_who_joined(caplog):
    """Issue 49: the group that left was not named, nor where a rejoining group's state
    came from; the leader now logs both, once per round that changes them."""
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft._logged_replicas, ft._timing = [0, 1, 2], {"round_s": 0.1, "set_up_s": 1.2}
    with caplog.at_level("WARNING", logger="paddle_hsdp.ft"):
        ft._log_membership(Round(7, {0: Arrival(9), 1: Arrival(9)}, rebuild=True,
                                 left={2: "its heartbeats stopped (killed or hung)"}))
        ft._log_membership(Round(8, {0: Arrival(9), 1: Arrival(9)}, rebuild=False))
        ft._log_membership(Round(9, {0: Arrival(11), 1: Arrival(11), 2: Arrival(0, True)},
                                 rebuild=True))
        ft._log_membership(Round(10, {0: Arrival(12), 1: Arrival(12), 2: Arrival(12),
                                      3: Arrival(0, True)}, rebuild=True), [3])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # round 8 changed nothing
    assert "round 10: joined [3], replica(s) sit step 13 out, their state of its start " \
        "handed over beside it (3 from 0)" in lines[2], lines[2]
    assert Round.from_json(Round(7, {0: Arrival(9)}, True, left={2: "x"}).to_json()).left \
        == {2: "x"}
    assert "round 7: left [2] (2: its heartbeats stopped (killed or hung)); 2 replicas " \
        "[0, 1]" in lines[0], lines[0]
    assert "round 9: joined [2], replica(s) took the state of step 11 (2 from 0; " \
        in lines[1] and "set-up 1.20 s" in lines[1], lines[1]


def test_a_leader_hands_its_ranks_the_changes_since_their_last_round():
    """Replica._arrive: the leader publishes each round in the group's own store as the
    changes since the group's last round (a few hundred bytes at 64 groups, however
    many), every rank reads the same record, and a rank holding another round than its
    leader's is named as the bug it is."""
    from paddle_hsdp.ft import replica
    from paddle_hsdp.ft.protocol import ProtocolError
    store: dict[str, str] = {}
    watch = types.SimpleNamespace(armed=None, publish=store.__setitem__,
                                  read=lambda name, timeout_s, what: store[name])
    ids = range(64)
    rounds = iter([
        Round(0, {r: Arrival(0, True, config="c") for r in ids}, True, decider=0),
        Round(1, {r: Arrival(5, False, True, "c") for r in ids if r != 9}, True, 1,
              left={9: "its lease ended"}, decider=0),
        Round(2, {**{r: Arrival(6, config="c") for r in ids if r != 9},
                  9: Arrival(0, True, config="c")}, True, 1, decider=0),
        Round(3, {r: Arrival(7, config="c") for r in ids}, False, 1, decider=0)])

    def rank(number):
        ft = object.__new__(replica.Replica)
        ft.rank, ft.replica_id, ft._token, ft._arrivals, ft.round = number, 1, "t", 0, None
        ft._watch, ft.round_timeout_s = watch, 1.0
        ft._form_round = lambda: next(rounds)
        return ft
    leader, mate = rank(0), rank(1)
    for number in range(3):
        record = leader._arrive()
        assert mate._arrive() == record and record.number == number
        assert number == 0 or len(store[f"round/t/{number + 1}"]) < 300, store
    mate.round = Round(1, {}, True)  # not the leader's last round (a bug)
    leader._arrive()
    with pytest.raises(ProtocolError, match="holds another round than its leader: round 3"):
        mate._arrive()


def _replica_with_loader(monkeypatch, rounds):
    """A leader whose rounds are ``rounds`` (one per attempt: (receives, fails), or
    (receives, fails, up to date members: the receiver sits the step out)): each
    receiving round loads the donor's loader position 10; a failing attempt is retried.
    Returns the replica, the loader, and what forward_backward was given."""
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    loader = types.SimpleNamespace(position=0)

    def next_batch():
        loader.position += 1
        return loader.position - 1

    ft.model, ft.optimizer, ft.lr_scheduler = paddle.nn.Layer(), types.SimpleNamespace(
        step=lambda: None, clear_grad=lambda: None), None
    ft._state_fn = lambda: {"position": loader.position}
    ft._load_state_fn = lambda state: setattr(loader, "position", state["position"])
    ft.step, ft._loads, ft._failed, ft.fresh, ft.max_failed_attempts = 0, 0, False, True, 5
    ft._need_round, ft.replica_id, ft.rank, ft.control = True, 1, 0, None
    ft.store = types.SimpleNamespace(announce_failure=lambda number: None)
    ft._watch = types.SimpleNamespace(announce=lambda number: None)
    class Outer:  # a stand-in for the live outer group: hashable, so traits attach
        pieces = None

        @staticmethod
        def abandon():
            return None
    ft.outer, ft._resume_path, ft._handoff = Outer(), None, None
    ft._piece_optimizers = replica.replication.PieceOptimizers()
    plan = iter(rounds)
    sent = []

    def arrive():
        receives, fails, *up_to_date = next(plan)
        ft._fails, ft._ran = fails, False
        return types.SimpleNamespace(number=0, receivers=[1] if receives else [],
                                     up_to_date=up_to_date[0] if up_to_date else [],
                                     replicas=[0, 1], to_json=lambda: "{}", rebuild=True)

    def set_up(record, receiving, sitting_out=()):
        sent.append(ft._plain_state()["user"])  # what this group would send as donor
        if receiving:
            ft._load_plain_state({"step": 10, "rng": [s.__getstate__() for s in
                                                       paddle.get_rng_state()],
                                  "lr_scheduler": None, "user": {"position": 10}})

    ft._arrive, ft._set_up_round = arrive, set_up
    ft._replica_votes = lambda failed, join: (failed or (ft._fails and ft._ran), False)
    ft._joiners_waiting = lambda: False
    ft._log = lambda *args, **kwargs: None
    monkeypatch.setattr(replica.replication, "finish_grad_sync", lambda opt: None)
    seen = []

    def forward_backward(batch):
        seen.append(batch)
        ft._ran = True
        ft._need_round = True  # every attempt of this test starts with a round
        return paddle.to_tensor(0.0)

    return ft, loader, seen, forward_backward, next_batch, sent


def test_a_rejoining_group_fetches_its_batch_after_the_donors_position_is_loaded(
        monkeypatch):
    """Issue 49: a batch fetched before train_step, on a step whose round loads the
    donor's loader position, was the group's stale one (params 15% off, silently).
    train_step fetches it through next_batch once the round has loaded the state,
    again if a retried attempt's round loads state anew, and not on a plain retry."""
    ft, loader, seen, fb, next_batch, sent = _replica_with_loader(
        monkeypatch, [(True, False), (False, False)])
    ft.train_step(fb, next_batch=next_batch)
    assert seen == [10] and ft.step == 11 and loader.position == 11
    ft.train_step(fb, next_batch=next_batch)
    assert seen == [10, 11] and loader.position == ft.step == 12
    # a failed attempt, then a round that loads state: the batch is fetched again
    ft, loader, seen, fb, next_batch, sent = _replica_with_loader(
        monkeypatch, [(False, True), (True, False)])
    ft.train_step(fb, next_batch=next_batch)
    assert seen == [0, 10] and loader.position == ft.step == 11
    # a failed attempt retried without a load: the same batch, fetched once; and what
    # the group would send as a donor is its position before this step's batch
    ft, loader, seen, fb, next_batch, sent = _replica_with_loader(
        monkeypatch, [(False, True), (False, False)])
    ft.train_step(fb, next_batch=next_batch)
    assert seen == [0, 0] and loader.position == ft.step == 1
    assert sent == [{"position": 0}, {"position": 0}]


def test_a_steps_attempts_move_through_their_phases_in_order(monkeypatch):
    """Issue 68: train_step's attempts are a machine (ft/replica.py ``_Step``): a round's
    attempt sets up, runs, votes and commits; one a mate failed retries from a new round;
    one this rank failed announces it before the vote; a move the table lacks is refused,
    and every phase lies on a way from the first to the step's end."""
    from paddle_hsdp.ft import replica
    from paddle_hsdp.ft.protocol import ProtocolError
    P, moves, move = replica.StepPhase, [], replica._Step._move

    def recording(step, to):
        moves.append(to)
        move(step, to)
    monkeypatch.setattr(replica._Step, "_move", recording)
    ft, _, _, fb, next_batch, _ = _replica_with_loader(monkeypatch, [(False, True),
                                                                    (False, False)])
    ft.train_step(fb, next_batch=next_batch)
    attempt = [P.SETTING_UP, P.RUNNING, P.VOTING]
    assert moves == [*attempt, P.RETRYING, P.ARRIVING, *attempt, P.COMMITTING, P.DONE]
    ft, _, _, fb, next_batch, _ = _replica_with_loader(monkeypatch, [(False, False)] * 2)
    raised = iter([FaultToleranceError("a collective failed")])

    def failing_once(batch):
        error = next(raised, None)
        if error is not None:
            raise error
        return fb(batch)
    moves.clear()
    ft.train_step(failing_once, next_batch=next_batch)
    assert moves == [P.SETTING_UP, P.RUNNING, P.ANNOUNCING, P.VOTING, P.RETRYING,
                     P.ARRIVING, *attempt, P.COMMITTING, P.DONE]
    done = object.__new__(replica._Step)
    done.phase = P.DONE
    with pytest.raises(ProtocolError, match="from 'done' to 'arriving'"):
        move(done, P.ARRIVING)
    assert kit.reachable(replica.STEP_TRANSITIONS, P.ARRIVING) == set(P)
    assert set(replica.STEP_TRANSITIONS) == set(P)


def test_a_receiver_sits_its_rounds_step_out_and_trains_the_next_in_the_same_call(
        monkeypatch):
    """Issue 63 item 4: where some member is up to date, a receiver sits the round's step
    out (its grads withheld, out of the divisor) on its own stale state and batch (its
    set-up waits for nothing of the donor's), takes the handed-over state and the
    donor's plain state as its backward left it (the loader past the step's batch) once
    the step's all-reduce is through, commits that step with the others and trains the
    next within the same train_step, on the batch after the donor's; a failed handoff
    fails the attempt, and the next round's step is sat out again."""
    from paddle_hsdp.ft import handoff, replica
    P, moves, move = replica.StepPhase, [], replica._Step._move

    def recording(step, to):
        moves.append(to)
        move(step, to)
    monkeypatch.setattr(replica._Step, "_move", recording)
    ft, loader, seen, fb, next_batch, _ = _replica_with_loader(
        monkeypatch, [(True, False, [0]), (True, False, [0])])
    withheld, taken, divisors = [], [], []
    monkeypatch.setattr(replica.replication, "withhold_grads",
                        lambda model: withheld.append(ft.step))
    handoffs = iter([FaultToleranceError("the donor's stream ended"), None])

    class Handed(handoff.Receipt):  # the donor's state, taken after the step (or not)
        def __init__(self):
            self.extra = None

        def install(self, model, optimizer, abort=None):
            taken.append(ft.step)
            error = next(handoffs)
            if error is not None:
                raise error
            self.extra = {"step": 10, "rng": [s.__getstate__() for s in
                                              paddle.get_rng_state()],
                          "lr_scheduler": None, "user": {"position": 11}}
            return 0

        def close(self):
            pass

    def set_up(record, receiving, sitting_out=()):
        assert receiving and sitting_out
        ft._handoff = Handed()

    def counted(batch):  # the members whose grads the step's divisor counts
        divisors.append(traits_of(ft.outer).contributing)
        return fb(batch)
    ft._set_up_round = set_up
    ft.train_step(counted, next_batch=next_batch)
    attempt = [P.SETTING_UP, P.RUNNING]
    assert moves == [*attempt, P.ANNOUNCING, P.VOTING, P.RETRYING, P.ARRIVING,
                     *attempt, P.VOTING, P.COMMITTING, P.ARRIVING, P.RUNNING, P.VOTING,
                     P.COMMITTING, P.DONE], moves
    # sat out twice (the first handoff failed) on its own stale step 0 and batch 0,
    # then the donor's step 10 committed; then step 12 on the donor's next batch
    assert withheld == [0, 0] and taken == [0, 0], (withheld, taken)
    assert divisors == [1, 1, None], divisors
    assert seen == [0, 0, 11] and loader.position == ft.step == 12
    assert ft.fresh is False


def test_a_donor_hands_over_its_plain_state_as_its_backward_left_it(monkeypatch):
    """The donor of a receiver sitting the step out hands over, after its forward and
    backward, its step and its loader past the step's batch (what the receiver's next
    step goes on from), once: its later steps' are not sent."""
    import json

    from paddle_hsdp.ft import handoff, replica
    ft, loader, seen, fb, next_batch, _ = _replica_with_loader(
        monkeypatch, [(False, False, [0, 1])] * 2)

    class Donated(handoff.Donation):  # what the donor's thread would send
        def __init__(self):
            self._plain, self._stepped = None, threading.Event()

    donation = Donated()

    def set_up(record, receiving, sitting_out=()):
        if ft._handoff is None:
            ft._handoff = donation
    ft._set_up_round = set_up
    monkeypatch.setattr(replica.replication, "withhold_grads", lambda model: None)
    ft.train_step(fb, next_batch=next_batch)
    ft.train_step(fb, next_batch=next_batch)
    plain = json.loads(donation._plain)
    assert (plain["step"], plain["user"]) == (0, {"position": 1}), plain
    assert seen == [0, 1] and ft.step == 2


def test_attached_user_state_needs_next_batch_and_both_callables():
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft.model, ft._load_state_fn = object(), lambda state: None
    with pytest.raises(ValueError, match="pass next_batch="):
        ft.train_step(lambda: None)
    with pytest.raises(ValueError, match="state_dict and load_state_dict together"):
        ft.attach(object(), object(), state_dict=lambda: {})


def _joint(store, replica_id, replicas, pieces=None, step=7):
    from paddle_hsdp.ft.joint_save import JointSave
    from paddle_hsdp.ft.pieces import PiecePlan
    class Outer:  # a stand-in for the live outer group: hashable, so traits attach
        @staticmethod
        def virtual_rank(r):
            return 2 * r + 1
    outer = Outer()
    if pieces:
        declare(outer, pieces=PiecePlan(pieces, replica_id, outer.virtual_rank))
    replica = types.SimpleNamespace(
        round=types.SimpleNamespace(number=3, replicas=replicas), step=step, store=store,
        replica_id=replica_id, outer=outer, ranks_per_replica=2, round_timeout_s=0.3)
    return JointSave(replica)


def test_the_live_groups_split_a_joint_checkpoint_by_piece_and_one_publishes():
    """Issue 49: in an HFSDP fault-tolerant job each group holds one piece of the
    optimizer state, so a save inside one group could never tile a tensor. Every box
    has one writing group, chosen from the shared round (the lowest live holder); the
    lowest live group publishes once every group's record is in (whatever order they
    come in), the others hear its outcome, and a group that never comes fails the save
    on the others within the round timeout."""
    store = MemoryStore()
    live = [1, 2, 3]  # replica 0 is gone: piece 0 is left to replica 2
    joints = {r: _joint(store, r, live, pieces=2) for r in live}
    assert [r for r in live if joints[r].writes(None)] == [1]
    assert [r for r in live if joints[r].writes(0)] == [2]
    assert [r for r in live if joints[r].writes(1)] == [1]
    assert joints[3].file_rank() == 7 and joints[1].world_size == 6
    assert len({j.begin("/ckpt") for j in joints.values()}) == 1
    assert joints[2].gather({"g": 2}) is None
    assert joints[3].gather({"g": 3}) is None
    assert joints[1].gather({"g": 1}) == [{"g": 1}, {"g": 2}, {"g": 3}]
    joints[1].announce("")
    assert joints[1].outcome() == "" and joints[3].outcome() == ""
    # the same path saved again at the same step (a retry, a final save): new keys, so
    # the first save's payloads and outcome are not taken for the second's, and one
    # group publishes
    tokens = {j.begin("/ckpt") for j in joints.values()}
    assert len(tokens) == 1 and "c2-" in tokens.pop()  # the second call
    publishing = threading.Thread(target=lambda: published.append(
        joints[1].gather({"g": 1, "v": 2})))
    published: list = []
    publishing.start()  # the publisher waits for the records still to come
    assert joints[3].gather({"g": 3, "v": 2}) is None
    assert joints[2].gather({"g": 2, "v": 2}) is None
    publishing.join(5)
    assert published == [[{"g": 1, "v": 2}, {"g": 2, "v": 2}, {"g": 3, "v": 2}]]
    # HSDP: the lowest live group writes everything
    assert _joint(store, 1, live).writes(None) and not _joint(store, 2, live).writes(None)
    # a group that died before its part: the others' save fails, naming the live ones
    store = MemoryStore()
    lonely = _joint(store, 2, live)
    lonely.begin("/ckpt")
    assert lonely.gather({}) is None
    assert "replicas [1, 2, 3] were live" in lonely.outcome()
    publisher = _joint(store, 1, live)  # the publisher waits a round timeout, then says
    publisher.begin("/ckpt")  # whose record it waited for
    with pytest.raises(TimeoutError, match="save/.*/group/3"):  # (2 wrote its own)
        publisher.gather({})
    watcher = _joint(store, 3, live)
    watcher.begin("/ckpt")
    assert "waited for every group's record" in watcher.outcome()
    with pytest.raises(RuntimeError, match="after a committed train_step"):
        _joint(store, 1, live, step=0).begin("/ckpt")


def test_nothing_read_from_the_network_is_unpickled():
    """Issue 50 (item 3): a rejoin's metadata crossed the coordinator's unauthenticated
    store as a pickle, so a writer to its port could run code in every trainer. No
    module of the package unpickles anything now."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "paddle_hsdp"
    offenders = [f"{path.relative_to(root)}:{i}" for path in sorted(root.rglob("*.py"))
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if "pickle.load" in line or "import pickle" in line
                 or "Unpickler" in line]
    assert not offenders, offenders


def test_a_donors_rng_state_and_user_state_travel_as_json():
    from paddle_hsdp.ft import replica
    paddle.seed(7)
    saved = json.loads(json.dumps([s.__getstate__() for s in paddle.get_rng_state()]))
    first = paddle.rand([3]).numpy()
    paddle.set_rng_state([replica._generator_state(s) for s in saved])
    assert (paddle.rand([3]).numpy() == first).all()  # the same draws after the load
    assert replica._user_json({"position": 3}) == '{"position": 3}'
    with pytest.raises(ValueError, match="state_dict\\(\\) must return JSON-serialisable"):
        replica._user_json({"loader": object()})


def test_a_schedulers_numpy_scalars_cross_as_json_and_anything_else_is_named():
    store = MemoryStore()
    record = types.SimpleNamespace(number=2)
    sent = transfer._exchange_meta(store, record, ("x",), True,
                                   lambda: {"last_lr": np.float32(0.5), "step": np.int64(3)})
    got = transfer._exchange_meta(store, record, ("x",), False, None)
    assert got == sent == {"last_lr": 0.5, "step": 3}
    with pytest.raises(TypeError, match="cannot go to a rejoining group as JSON"):
        transfer._exchange_meta(store, record, ("y",), True, lambda: {"bad": object()})


class _Link:
    """A copy's link in one process: what the donor broadcasts, the taker receives."""

    def __init__(self):
        self.sent: list[np.ndarray] = []
        self.taken = 0

    def broadcast(self, tensor, src, group, tag=None):
        if src == 0:  # (the donor is global rank 0 here)
            self.sent.append(tensor.numpy().copy())
        else:
            tensor.set_value(paddle.to_tensor(self.sent[self.taken]))
            self.taken += 1


@pytest.mark.parametrize("secret", ["", "s" * 32])
def test_a_copys_metadata_goes_over_its_link_signed_and_a_changed_byte_is_refused(
        monkeypatch, secret):
    """Issue 62: the metadata of a set-up copy goes over the copy's own link, not etcd
    (none of it reaches the store); the taker gets the JSON round trip; with a job secret
    a byte changed on the way fails the round, naming the key."""
    from paddle_hsdp.ft.trust import Signer
    link = _Link()
    monkeypatch.setattr(transfer.comm, "broadcast", link.broadcast)
    store = MemoryStore()
    store.signer = Signer(secret or None)
    record = types.SimpleNamespace(number=2)
    meta = {"last_lr": np.float32(0.5), "model": [["w", (2, 3), "float32"]]}
    sent = transfer._meta_over_link(store, record, (0, "model", 1), "link", 0, meta)
    got = transfer._meta_over_link(store, record, (0, "model", 1), "link", 1)
    assert got == sent == {"last_lr": 0.5, "model": [["w", [2, 3], "float32"]]}
    assert not store.data  # etcd (here: the store) holds nothing of it
    if not secret:
        return
    link.taken = 0
    link.sent[1][-3] ^= 1  # a byte of the JSON changed on the way
    with pytest.raises(FaultToleranceError, match="round/000000002/state/0/model/1 .*refused"):
        transfer._meta_over_link(store, record, (0, "model", 1), "link", 1)
    link.taken = 0  # another place's (a replay to another rank) does not hold either
    with pytest.raises(FaultToleranceError, match="refused"):
        transfer._meta_over_link(store, record, (1, "model", 1), "link", 1)
    link.taken = 0  # a length beyond the bound is refused before anything is allocated
    link.sent[0][0] = transfer.MAX_META_BYTES + 1
    with pytest.raises(FaultToleranceError, match="claims .* bytes"):
        transfer._meta_over_link(store, record, (0, "model", 1), "link", 1)


def test_a_joint_saves_manifests_go_as_files_checked_against_small_commit_records(tmp_path):
    """Issue 62 (item 5): a group's manifests are a file of the save's folder; the job's
    store holds a commit record (name, bytes, SHA-256). The publisher refuses a file
    that differs from its record, naming it; a payload over 64 KiB is refused before
    anything is written to the store."""
    from paddle_hsdp.checkpoint import save
    from paddle_hsdp.ft import joint_save
    tmp = str(tmp_path / "ckpt.tmp-x")
    payloads = [{"manifests": [{"pieces": [{"n": g}], "error": None}], "errors": []}
                for g in range(3)]
    commits = [save._commit_group(tmp, 2 * g, p) for g, p in enumerate(payloads)]
    assert all(len(json.dumps(c)) < 200 for c in commits), commits
    manifests, errors = save._read_groups(tmp, commits)
    assert not errors and manifests == [p["manifests"][0] for p in payloads]
    with open(os.path.join(tmp, save.MANIFESTS, commits[1]["file"]), "w") as f:
        f.write(json.dumps({"manifests": [{"pieces": [{"n": 9}]}], "errors": []}))
    _, errors = save._read_groups(tmp, commits + [{"file": "../../etc/passwd", "bytes": 1}])
    assert len(errors) == 2 and "group-00002.json differ from the group's commit" in errors[0]
    assert "names no manifest file" in errors[1]
    store = MemoryStore()
    joint = _joint(store, 1, [1, 2])
    joint.begin("/ckpt")
    with pytest.raises(ValueError, match="at most 65536 bytes"):
        joint.gather({"manifests": "x" * joint_save.MAX_VALUE_BYTES})
    assert not store.data


def test_a_joint_save_whose_group_file_differs_fails_and_leaves_the_previous_checkpoint(
        tmp_path):
    """Issue 62 (item 5): the publishing group refuses a group's manifests file that
    differs from its commit record; the save fails on every group (the outcome names
    it), the scratch folder goes, and the checkpoint already at the path stays."""
    from paddle_hsdp.checkpoint import save
    path, tmp = str(tmp_path / "ckpt"), str(tmp_path / "ckpt.tmp-ft1s2c1-0")
    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write('{"previous": true}')
    theirs = save._commit_group(tmp, 2, {"manifests": [{"pieces": []}], "errors": []})
    with open(os.path.join(tmp, save.MANIFESTS, theirs["file"]), "a") as f:
        f.write(" ")  # not what group 1 committed

    class Publisher:  # the group that completes the count
        announced: list = []

        def file_rank(self):
            return 0

        def gather(self, commit):
            return [commit, theirs]

        def announce(self, outcome):
            self.announced.append(outcome)
    joint = Publisher()
    errors = save._publish_jointly(joint, path, tmp, [], [{"pieces": [], "error": None}],
                                   {}, None)
    assert len(errors) == 1 and "group-00002.json differ from the group's commit" in errors[0]
    assert joint.announced == errors  # every other group raises the same
    assert not os.path.exists(tmp)
    assert open(os.path.join(path, "metadata.json")).read() == '{"previous": true}'


class _GroupStore:
    """The group store's publish/read between a leader and its mates, in memory."""

    def __init__(self):
        self.published = {}
        self.armed = None

    def publish(self, name, text):
        self.published[name] = text

    def read(self, name, timeout_s, what):
        return self.published[name]


def _replica(rank, watch, control=None):
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft.rank, ft.replica_id, ft.round_timeout_s = rank, 0, 30.0
    ft._watch, ft.control, ft._token, ft._arrivals = watch, control, "tok", 0
    ft.round, ft._next_round, ft._members = None, 4, [0, 1]
    ft.step, ft.fresh, ft._failed, ft._config_hash = 9, False, True, ""
    ft.outer = types.SimpleNamespace()  # (no HFSDP pieces declared on it)
    return ft


def test_etcd_away_past_the_bound_reaches_the_leaders_mates_as_the_same_error():
    """The leader stops with EtcdUnavailable (etcd away past the round timeout); its
    mates read it from the group's store and stop with the same error, not with a
    gloo timeout in their next collective."""
    from paddle_hsdp.ft.etcd import EtcdUnavailable
    store = _GroupStore()
    control = types.SimpleNamespace(unavailable="etcd stayed away longer than the round "
                                    "timeout (30 s)", lost=None)
    with pytest.raises(EtcdUnavailable, match="stayed away"):
        _replica(0, store, control)._arrive()
    assert list(store.published.values()) == ["unavailable:" + control.unavailable]
    with pytest.raises(EtcdUnavailable, match="stayed away"):
        _replica(1, store)._arrive()


def test_after_etcd_lost_its_data_a_group_meets_the_others_with_its_own_state():
    """etcd lost its data, not the job this group: it registers anew and arrives at the
    round every group meets at, with its step and as a known state (not as a fresh
    joiner whose state would be replaced); a lease that ended otherwise makes it a
    fresh joiner, as before."""
    calls = []
    record = Round(7, {0: Arrival(9, False, True), 1: Arrival(9, False, True)}, True)

    class Control:
        unavailable, lost, reset = None, "etcd lost its data", True

        def register(self):
            calls.append("register")
            self.lost = None

        def take_reset(self):
            reset, self.reset = self.reset, False
            return reset

        def restart_round(self, proposal):
            calls.append(("restart_round", proposal))
            return 7

        def next_open(self):
            return 12

        def arrive(self, number, expected, arrival, needs_state):
            calls.append((number, expected, arrival))
            return record

    ft = _replica(0, _GroupStore(), Control())
    assert ft._form_round() is record
    assert calls == ["register", ("restart_round", 4), (7, [0, 1], Arrival(9, False, True))]
    calls.clear()
    control = Control()
    control.reset = False
    ft = _replica(0, _GroupStore(), control)
    ft._form_round()
    assert calls == ["register", (12, None, Arrival(9, True, True))]


def _resuming_replica(**fields):
    """A Replica as load_checkpoint sees it (no fleet, no etcd): ``fields`` set on it."""
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft.model, ft.optimizer, ft.step, ft.round, ft.history = None, None, 0, None, []
    ft.rank, ft.ranks_per_replica = 0, 1
    for name, value in fields.items():
        setattr(ft, name, value)
    return ft


def test_a_resume_is_refused_before_attach_after_a_step_and_for_a_bad_path():
    """Issue 63: replica.load_checkpoint's bad input is refused on the rank that made
    the call before any collective (each check is alike on every rank)."""
    with pytest.raises(RuntimeError, match="call attach"):
        _resuming_replica().load_checkpoint("/ckpt")
    attached = {"model": object(), "optimizer": object()}
    with pytest.raises(RuntimeError, match="before the first train_step"):
        _resuming_replica(step=3, **attached).load_checkpoint("/ckpt")
    with pytest.raises(RuntimeError, match="before the first train_step"):
        _resuming_replica(round=object(), **attached).load_checkpoint("/ckpt")
    with pytest.raises(TypeError, match="path must be a checkpoint folder"):
        _resuming_replica(**attached).load_checkpoint(7)


def test_a_resume_refuses_a_plain_checkpoint_another_model_and_another_group_size(
        tmp_path, registry):
    """Issue 63: a checkpoint saved outside a fault-tolerant job (or before the joint
    save kept a resume state) is refused naming what to call instead; one of another
    model names the tensors that differ; one saved by groups of another size says
    so. A folder that is no checkpoint is named."""
    from kit import models
    import paddle_hsdp
    model = models.build_model()
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    paddle_hsdp.save_checkpoint(tmp_path / "plain", model, opt)
    ft = _resuming_replica(model=model, optimizer=opt)
    with pytest.raises(paddle_hsdp.CheckpointError, match="is not a checkpoint"):
        ft.load_checkpoint(tmp_path / "nothing")
    with pytest.raises(paddle_hsdp.CheckpointError,
                       match="no fault-tolerant job's resume state.*paddle_hsdp.load_checkpoint"):
        ft.load_checkpoint(tmp_path / "plain")
    meta_path = tmp_path / "plain" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    state = {"step": 4, "rank": 0, "rng": None, "lr_scheduler": None, "user": None}
    meta["ft"] = {"step": 4, "ranks": [state, dict(state, rank=1)]}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="groups of 2 ranks, this group has 1"):
        ft.load_checkpoint(tmp_path / "plain")
    # a tensor this model does not have (the metadata of another model)
    meta["tensors"]["blocks.9.weight"] = meta["tensors"][next(iter(meta["tensors"]))]
    meta["ft"]["ranks"] = [state]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(paddle_hsdp.CheckpointError,
                       match="not a checkpoint of this model.*unexpected .'blocks.9.weight'"):
        ft.load_checkpoint(tmp_path / "plain")
    assert ft.step == 0 and getattr(ft, "_resume_path", None) is None  # nothing was loaded


def test_a_joint_saves_resume_state_is_the_writing_groups_ranks_in_order():
    """Issue 63: the metadata's ``ft`` is one entry per rank of the group that writes
    the replicated boxes, in rank order; states that disagree fail the save; a save
    whose ranks gave none (a stand-in saver) has none."""
    from paddle_hsdp.checkpoint.save import resume_of
    state = {"step": 6, "rng": [1], "lr_scheduler": None, "user": {"position": 6}}
    manifests = [{"pieces": [], "resume": dict(state, rank=1)}, {"pieces": [], "resume": None},
                 {"pieces": [], "resume": dict(state, rank=0)}]
    resume, why = resume_of(manifests)
    assert why is None and resume["step"] == 6 and [s["rank"] for s in resume["ranks"]] == [0, 1]
    manifests[0]["resume"]["step"] = 7
    assert resume_of(manifests)[0] is None and "disagree" in resume_of(manifests)[1]
    assert resume_of([{"pieces": []}]) == (None, None)


def test_the_resume_state_a_save_keeps_is_the_users_state_after_the_step():
    """A donor sends the user's state as of its step's start (the receiver fetches that
    step's batch again); a checkpoint keeps it as of the save, after the step."""
    position = [5]
    ft = _resuming_replica(step=5, lr_scheduler=None, _user_state='{"position": 4}',
                           _state_fn=lambda: {"position": position[0]})
    paddle.seed(3)
    state = ft.resume_state()
    assert state["user"] == {"position": 5} and state["step"] == 5 and state["rank"] == 0
    json.dumps(state)  # kept in the metadata as JSON


def test_a_pieces_holders_split_its_rows_each_read_once():
    """Issue 63: a resume into HFSDP with shared pieces reads each piece's optimizer
    state once: its holders (the round's members whose own piece it is) split its
    rows, every row read by exactly one holder and the bytes about even."""
    from paddle_hsdp.checkpoint.items import Item
    from paddle_hsdp.checkpoint.load import split_plan
    from paddle_hsdp.ft.pieces import PiecePlan
    from paddle_hsdp.ft.resume import piece_holders

    record = types.SimpleNamespace(replicas=[5, 0, 1, 2, 3])
    assert piece_holders(PiecePlan(2, 3, lambda r: r), record) == [1, 3, 5]
    assert piece_holders(PiecePlan(2, 2, lambda r: r), record) == [0, 2]
    assert piece_holders(None, record) == []

    def item(name, rows, cols):  # (boxes alone: nothing is allocated)
        return Item(name, [rows, cols], "float64", [0, 0], [rows, cols], None, None)

    # two boxes cut into many chunks (32 MiB and more a chunk) and small ones, whole
    items = [item("big/optim/moment1", 5_000_000, 8), item("big/optim/moment2", 5_000_000, 8),
             *(item(f"w{k}/optim/moment1", 3 + k, 4) for k in range(7))]
    for holders in (2, 3):
        plan = split_plan(sorted(items, key=lambda it: it.name), holders, "piece")
        rows = {it.name: np.zeros(it.size[0], int) for it in items}
        loads = [0] * holders
        for write, reader in plan:
            rows[write.item.name][write.lo:write.hi] += 1
            loads[reader] += (write.hi - write.lo) * write.item.size[1] * 8
        assert all((r == 1).all() for r in rows.values())  # every row read once
        assert max(loads) <= 1.25 * sum(loads) / holders, loads
