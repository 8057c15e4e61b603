"""The coordinator's store and the liveness signals kept in it.

Replica groups of a fault-tolerant job meet in one Paddle ``TCPStore`` that no replica
hosts: a small coordinator process serves it (``python -m paddle_hsdp.ft.coordinator``),
so the rendezvous outlives any replica. Paddle's store has only ``set``, ``get``
(blocking), ``add`` and ``wait``; ``add(key, 0)`` reads a counter without blocking, so
every "has this happened" question here is a counter, and a value is written before
the counter that announces it.

Every rank also bumps a heartbeat counter a few times a second from a thread of its
own, on a connection of its own (a store client is not shared between threads).
Others call a rank dead, or hung, when its counter has not moved for
``PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT`` seconds (default 10: long enough for a loaded host
to leave a thread unscheduled for a while): a stopped rank is noticed within that
bound, without waiting for a collective's timeout. A killed one fails the collectives
of its peers at once.

The coordinator may be restarted (the same command, the same port) while the job runs:
every client here is a :class:`CoordinatorStore`, which on a broken connection waits
for the coordinator to listen again, reconnects and makes the call again. The new
store is empty; what the rounds keep in it is written again by those who know it
(:mod:`.rounds`: arrivals, the next round's number; the watcher: its heartbeat and the
failure count it compares against).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time

from paddle.base import core

from ..comm.gloo_store import wait_until_listening

COORDINATOR_ENV = "PADDLE_HSDP_FT_COORDINATOR"
HEARTBEAT_TIMEOUT_ENV = "PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT"
JOIN_WINDOW_ENV = "PADDLE_HSDP_FT_JOIN_WINDOW"
PREFIX = "paddle_hsdp/ft"
logger = logging.getLogger("paddle_hsdp.ft")
HEARTBEAT_INTERVAL_S = 0.25


def float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def heartbeat_timeout_s() -> float:
    return float_env(HEARTBEAT_TIMEOUT_ENV, 10.0)


def join_window_s() -> float:
    return float_env(JOIN_WINDOW_ENV, 3.0)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` of the coordinator; a clear error for anything else."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR_ENV} must be host:port (the coordinator's address, "
                         f"`python -m paddle_hsdp.ft.coordinator --port P` prints it), "
                         f"got {address!r}")
    return host, int(port)


def connect(address: str, timeout_s: float) -> "CoordinatorStore":
    """A client of the coordinator's store that reconnects after a restart of the
    coordinator (raises if none answers within the timeout)."""
    return CoordinatorStore(address, timeout_s)


class CoordinatorRestarted(RuntimeError):
    """A call made with ``retry=False`` met a restarted coordinator: it reconnected,
    and the call was not made again (what it wrote belongs with what the old store
    held)."""


class CoordinatorStore:
    """A client of the coordinator's store (``set``, ``get``, ``add`` as Paddle's) that
    outlives a restart of the coordinator: a call that meets a broken connection waits
    up to ``timeout_s`` for the coordinator to listen again, reconnects, and is made
    once more on the new (empty) store, unless made with ``retry=False``
    (:class:`CoordinatorRestarted` then). ``generation`` counts the reconnections, so
    a caller that keeps state in the store can tell it must write it again.

    Paddle's ``get`` of a missing key blocks for good (its timeout is not applied: a
    reader of a value whose writer died, or of one written to a store since replaced,
    would never return). So ``set`` also counts the key as written, and ``get`` waits
    on that count, bounded, and raises :class:`CoordinatorRestarted` if the store was
    replaced meanwhile."""

    def __init__(self, address: str, timeout_s: float):
        self.address, self.timeout_s = address, timeout_s
        self.generation = 0
        # when the coordinator was found gone (one thread per client: the watcher has
        # a client of its own)
        self._gone_since: float | None = None
        self._client = _client(address, timeout_s)

    def set(self, name: str, value, retry: bool = True) -> None:
        while True:  # the value and its count in one store
            generation = self.generation
            self._call("set", retry, name, value)
            self._call("add", retry, _written(name), 1)
            if self.generation == generation:
                return

    def get(self, name: str, timeout_s: float | None = None, abort=None) -> bytes:
        """``name``'s value once it is written (within ``timeout_s``, default the
        client's: TimeoutError); ``abort()`` is called while it waits (it raises to
        stop waiting)."""
        generation = self.generation

        def still_this_store():
            if self.generation != generation:
                raise CoordinatorRestarted(f"paddle_hsdp.ft: the coordinator restarted "
                                           f"while {name} was awaited")
            if abort is not None:
                abort()

        wait_count(self, _written(name), 1, timeout_s or self.timeout_s,
                   f"{name} to be written", abort=still_this_store)
        still_this_store()
        return self._call("get", False, name)  # written: it returns at once

    def add(self, name: str, amount: int, retry: bool = True) -> int:
        return self._call("add", retry, name, amount)

    def _call(self, op: str, retry: bool, *args):
        if self._client is not None:
            try:
                return getattr(self._client, op)(*args)
            except ValueError as e:
                if not _broken(e):
                    raise
            logger.warning("paddle_hsdp.ft: the coordinator at %s is gone; waiting up to "
                           "%g s for it to listen again", self.address, self.timeout_s)
            self._client = None  # closes the broken connection
            self._gone_since = time.monotonic()
        # One bound from the moment it went, for every call after: each call waiting a
        # whole timeout of its own made a failure reported 2.5 timeouts late.
        waited = time.monotonic() - self._gone_since
        self._client = _client(self.address, self.timeout_s,  # raises if it stays away
                               wait_s=max(0.0, self.timeout_s - waited))
        self._gone_since = None
        self.generation += 1
        logger.warning("paddle_hsdp.ft: reconnected to the coordinator at %s", self.address)
        if not retry:
            raise CoordinatorRestarted(f"paddle_hsdp.ft: the coordinator restarted during "
                                       f"a {op} of {args[0]}")
        return getattr(self._client, op)(*args)


def _written(name: str) -> str:
    return name + "/.written"


def _broken(error: ValueError) -> bool:
    """Whether Paddle's store client raised for a lost connection ("TCP send error",
    "TCP receive error", "connection reset by peer")."""
    return "TCP" in str(error)


_SILENCE_S = 10.0  # a client waiting for the coordinator says so this often


def _client(address: str, timeout_s: float, wait_s: float | None = None):
    """A Paddle ``TCPStore`` client of the coordinator (``timeout_s``: its requests'),
    made once one answers (within ``wait_s``, default ``timeout_s``).

    Paddle's client retries a refused connection for far longer than its timeout, so it
    is made only once something listens; and a coordinator still going down (killed,
    its process not gone yet) may accept and then reset the connection: that is
    retried too."""
    host, port = parse_address(address)
    wait_s = timeout_s if wait_s is None else wait_s
    start = time.monotonic()
    deadline, next_word = start + wait_s, start + _SILENCE_S
    while True:
        try:
            # in slices, to say every _SILENCE_S that nothing answers yet
            wait_until_listening(host, port, max(0.0, min(deadline, next_word)
                                                 - time.monotonic()))
            return _connect_client(host, port, timeout_s)
        except (TimeoutError, ValueError) as e:
            if isinstance(e, ValueError) and not _broken(e):
                raise
            if next_word < deadline and time.monotonic() >= next_word:
                logger.warning("paddle_hsdp.ft: no coordinator answers at %s yet (waited "
                               "%.0f s of %g s; %s names it)", address,
                               time.monotonic() - start, wait_s, COORDINATOR_ENV)
                next_word += _SILENCE_S
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"paddle_hsdp.ft: no coordinator answers at {address} ({e}) after "
                    f"{wait_s:g} s: start it with `python -m paddle_hsdp.ft.coordinator "
                    f"--port {port}` ({COORDINATOR_ENV} names it)") from None
            time.sleep(0.2)


def _connect_client(host: str, port: int, timeout_s: float):
    """A Paddle ``TCPStore`` client.

    Paddle's client does not set ``TCP_NODELAY``: each request then waits out the
    peer's delayed ACK (measured: 44 ms an ``add``, 88 ms a ``get`` on loopback; 0.09 and
    0.14 ms with it). So the socket the client opened gets it here."""
    before = socket_fds()
    store = core.TCPStore(host, port, False, 1, max(1, int(timeout_s)))
    for fd in socket_fds() - before:
        _set_nodelay(fd)
    return store


def socket_fds() -> set[int]:
    """This process's open socket descriptors (Linux: /proc/self/fd; empty elsewhere)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:  # closed meanwhile
            continue
    return found


def on_socket(fd: int, action) -> None:
    """``action(sock)`` on the socket behind descriptor ``fd``, which stays its owner's
    (Paddle's store, gloo): never closed here. An ``OSError`` (not a TCP socket, not
    connected, already gone) is ignored."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        action(sock)
    except OSError:
        pass
    finally:
        sock.detach()


def _set_nodelay(fd: int) -> None:
    on_socket(fd, lambda sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1))


def serve(host: str, port: int, timeout_s: int = 900):
    """The coordinator's server store (returns at once; serves while the object lives)."""
    return core.TCPStore(host, port, True, 1, timeout_s)


def key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def count(store, name: str, retry: bool = True) -> int:
    """The counter ``name`` (0 if never added to), without blocking; ``retry=False``:
    :class:`CoordinatorRestarted` if the coordinator restarted meanwhile."""
    return int(store.add(name, 0) if retry else store.add(name, 0, retry=False))


class Watcher:
    """Every rank's daemon thread (on a store connection of its own), a few times a
    second:

    * bumps ``hb/<replica>/<rank>``: this rank lives and is not stopped;
    * watches the ranks this rank shares an outer group with (``peers``, set each
      round): one whose heartbeat stopped for ``timeout_s`` hangs or died; it is
      announced as a failure of the round like a failed collective
      (:func:`announce_failure`), and its replica marked dead in the round
      (``r/<round>/dead/<replica>``);
    * calls ``on_failure(round)`` once a failure of the round it watches (``armed``)
      is announced: the round's outer group is shut down (or its creation cut short),
      so a collective this rank is blocked in fails now instead of after gloo's 30 s.
      Failures are counted per round, so a replica left out of this round that fails
      its own attempt does not stop this one;
    * on the leader, tells whether a replica group waits to join (``joiners_waiting``:
      one has arrived at the round after this one; members arrive there only when
      they form it).
    """

    def __init__(self, address: str, replica: int, rank: int, liveness_timeout_s: float,
                 store_timeout_s: float, on_failure, leader: bool):
        self._store = connect(address, store_timeout_s)
        self._generation = 0  # the store's, when this thread last wrote its state
        self._key = key("hb", replica, rank)
        self._leader, self._on_failure = leader, on_failure
        self.liveness = Liveness(self._store, liveness_timeout_s)
        self.peers: list[tuple[int, int]] = []  # (replica, rank) to watch
        # the round the peers are members of, set by the main thread at each round;
        # None before the first and while a round forms
        self.armed: int | None = None
        self.joiners_waiting = False
        self.lease: str | None = None  # the leader's lease on its replica id, once held
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="paddle_hsdp-ft-watcher")
        self._thread.start()
        # joined before the interpreter tears down: a store call cut short at exit
        # aborts the process
        atexit.register(self.stop)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._tick()
            except Exception as e:  # the coordinator is away: try again next tick
                logger.debug("paddle_hsdp.ft watcher: %s", e)

    def _tick(self) -> None:
        store = self._store
        store.add(self._key, 1)
        if self.lease is not None:  # this launch holds its replica id (claim_replica_id)
            store.add(self.lease, 1)
        round_number = self.armed
        if round_number is None:  # no round: nothing to watch
            return
        peers = list(self.peers)
        if store.generation != self._generation:  # a restarted coordinator: empty
            self._generation = store.generation
            # joiners arrive at the round after this one (rounds.next_open); only the
            # members of a formed round write it (armed), so they all write one number
            store.set(key("round_floor"), str(round_number + 1))
            store.add(key("round_floor_set"), 1)
        hung = [replica for replica, rank in peers if self.liveness.rank_dead(replica, rank)]
        if hung:  # the next round need not wait for their heartbeats again
            logger.warning("paddle_hsdp.ft: no heartbeat from rank %s for %g s: a failure",
                           [f"{replica}/{rank}" for replica, rank in peers
                            if replica in hung], self.liveness.timeout_s)
            for replica in hung:
                store.add(key("r", round_number, "dead", replica), 1)
            announce_failure(store, round_number)
            self.peers = []  # announced once
        if count(store, failure_key(round_number)):
            self._on_failure(round_number)  # acts on that round's group only
        if self._leader:  # only joiners arrive at the next round before it is formed
            self.joiners_waiting = count(store, key("r", round_number + 1, "slots")) > 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def failure_key(round_number: int) -> str:
    """The count of failures announced in round ``round_number``."""
    return key("r", round_number, "failures")


def announce_failure(store, round_number: int) -> None:
    """Tell every rank of round ``round_number`` that its attempt failed (and count it
    for the job: the next round's record keeps the total)."""
    store.add(failure_key(round_number), 1)
    store.add(key("failures"), 1)


def claim_replica_id(store, replica: int, token: str, host: str,
                     watch_s: float = 8 * HEARTBEAT_INTERVAL_S) -> str | None:
    """Take replica id ``replica`` for this launch (``token``): None if taken, else why
    not. The id's holder is the last launch that took it; it holds the id while its
    leader's watcher bumps its lease (``lease/<replica>/<token>``, every heartbeat). A
    lease that moves within ``watch_s`` is a live group: this launch is refused. One that
    does not (the group died or hangs) is taken over. Claims are counted (an atomic
    ``add``), so of two launches started at once the second waits for the first's
    holding and is refused."""
    if store.add(key("id", replica, "claims"), 1) > 1:
        wait_count(store, key("id", replica, "holder_set"), 1, watch_s,
                   f"the holder of replica id {replica}")
        raw = store.get(key("id", replica, "holder"))
        other, other_host = (raw.decode() if isinstance(raw, bytes) else raw).split(" ", 1)
        lease = key("lease", replica, other)
        before, deadline = count(store, lease), time.monotonic() + watch_s
        while time.monotonic() < deadline:
            if count(store, lease) != before:
                return (f"paddle_hsdp.ft: replica id {replica} is already running (its "
                        f"leader on host {other_host}): a second launch with "
                        f"PADDLE_HSDP_FT_REPLICA_ID={replica} is refused. Give this group "
                        "an id no running group has, or stop the running one first.")
            time.sleep(HEARTBEAT_INTERVAL_S / 4)
    store.set(key("id", replica, "holder"), f"{token} {host}")
    store.add(key("id", replica, "holder_set"), 1)
    return None


class Liveness:
    """Which ranks' heartbeats have stopped, as seen by one observer over time."""

    def __init__(self, store, timeout_s: float, ranks_per_replica: int = 1,
                 clock=time.monotonic):
        self.store, self.timeout_s, self.clock = store, timeout_s, clock
        self.ranks_per_replica = ranks_per_replica
        self._seen: dict[tuple, tuple[int, float]] = {}  # (replica, rank) -> (count, since)

    def rank_dead(self, replica: int, rank: int) -> bool:
        value, now = count(self.store, key("hb", replica, rank)), self.clock()
        last = self._seen.get((replica, rank))
        if last is None or last[0] != value:
            self._seen[(replica, rank)] = (value, now)
            return False
        return now - last[1] > self.timeout_s

    def dead(self, replica: int) -> bool:
        """A replica group is gone when any of its ranks is (it leaves as a whole)."""
        return any([self.rank_dead(replica, rank) for rank in range(self.ranks_per_replica)])


def wait_count(store, name: str, at_least: int, timeout_s: float, what: str,
               poll_s: float = 0.002, retry: bool = True, abort=None) -> int:
    """Poll the counter ``name`` until it reaches ``at_least`` (every ``poll_s`` at
    first, backing off to 50 ms); a clear error after ``timeout_s`` naming ``what``
    was awaited. ``retry``: as :func:`count`; ``abort()`` is called between polls (it
    raises to stop waiting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = count(store, name, retry)
        if value >= at_least:
            return value
        if abort is not None:
            abort()
        if time.monotonic() > deadline:
            raise TimeoutError(f"paddle_hsdp.ft: waited {timeout_s:g} s for {what}")
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, 0.05)
