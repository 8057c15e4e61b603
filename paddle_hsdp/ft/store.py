"""A replica group's own watch over its ranks, on the group's own store.

Every rank of a replica group bumps a heartbeat counter a few times a second in the
store its launch job already has (Paddle's master ``TCPStore``, on its own connection:
a store client is not shared between threads), from a thread of its own. Nothing of
this crosses replica groups: the group's leader reads its mates' counters, and while
one has not moved for ``PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT`` seconds (default 10: long
enough for a loaded host to leave a thread unscheduled for a while) it calls the group
unhealthy, which ends the group's lease on the job's etcd (:mod:`.protocol`): every
other group hears of it from etcd. The leader also hands each round's record and each
announced failure of a round to its mates here, so a collective a rank is blocked in
fails now rather than at gloo's timeout.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from paddle.base import core

from .kv import wait_count

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


def group_store_address() -> tuple[str, int]:
    """The launch job's master store (what ``init_parallel_env`` connected to)."""
    master = os.environ.get("PADDLE_MASTER", "")
    if not master and os.environ.get("MASTER_ADDR"):
        master = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError("paddle_hsdp.ft: this replica group's launch store is unknown "
                           "(PADDLE_MASTER is not set): start each replica group with "
                           "python -m paddle.distributed.launch")
    return host, int(port)


def _connect_client(host: str, port: int, timeout_s: float) -> core.TCPStore:
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
    found: set[int] = set()
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


def on_socket(fd: int, action: Callable[[socket.socket], object]) -> None:
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


def key(*parts: object) -> str:
    return "/".join([PREFIX, *map(str, parts)])


class GroupWatch:
    """Every rank's daemon thread on its replica group's own store, a few times a
    second: it bumps ``hb/<rank>``; calls ``on_failure(round)`` once a failure of the
    round it trains in (``armed``) is announced in the group (:meth:`announce`: by the
    leader, when etcd tells it, or by a rank whose collective failed); and on the
    leader, keeps which mates' heartbeats stopped (:meth:`healthy`). A group of one
    rank has no store: its flags stay in this process."""

    def __init__(self, rank: int, ranks: int, timeout_s: float,
                 on_failure: Callable[[int], None], round_timeout_s: float):
        self.rank, self.ranks, self.timeout_s = rank, ranks, timeout_s
        self._on_failure = on_failure
        self._lock = threading.Lock()  # the main thread reads flags on the same client
        self._store: core.TCPStore | None = None
        if ranks > 1:
            host, port = group_store_address()
            self._store = _connect_client(host, port, round_timeout_s)
        self._local_failed: set[int] = set()
        self._seen: dict[int, tuple[int, float]] = {}  # mate -> (count, since)
        self.stale: list[int] = []  # mates whose heartbeats stopped (leader)
        self.armed: int | None = None
        self._told: int | None = None  # the round whose failure was handed on
        self._stop = threading.Event()
        self._call("add", _hb(rank), 1)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="paddle_hsdp-ft-watch")
        self._thread.start()
        # joined before the interpreter tears down: a store call cut short at exit
        # aborts the process
        atexit.register(self.stop)

    def _call(self, op: str, *args: object) -> Any:
        if self._store is None:
            return 0
        with self._lock:
            return getattr(self._store, op)(*args)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - the group's master is going: next tick
                logger.debug("paddle_hsdp.ft watch: %s", e)

    def _tick(self) -> None:
        self._call("add", _hb(self.rank), 1)
        if self.rank == 0 and self.ranks > 1:
            now, stale = time.monotonic(), []
            for mate in range(1, self.ranks):
                value = int(self._call("add", _hb(mate), 0))
                last = self._seen.get(mate)
                if last is None or last[0] != value:
                    self._seen[mate] = (value, now)
                elif now - last[1] > self.timeout_s:
                    stale.append(mate)
            if stale and not self.stale:
                logger.warning("paddle_hsdp.ft: no heartbeat from rank(s) %s of this replica "
                               "group for %g s: the group leaves the job", stale, self.timeout_s)
            self.stale = stale
        armed = self.armed
        if armed is not None and armed != self._told and self.failed(armed):
            self._told = armed
            self._on_failure(armed)  # acts on that round's group only

    def healthy(self) -> bool:
        """Whether every rank of the group still heartbeats (the leader asks)."""
        return not self.stale

    def announce(self, round_number: int) -> None:
        """A failure of round ``round_number``: every rank of the group hears it."""
        self._local_failed.add(round_number)
        self._call("add", f"{PREFIX}/failed/{round_number}", 1)

    def failed(self, round_number: int) -> bool:
        return round_number in self._local_failed or \
            int(self._call("add", f"{PREFIX}/failed/{round_number}", 0)) > 0

    def publish(self, name: str, text: str) -> None:
        """Hand ``text`` to the group's other ranks (the leader: a round's record)."""
        self._call("set", f"{PREFIX}/{name}", text)
        self._call("add", f"{PREFIX}/{name}/.written", 1)

    def read(self, name: str, timeout_s: float, what: str) -> str:
        """What the leader published under ``name``, once it has (a Paddle store's
        ``get`` of a key not yet written would block without bound)."""
        wait_count(self, f"{PREFIX}/{name}/.written", 1, timeout_s, what)
        return self._call("get", f"{PREFIX}/{name}").decode()

    def add(self, name: str, amount: int) -> int:
        """The group store's counter (what :func:`~.kv.wait_count` reads)."""
        return int(self._call("add", name, amount))

    def set(self, name: str, value: str) -> None:
        """Write ``name`` in the group's store (the relay's requests and answers,
        :mod:`.relay`: this client serves it too, so a rank holds one connection)."""
        self._call("set", name, value)

    def get(self, name: str) -> bytes:
        """``name``'s value in the group's store; only for a key known to be written
        (Paddle's store waits without bound for one that is not)."""
        return bytes(self._call("get", name))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _hb(rank: int) -> str:
    return f"{PREFIX}/hb/{rank}"
