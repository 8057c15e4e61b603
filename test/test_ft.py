"""paddle_hsdp.ft in one process: the round protocol on an in-memory store (who is in,
when a round closes, who gives and who takes the state), the live outer group, and the
refusals. The multi-process behaviour (a killed and a hung replica group, a rejoin,
parity with a single-process reference) is test_collective/test_fault_tolerance.py."""

import json
import socket
import threading
import time
import types

import numpy as np
import paddle
import pytest

from paddle_hsdp.ft import groups, transfer
from paddle_hsdp.ft.rounds import Arrival, FaultToleranceError, Round, Rounds, arrived
from paddle_hsdp.ft.store import Liveness, key, parse_address


class MemoryStore:
    """Paddle's TCPStore interface (set, get, add) as ft.store.CoordinatorStore has it,
    in memory and thread-safe; ``restart()`` is a coordinator restarted (empty, and
    ``generation`` moves as a client's reconnection moves it)."""

    def __init__(self):
        self.data, self.lock = {}, threading.Lock()
        self.generation = 0

    def set(self, name, value, retry=True):
        with self.lock:
            self.data[name] = value.encode() if isinstance(value, str) else value

    def get(self, name, timeout_s=None, abort=None):
        deadline = time.monotonic() + 5
        while True:
            with self.lock:
                if name in self.data:
                    return self.data[name]
            assert time.monotonic() < deadline, f"get({name!r}) never answered"
            time.sleep(0.001)

    def add(self, name, amount, retry=True):
        with self.lock:
            value = int(self.data.get(name, b"0")) + amount
            self.data[name] = str(value).encode()
            return value

    def restart(self):
        with self.lock:
            self.data.clear()
            self.generation += 1


class NeverDead:
    def dead(self, replica):
        return False


def rounds_for(store, replica, start=1, minimum=1, window=30.0, timeout=10.0):
    return Rounds(store, replica, start, minimum, NeverDead(), timeout, window, poll_s=0.001)


def form_together(store, calls):
    """Run ``Rounds.form`` for several replicas at once: {replica: record or error}."""
    results = {}

    def run(replica, rounds, number, expected, arrival, needs_state=False):
        try:
            results[replica] = rounds.form(number, expected, arrival, needs_state)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            results[replica] = e

    threads = [threading.Thread(target=run, args=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


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
def test_the_first_round_closes_once_the_starting_replicas_are_in():
    store = MemoryStore()
    results = form_together(store, [(r, rounds_for(store, r, start=3), 0, None, Arrival(0, True))
                                    for r in range(3)])
    records = [results[r] for r in range(3)]
    assert all(isinstance(x, Round) for x in records), results
    assert {x.to_json() for x in records} == {records[0].to_json()}  # one record
    assert records[0].replicas == [0, 1, 2] and records[0].rebuild
    assert int(store.get(key("closed_rounds"))) == 1


def test_a_member_marked_dead_is_not_waited_for_and_the_groups_are_rebuilt():
    store = MemoryStore()
    store.add(key("r", 4, "dead", 2), 1)  # a watcher saw replica 2 stop in round 4
    results = form_together(store, [(r, rounds_for(store, r), 5, [0, 1, 2], Arrival(9, failed=True))
                                    for r in (0, 1)])
    assert results[0].replicas == [0, 1] == results[1].replicas
    assert results[0].rebuild
    assert results[1].left == {2: "a watcher saw a rank of it stop (killed or hung)"}


def test_a_missing_member_is_left_out_after_the_join_window_and_rejoins_later():
    store = MemoryStore()
    start = time.monotonic()
    results = form_together(store, [(r, rounds_for(store, r, window=0.3), 5, [0, 1, 2],
                                     Arrival(9)) for r in (0, 1)])
    assert results[0].replicas == [0, 1] and time.monotonic() - start >= 0.3
    assert "not arrived within the join window (0.3 s" in results[0].left[2]
    late = rounds_for(store, 2).form(5, [0, 1, 2], Arrival(9))
    assert late is None  # the round closed without it: it arrives at the next as a joiner


def test_a_joiner_is_taken_in_by_the_members_next_round_and_never_closes_one():
    store = MemoryStore()
    store.add(key("closed_rounds"), 6)  # rounds 0..5 closed
    joiner = rounds_for(store, 2, window=30.0)
    assert joiner.next_open() == 6
    only_joiner = form_together(store, [(2, rounds_for(store, 2, timeout=0.3), 6, None,
                                         Arrival(0, True))])
    assert isinstance(only_joiner[2], FaultToleranceError)  # nobody closed round 6
    assert "round 6" in str(only_joiner[2])
    results = form_together(store, [(0, rounds_for(store, 0), 6, [0, 1], Arrival(7)),
                                    (1, rounds_for(store, 1), 6, [0, 1], Arrival(7)),
                                    (2, joiner, 6, None, Arrival(0, fresh=True))])
    assert [results[r].replicas for r in range(3)] == [[0, 1, 2]] * 3, results
    assert results[0].receivers == [2] and results[0].donor == 0


def test_after_a_coordinator_restart_waiting_replicas_arrive_again():
    store = MemoryStore()
    results = {}
    members = rounds_for(store, 0, window=30.0)

    def wait_in_round():
        results[0] = members.form(4, [0, 1], Arrival(9))

    waiting = threading.Thread(target=wait_in_round)
    waiting.start()
    while not arrived(store, 4):  # replica 0 is in, waiting for replica 1
        time.sleep(0.001)
    store.restart()  # its arrival is gone with the old store
    later = form_together(store, [(1, rounds_for(store, 1), 4, [0, 1], Arrival(9))])
    waiting.join(10)
    assert results[0].replicas == later[1].replicas == [0, 1]
    # the closed rounds' count follows the round's number in the new store too
    assert rounds_for(store, 2).next_open() == 5


def test_a_joiner_after_a_coordinator_restart_takes_the_members_next_round():
    store = MemoryStore()
    store.add(key("closed_rounds"), 8)
    store.restart()
    assert rounds_for(store, 2).next_open() == 0  # nothing tells it yet
    store.set(key("round_floor"), "8")  # what a member's watcher writes once it sees it
    store.add(key("round_floor_set"), 1)
    assert rounds_for(store, 2).next_open() == 8


def test_a_joiner_waiting_at_a_round_the_members_went_past_leaves_it():
    store = MemoryStore()  # a restarted coordinator: a joiner that read no floor yet
    joiner = rounds_for(store, 2, start=3, window=30.0)
    assert joiner.next_open() == 0
    later = threading.Timer(0.2, lambda: (store.set(key("round_floor"), "8"),
                                          store.add(key("round_floor_set"), 1)))
    later.start()
    assert joiner.form(0, None, Arrival(0, fresh=True)) is None  # then it arrives at 8
    later.join()
    # joiners that form round 0 together read its record (the check for a round the
    # members went past does not take them out of one that closed with them)
    store = MemoryStore()
    members = form_together(store, [(r, rounds_for(store, r, start=2), 0, None,
                                     Arrival(0, True)) for r in (0, 1)])
    assert [members[r].replicas for r in (0, 1)] == [[0, 1]] * 2


def test_a_close_cut_by_a_restart_writes_nothing_to_the_new_store():
    from paddle_hsdp.ft.store import CoordinatorRestarted

    class RestartsAtTheRecord(MemoryStore):
        def set(self, name, value, retry=True):
            if name.endswith("/record") and not self.generation:
                self.restart()
                assert retry is False  # the record belongs with the old store's round
                raise CoordinatorRestarted("restarted")
            super().set(name, value, retry)

    store = RestartsAtTheRecord()
    result = form_together(store, [(0, rounds_for(store, 0), 3, [0], Arrival(2))])
    assert result[0].replicas == [0] and store.generation == 1  # formed again, there


def serve_and_connect(timeout_s: float = 10):
    """A coordinator's store on a free local port and a client of it: ``(port, server,
    client)``; ``del server`` stops it, ``serve("127.0.0.1", port)`` restarts it."""
    from paddle_hsdp.ft.store import connect, serve
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = serve("127.0.0.1", port)
    return port, server, connect(f"127.0.0.1:{port}", timeout_s)


def test_a_store_client_outlives_a_restart_of_the_coordinator():
    from paddle_hsdp.ft.store import CoordinatorRestarted, serve
    port, server, client = serve_and_connect()
    assert client.add("k", 3) == 3 and client.generation == 0
    del server
    server = serve("127.0.0.1", port)
    assert client.add("k", 1) == 1 and client.generation == 1  # again, on the new store
    del server
    server = serve("127.0.0.1", port)
    with pytest.raises(CoordinatorRestarted, match="during a set of x"):
        client.set("x", "1", retry=False)  # reconnected, not made again
    assert client.add("x", 0) == 0 and client.generation == 2
    del server


def test_a_read_of_a_value_never_written_is_bounded_and_a_restart_ends_it():
    from paddle_hsdp.ft.store import CoordinatorRestarted, serve
    port, server, client = serve_and_connect()
    client.set("a", "1")
    assert client.get("a") == b"1"
    with pytest.raises(TimeoutError, match="waited 0.2 s for b to be written"):
        client.get("b", timeout_s=0.2)  # Paddle's own get would block for good

    def give_up():
        raise FaultToleranceError("a failure was announced")
    with pytest.raises(FaultToleranceError, match="announced"):
        client.get("b", abort=give_up)
    del server
    server = serve("127.0.0.1", port)
    with pytest.raises(CoordinatorRestarted, match="while a was awaited"):
        client.get("a")  # written to the store that is gone
    del server


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


def test_a_joiner_stops_when_the_job_has_finished():
    store = MemoryStore()
    store.add(key("finished"), 1)
    with pytest.raises(FaultToleranceError, match="the job has finished"):
        rounds_for(store, 3).form(9, None, Arrival(0, fresh=True))


def test_too_few_replicas_is_an_error_that_names_the_bound():
    store = MemoryStore()
    rounds = Rounds(store, 0, 1, 2, NeverDead(), 0.2, 0.05, poll_s=0.001)
    with pytest.raises(FaultToleranceError, match="PADDLE_HSDP_FT_ROUND_TIMEOUT"):
        rounds.form(3, [0, 1], Arrival(4))


def test_liveness_calls_a_replica_dead_when_any_rank_stops():
    store, now = MemoryStore(), [0.0]
    live = Liveness(store, 1.0, ranks_per_replica=2, clock=lambda: now[0])
    assert not live.dead(3)
    now[0] = 0.5
    store.add(key("hb", 3, 0), 1)  # rank 0 beats, rank 1 does not
    assert not live.dead(3)
    now[0] = 1.6
    store.add(key("hb", 3, 0), 1)
    assert live.dead(3)


# ---------------------------------------------------------------- the outer group
def test_the_live_outer_group_follows_the_rounds():
    group = groups.LiveOuterGroup(replica=2, local_rank=1, inner=4)
    assert group.ranks == [9] and group.nranks == 1 and group.rank == 0
    assert group.early_sync is False and group.watchdog_exempt is True
    group.adopt([0, 2, 3], ("pg", {}), 4)
    assert group.ranks == [1, 9, 13] and group.rank == 1 and group.replicas == [0, 2, 3]
    assert group.process_group == "pg"
    group.abandon()
    assert group.ranks == [9] and group.process_group is None and group.broken == ["pg"]


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
    assert transfer._checksum(paddle.to_tensor(np.arange(4.0))) == \
        transfer._checksum(paddle.to_tensor(np.arange(4.0)))


@pytest.mark.parametrize("address", ["", "host", "host:", ":1234", "host:port"])
def test_a_bad_coordinator_address_names_the_variable(address):
    with pytest.raises(ValueError, match="PADDLE_HSDP_FT_COORDINATOR must be host:port"):
        parse_address(address)


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


def test_attach_refuses_unshared_outer_pieces_and_unsharded_buffers(monkeypatch):
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    ft.outer, ft.rank = object(), 1  # not the leader: it publishes no configuration
    buffers = [types.SimpleNamespace(outer=ft.outer, parts=2, shared_pieces=False,
                                     describe=lambda: "buffer 0")]
    monkeypatch.setattr(replica.registry, "units_under",
                        lambda model: [types.SimpleNamespace(buffers=buffers)])
    with pytest.raises(NotImplementedError, match="outer sub-shards of its own"):
        ft.attach(object(), object())
    buffers[0].shared_pieces = True  # cut by ft.init's plan: taken
    ft.attach(object(), object())
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
    # piece 1 and does not keep its own (it is a receiver)
    later = _round(6, {1: (7,), 2: (7,), 3: (0, True)})
    plan.arrange(later)
    assert [plan.donor(q) for q in (0, 1)] == [2, 1] and later.donor == 1
    assert plan.receivers(later, 0) == [] and plan.receivers(later, 1) == [3]
    assert not plan.keeps(1)


def test_each_piece_with_a_receiver_is_one_optimizer_copy():
    from paddle_hsdp.ft.pieces import PiecePlan
    record = _round(6, {0: (0, True), 1: (7,), 2: (7,), 3: (7,)})
    assert transfer._optimizer_phases(record, None) == [(0, 1, [0])]
    plan = PiecePlan(2, 1, lambda r: r)
    plan.arrange(record)
    assert transfer._optimizer_phases(record, plan) == [(0, 2, [0])]


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
    ft.rank, ft.store, ft.round_timeout_s = 0, None, 1.0
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


def test_a_waiting_round_says_whom_it_waits_for(monkeypatch, caplog):
    """Issue 49: a round that waits (no coordinator answer, a group missing) logged
    nothing until its timeout; now a line every WAIT_LOG_S names who is in and who not."""
    from paddle_hsdp.ft import rounds
    monkeypatch.setattr(rounds, "WAIT_LOG_S", 0.05)
    store = MemoryStore()
    with caplog.at_level("WARNING", logger="paddle_hsdp.ft"):
        with pytest.raises(FaultToleranceError, match="waited 0.3 s for round 5"):
            rounds_for(store, 0, timeout=0.3).form(5, [0, 1, 2], Arrival(9))
    lines = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(lines) >= 3, lines
    assert "round 5" in lines[0] and "arrived [0], waiting for [1, 2]" in lines[0], lines[0]


def _joiner_then_members(store, joiner: Arrival, members_config: str) -> dict:
    """Replica 2 waits at round 5 as a joiner; once it is in, members 0 and 1 (the last
    round's) arrive and close it: {replica: record or error}."""
    results = {}

    def join():
        try:
            results[2] = rounds_for(store, 2).form(5, None, joiner)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            results[2] = e

    thread = threading.Thread(target=join)
    thread.start()
    deadline = time.monotonic() + 10
    while 2 not in arrived(store, 5):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    results.update(form_together(store, [(r, rounds_for(store, r), 5, [0, 1],
                                          Arrival(9, config=members_config)) for r in (0, 1)]))
    thread.join(30)
    return results


def _config(store, ranks=2, hidden=8):
    from paddle_hsdp.ft import config
    return config.publish(store, config.describe(
        ranks, "none", 1, [("blocks.0/fc.weight", [hidden, 4], "paddle.float32")]))


@pytest.mark.parametrize("what,ranks,hidden,fragment", [
    ("ranks per group", 1, 8, "ranks_per_group 1 where the running groups have 2"),
    ("model", 2, 16, "parameter blocks.0/fc.weight [16, 4] paddle.float32 where the running "
                     "groups have blocks.0/fc.weight [8, 4]")])
def test_a_joiner_of_another_configuration_is_refused_and_the_members_go_on(
        what, ranks, hidden, fragment):
    """Issue 49: a group restarted with another model or --nproc_per_node was taken into
    round after round until every member died. Its arrival's configuration hash differs
    from the members': the round leaves it out and tells it why (the first difference),
    before any group is created for it; the members' round goes on."""
    store = MemoryStore()
    store.add(key("closed_rounds"), 5)
    ours, theirs = _config(store), _config(store, ranks, hidden)
    results = _joiner_then_members(store, Arrival(0, fresh=True, config=theirs), ours)
    assert results[0].replicas == [0, 1] == results[1].replicas, results
    assert isinstance(results[2], FaultToleranceError), results[2]
    assert "replica 2 cannot join" in str(results[2]) and fragment in str(results[2]), what


def test_the_same_configuration_joins():
    store = MemoryStore()
    store.add(key("closed_rounds"), 5)
    ours = _config(store)
    results = _joiner_then_members(store, Arrival(0, fresh=True, config=ours), ours)
    assert all(results[r].replicas == [0, 1, 2] for r in range(3)), results


def test_a_second_launch_of_a_live_replica_id_is_refused_and_a_dead_ones_is_taken_over():
    """Issue 49: a second launch with a running replica id joined, trained alone and
    exited 0 with a wrong model. Each launch claims its id; the claim before it holds
    while its leader's watcher bumps the lease."""
    from paddle_hsdp.ft.store import claim_replica_id
    store = MemoryStore()
    assert claim_replica_id(store, 3, "aaaa", "host-a", watch_s=0.2) is None  # first
    stop = threading.Event()

    def heartbeat():  # the first launch's watcher
        while not stop.wait(0.01):
            store.add(key("lease", 3, "aaaa"), 1)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        why = claim_replica_id(store, 3, "bbbb", "host-b", watch_s=0.2)
        also = claim_replica_id(store, 3, "dddd", "host-d", watch_s=0.2)  # after a refusal
    finally:
        stop.set()
        thread.join()
    for refusal in (why, also):
        assert refusal is not None and "replica id 3 is already running" in refusal
        assert "host host-a" in refusal and "PADDLE_HSDP_FT_REPLICA_ID=3" in refusal
    # the first launch died: its lease stands still, and a restart takes the id
    assert claim_replica_id(store, 3, "cccc", "host-c", watch_s=0.2) is None


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
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # round 8 changed nothing
    assert Round.from_json(Round(7, {0: Arrival(9)}, True, left={2: "x"}).to_json()).left \
        == {2: "x"}
    assert "round 7: left [2] (2: its heartbeats stopped (killed or hung)); 2 replicas " \
        "[0, 1]" in lines[0], lines[0]
    assert "round 9: joined [2], replica(s) [2] took the state of step 11 from replica 0" \
        in lines[1] and "set-up 1.20 s" in lines[1], lines[1]


def _replica_with_loader(monkeypatch, rounds):
    """A leader whose rounds are ``rounds`` (one per attempt: (receives, fails)): each
    receiving round loads the donor's loader position 10; a failing attempt is retried.
    Returns the replica, the loader, and what forward_backward was given."""
    from paddle_hsdp.ft import replica
    ft = object.__new__(replica.Replica)
    loader = types.SimpleNamespace(position=0)

    def next_batch():
        loader.position += 1
        return loader.position - 1

    ft.model, ft.optimizer, ft.lr_scheduler = object(), types.SimpleNamespace(
        step=lambda: None, clear_grad=lambda: None), None
    ft._state_fn = lambda: {"position": loader.position}
    ft._load_state_fn = lambda state: setattr(loader, "position", state["position"])
    ft.step, ft._loads, ft._failed, ft.fresh, ft.max_failed_attempts = 0, 0, False, True, 5
    ft._need_round, ft.replica_id, ft.store, ft.rank = True, 1, None, 0
    ft.outer = types.SimpleNamespace(pieces=None, abandon=lambda: None)
    plan = iter(rounds)
    sent = []

    def arrive():
        receives, fails = next(plan)
        ft._fails, ft._ran = fails, False
        return types.SimpleNamespace(number=0, receivers=[1] if receives else [],
                                     replicas=[0, 1], to_json=lambda: "{}")

    def set_up(record, receiving):
        sent.append(ft._plain_state()["user"])  # what this group would send as donor
        if receiving:
            ft._load_plain_state({"step": 10, "rng": [s.__getstate__() for s in
                                                       paddle.get_rng_state()],
                                  "lr_scheduler": None, "user": {"position": 10}})

    ft._arrive, ft._set_up_round = arrive, set_up
    ft._replica_votes = lambda failed, join: (failed or (ft._fails and ft._ran), False)
    ft._joiners_waiting = lambda: False
    ft._log = lambda *args, **kwargs: None
    monkeypatch.setattr(replica, "finish_grad_sync", lambda opt: None)
    monkeypatch.setattr(replica, "announce_failure", lambda store, number: None)
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
    outer = types.SimpleNamespace(pieces=None, virtual_rank=lambda r: 2 * r + 1)
    if pieces:
        outer.pieces = PiecePlan(pieces, replica_id, outer.virtual_rank)
    replica = types.SimpleNamespace(
        round=types.SimpleNamespace(number=3, replicas=replicas), step=step, store=store,
        replica_id=replica_id, outer=outer, ranks_per_replica=2, round_timeout_s=0.3)
    return JointSave(replica)


def test_the_live_groups_split_a_joint_checkpoint_by_piece_and_one_publishes():
    """Issue 49: in an HFSDP fault-tolerant job each group holds one piece of the
    optimizer state, so a save inside one group could never tile a tensor. Every box
    has one writing group, chosen from the shared round (the lowest live holder); the
    group that completes the count publishes, the others hear its outcome, and a group
    that never comes fails the save on the others within the round timeout."""
    store = MemoryStore()
    live = [1, 2, 3]  # replica 0 is gone: piece 0 is left to replica 2
    joints = {r: _joint(store, r, live, pieces=2) for r in live}
    assert [r for r in live if joints[r].writes(None)] == [1]
    assert [r for r in live if joints[r].writes(0)] == [2]
    assert [r for r in live if joints[r].writes(1)] == [1]
    assert joints[3].file_rank() == 7 and joints[1].world_size == 6
    assert len({j.begin("/ckpt") for j in joints.values()}) == 1
    assert joints[1].gather({"g": 1}) is None
    assert joints[3].gather({"g": 3}) is None
    assert joints[2].gather({"g": 2}) == [{"g": 1}, {"g": 2}, {"g": 3}]
    joints[2].announce("")
    assert joints[1].outcome() == "" and joints[3].outcome() == ""
    # the same path saved again at the same step (a retry, a final save): new keys, so
    # the first save's payloads and outcome are not taken for the second's, and one
    # group publishes
    tokens = {j.begin("/ckpt") for j in joints.values()}
    assert len(tokens) == 1 and "c2-" in tokens.pop()  # the second call
    assert joints[1].gather({"g": 1, "v": 2}) is None
    assert joints[3].gather({"g": 3, "v": 2}) is None
    assert joints[2].gather({"g": 2, "v": 2}) == [{"g": 1, "v": 2}, {"g": 2, "v": 2},
                                                         {"g": 3, "v": 2}]
    # HSDP: the lowest live group writes everything
    assert _joint(store, 1, live).writes(None) and not _joint(store, 2, live).writes(None)
    # a group that died before its part: the others' save fails, naming the live ones
    store = MemoryStore()
    lonely = _joint(store, 1, live)
    lonely.begin("/ckpt")
    assert lonely.gather({}) is None
    assert "replicas [1, 2, 3] were live" in lonely.outcome()
    with pytest.raises(RuntimeError, match="after a committed train_step"):
        _joint(store, 1, live, step=0).begin("/ckpt")


def test_a_coordinator_that_stays_away_fails_every_call_within_one_timeout():
    """Issue 49: with the coordinator gone, each store call waited a whole round
    timeout of its own, so a group's death was reported 46-52 s after it with a 20 s
    timeout. The bound now runs from the moment the coordinator was found gone."""
    from paddle_hsdp.ft.store import serve
    port, server, client = serve_and_connect(timeout_s=1.0)
    client.add("k", 1)
    del server
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no coordinator answers"):
        client.add("k", 1)  # finds it gone, waits out the bound
    first = time.monotonic() - started
    for _ in range(3):  # the calls after: at once, not a bound each
        with pytest.raises(TimeoutError, match="no coordinator answers"):
            client.add("k", 1)
    assert 1.0 <= first and time.monotonic() - started < first + 1.0, \
        (first, time.monotonic() - started)
    server = serve("127.0.0.1", port)
    assert client.add("k", 1) == 1 and client.generation == 1  # back: a new bound later
    del server


def test_a_client_waiting_for_a_coordinator_says_so(monkeypatch, caplog):
    """Issue 49: with no coordinator, ft.init waited out the whole round timeout (120 s)
    in silence."""
    from paddle_hsdp.ft import store
    monkeypatch.setattr(store, "_SILENCE_S", 0.3)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    with caplog.at_level("WARNING", logger="paddle_hsdp.ft"), \
            pytest.raises(TimeoutError, match="no coordinator answers"):
        store.connect(f"127.0.0.1:{port}", 1.0)
    lines = [r.getMessage() for r in caplog.records if "yet (waited" in r.getMessage()]
    assert 2 <= len(lines) <= 4 and "PADDLE_HSDP_FT_COORDINATOR" in lines[0], lines


def test_once_the_job_has_trained_fresh_groups_alone_never_form_a_round():
    """Found by tools/sweep_ft_deaths.py (issue 49): a member killed while a rejoin
    round created its groups failed that round; the joiner, still fresh, formed the
    next round alone when the donor came 1.5 s late, and trained the job again from
    its initial model (the donor, left out, then took that state). A round whose
    every member is fresh closes only while the job has not trained yet."""
    store = MemoryStore()
    joiner = rounds_for(store, 2, window=0.2)
    late = {}

    def donor_arrives_late():
        time.sleep(0.6)  # three join windows after the joiner
        late["record"] = rounds_for(store, 0, window=0.2).form(3, [0, 1, 2], Arrival(7),
                                                               needs_state=True)

    thread = threading.Thread(target=donor_arrives_late)
    thread.start()
    record = joiner.form(3, [0, 1, 2], Arrival(0, fresh=True), needs_state=True)
    thread.join(10)
    assert record.replicas == [0, 2] == late["record"].replicas
    assert record.donor == 0 and record.receivers == [2] and record.step == 7
    # before the job trained (the first round's copy failed): fresh groups go on
    store = MemoryStore()
    alone = rounds_for(store, 2, window=0.1).form(1, [0, 1, 2], Arrival(0, fresh=True))
    assert alone.replicas == [2]
    # and a job whose groups holding its state are all gone says so at the timeout
    store = MemoryStore()
    stuck = Rounds(store, 2, 1, 1, NeverDead(), 0.5, 0.1, poll_s=0.001)
    with pytest.raises(FaultToleranceError, match="a replica group that holds the job's"):
        stuck.form(3, [0, 1, 2], Arrival(0, fresh=True), needs_state=True)


def test_the_coordinator_listens_on_loopback_unless_told_and_warns_for_every_interface(
        monkeypatch, capsys):
    """Its store has no authentication and the groups unpickle what they read from it:
    it no longer binds every interface by default, and says so when told to."""
    from paddle_hsdp.ft import coordinator
    seen = []
    monkeypatch.setattr(coordinator, "serve", lambda host, port: seen.append(host))
    monkeypatch.setattr(coordinator.signal, "sigwait", lambda signals: None)
    monkeypatch.setattr(coordinator.signal, "pthread_sigmask", lambda how, signals: None)
    coordinator.main(["--port", "29999"])
    coordinator.main(["--port", "29999", "--host", "0.0.0.0"])
    assert seen == ["127.0.0.1", "0.0.0.0"]
    assert "WARNING: listening on every interface" in capsys.readouterr().err


def test_with_pieces_a_round_waits_for_a_late_holder_of_each_piece():
    """Review of issue 49: with HFSDP's pieces, the only holder of piece 0 arriving
    after the join window made the round close without it (PieceLostError on every
    rank). The round now waits for a live holder of each piece; a piece whose every
    holder is dead is left to PieceLostError at once."""
    store = MemoryStore()
    make = lambda r: Rounds(store, r, 1, 1, NeverDead(), 10.0, 0.2, poll_s=0.001, pieces=2)
    late = {}

    def holder_of_piece_0_arrives_late():
        time.sleep(0.5)
        late["record"] = make(0).form(5, [0, 1, 2], Arrival(7), needs_state=True)

    thread = threading.Thread(target=holder_of_piece_0_arrives_late)
    thread.start()
    results = form_together(store, [
        (1, make(1), 5, [0, 1, 2], Arrival(7), True),
        (2, make(2), 5, [0, 1, 2], Arrival(0, fresh=True), True)])
    thread.join(10)
    assert late["record"].replicas == [0, 1, 2], late["record"]
    assert all(r.replicas == [0, 1, 2] for r in results.values()), results
    # every holder of piece 0 dead: the round closes (and PiecePlan.arrange says lost)
    store = MemoryStore()
    store.add(key("r", 4, "dead", 0), 1)
    make = lambda r: Rounds(store, r, 1, 1, NeverDead(), 10.0, 0.2, poll_s=0.001, pieces=2)
    results = form_together(store, [
        (1, make(1), 5, [0, 1, 2], Arrival(7), True),
        (2, make(2), 5, [0, 1, 2], Arrival(0, fresh=True), True)])
    assert all(r.replicas == [1, 2] for r in results.values()), results


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
