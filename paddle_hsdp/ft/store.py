"""The coordinator's store and the liveness signals kept in it.

Replica groups of a fault-tolerant job meet in one Paddle ``TCPStore`` that no replica
hosts: a small coordinator process serves it (``python -m paddle_hsdp.ft.coordinator``),
so the rendezvous outlives any replica. Paddle's store has only ``set``, ``get``
(blocking), ``add`` and ``wait``; ``add(key, 0)`` reads a counter without blocking, so
every "has this happened" question here is a counter, and a value is written before
the counter that announces it.

Each replica's leader (its local rank 0) also bumps a heartbeat counter a few times a
second from a thread of its own, on a connection of its own (a store client is not
shared between threads). Others call a replica dead when its counter has not moved
for ``PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT`` seconds: a killed replica is noticed within
that bound, without waiting for any collective timeout.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from paddle.base import core

COORDINATOR_ENV = "PADDLE_HSDP_FT_COORDINATOR"
HEARTBEAT_TIMEOUT_ENV = "PADDLE_HSDP_FT_HEARTBEAT_TIMEOUT"
PREFIX = "paddle_hsdp/ft"
HEARTBEAT_INTERVAL_S = 0.25


def _float_env(name: str, default: float) -> float:
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
    return _float_env(HEARTBEAT_TIMEOUT_ENV, 3.0)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` of the coordinator; a clear error for anything else."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR_ENV} must be host:port (the coordinator's address, "
                         f"`python -m paddle_hsdp.ft.coordinator --port P` prints it), "
                         f"got {address!r}")
    return host, int(port)


def connect(address: str, timeout_s: float):
    """A client of the coordinator's store (raises if none answers within the timeout)."""
    host, port = parse_address(address)
    return core.TCPStore(host, port, False, 1, max(1, int(timeout_s)))


def serve(host: str, port: int, timeout_s: int = 900):
    """The coordinator's server store (returns at once; serves while the object lives)."""
    return core.TCPStore(host, port, True, 1, timeout_s)


def key(*parts) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def count(store, name: str) -> int:
    """The counter ``name`` (0 if never added to), without blocking."""
    return int(store.add(name, 0))


class Heartbeat:
    """A daemon thread that bumps ``hb/<replica>`` while this process lives, and
    watches whether a replica group waits to join (``joiners_waiting``: more joiners
    counted in than rounds admitted)."""

    def __init__(self, address: str, replica: int, timeout_s: float):
        self._store = connect(address, timeout_s)
        self._key = key("hb", replica)
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self.joiners_waiting = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="paddle_hsdp-ft-heartbeat")
        self._thread.start()
        # joined before the interpreter tears down: a store call cut short at exit
        # aborts the process
        atexit.register(self.stop)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._store.add(self._key, 1)
                self.joiners_waiting = (count(self._store, key("joiners_in"))
                                        > count(self._store, key("joiners_admitted")))
            except Exception:  # the coordinator is gone: rounds will say so
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Liveness:
    """Which replicas' heartbeats have stopped, as seen by one observer over time."""

    def __init__(self, store, timeout_s: float, clock=time.monotonic):
        self.store, self.timeout_s, self.clock = store, timeout_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # replica -> (count, when it moved)

    def dead(self, replica: int) -> bool:
        value, now = count(self.store, key("hb", replica)), self.clock()
        last = self._seen.get(replica)
        if last is None or last[0] != value:
            self._seen[replica] = (value, now)
            return False
        return now - last[1] > self.timeout_s


def wait_count(store, name: str, at_least: int, timeout_s: float, what: str,
               poll_s: float = 0.005) -> int:
    """Poll the counter ``name`` until it reaches ``at_least``; a clear error after
    ``timeout_s`` naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = count(store, name)
        if value >= at_least:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"paddle_hsdp.ft: waited {timeout_s:g} s for {what}")
        time.sleep(poll_s)
