"""A replica group's ranks reach the job's etcd through their leader alone (Paddle-free).

Only the leader (rank 0) of a replica group is a client of the job's etcd: one
:class:`~.kv.JobStore` (and its protocol's :class:`~.protocol.GroupControl`). Its mates
hold a :class:`RelayedStore`, which has the job store's calls (``set``, ``get``,
``add``, ``lease``, ``wait_count``, ``set_part``, ``get_part``, ``failed``) and hands
each one to the leader over the group's own store (the launch job's ``TCPStore``, the
channel :class:`~.store.GroupWatch` already holds): the request under a number the
store's counter gives, the answer under the same number. The leader's :class:`Relay`
thread performs each request with its job store, so waits are its watches (shared by
every mate waiting for the same key), never a poll of etcd, and a group costs etcd what
its leader alone would, whatever its ranks.

A mate's wait stays bounded by its timeout and calls its ``abort()`` between looks at
the group store (a failure announced in the round stops it at once); a wait it gives up
is cancelled on the leader, whose watch then ends once no rank waits for the key. What a
request and its answer leave in the group store is overwritten with nothing once read
(Paddle's store has no delete): a few dozen bytes of keys per request, per launch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .kv import JobStore
from .protocol import Keys
from .trust import UNSIGNED, Signer

logger = logging.getLogger("paddle_hsdp.ft")

PREFIX = "paddle_hsdp/ft/relay"
PAUSE_S, MAX_PAUSE_S = 0.002, 0.05  # a look at the group store, backing off while idle
# a wait on a channel that tells its changes: between two calls of the waiter's abort()
CHANGE_WAIT_S = 0.1
# a mate waits this much longer than the leader's own bound, so the leader's error
# (naming what it waited for) is the one it hears
ANSWER_SLACK_S = 5.0
# how long an answer to a call that does not wait (set, add, lease) may take: the
# leader's etcd client waits up to the round timeout for etcd to come back
CALL_ROUND_TIMEOUTS = 2


class Channel(Protocol):
    """The group's own store as the relay uses it: Paddle's store's ``set``, ``get``
    (of a key known to be written) and ``add`` (``add(key, 0)`` reads a counter)."""

    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, amount: int, /) -> int: ...


def _request_key(seq: int) -> str:
    return f"{PREFIX}/q/{seq}"


def _answer_key(seq: int) -> str:
    return f"{PREFIX}/a/{seq}"


def _written(key: str) -> str:
    return f"{key}/.w"


def _cancel_key(seq: int) -> str:
    return f"{PREFIX}/c/{seq}"


_SEQ = f"{PREFIX}/seq"
# the errors an answer carries by name; anything else arrives as a RuntimeError
_ERRORS: dict[str, type[Exception]] = {"TimeoutError": TimeoutError, "ValueError": ValueError}


class RelayedStore:
    """A mate's job store: every call performed by its group's leader (:class:`Relay`)
    over ``channel``, the group's own store. Same calls as :class:`~.kv.JobStore`."""

    def __init__(self, channel: Channel, job: str, timeout_s: float,
                 signer: Signer = UNSIGNED):
        self.keys, self.timeout_s, self.signer = Keys(job), timeout_s, signer
        self._channel = channel
        # whether a failure of a round was announced (set by the replica)
        self.failed: Callable[[int], bool] = lambda round_number: False
        self.requests = 0  # calls handed to the leader

    def set(self, name: str, value: str | bytes, lease: int = 0) -> None:
        self._ask({"op": "set", "name": name, "lease": lease,
                   "value": value if isinstance(value, str) else value.decode()})

    def lease(self, ttl_s: float) -> int:
        if ttl_s <= 0:  # before anything reaches the leader
            raise ValueError(f"paddle_hsdp.ft: a lease's ttl_s must be > 0, got {ttl_s}")
        return int(self._ask({"op": "lease", "ttl_s": ttl_s}))

    def add(self, name: str, amount: int, lease: int = 0) -> int:
        return int(self._ask({"op": "add", "name": name, "amount": amount, "lease": lease}))

    def get(self, name: str, timeout_s: float | None = None,
            abort: Callable[[], object] | None = None) -> bytes:
        timeout_s = timeout_s or self.timeout_s
        return str(self._ask({"op": "get", "name": name, "timeout_s": timeout_s},
                             timeout_s, abort)).encode()

    def wait_count(self, name: str, at_least: int, timeout_s: float, what: str,
                   abort: Callable[[], object] | None = None) -> int:
        return int(self._ask({"op": "wait_count", "name": name, "at_least": at_least,
                              "timeout_s": timeout_s, "what": what}, timeout_s, abort))

    def set_part(self, name: str, part: int, parts: int, value: str) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"paddle_hsdp.ft: part must be in [0, {parts}), got {part}")
        self._ask({"op": "set_part", "name": name, "part": part, "parts": parts,
                   "value": value})

    def get_part(self, name: str, part: int, timeout_s: float | None = None,
                 abort: Callable[[], object] | None = None) -> bytes:
        timeout_s = timeout_s or self.timeout_s
        return str(self._ask({"op": "get_part", "name": name, "part": part,
                              "timeout_s": timeout_s}, timeout_s, abort)).encode()

    def _ask(self, request: dict, timeout_s: float | None = None,
             abort: Callable[[], object] | None = None) -> Any:
        """Hand ``request`` to the leader and wait for its answer (``abort()`` between
        looks: when it raises, the leader is told to stop waiting for this one)."""
        channel = self._channel
        seq = int(channel.add(_SEQ, 1))
        channel.set(_request_key(seq), json.dumps(request))
        channel.add(_written(_request_key(seq)), 1)
        self.requests += 1
        bound = (timeout_s if timeout_s is not None
                 else CALL_ROUND_TIMEOUTS * self.timeout_s) + ANSWER_SLACK_S
        deadline, pause = time.monotonic() + bound, PAUSE_S
        # a channel that tells its changes (MemoryChannel) is waited on, not polled
        changes = getattr(channel, "changes", None)
        while True:
            since = changes() if changes is not None else 0
            if int(channel.add(_written(_answer_key(seq)), 0)):
                break
            try:
                if abort is not None:
                    abort()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"paddle_hsdp.ft: this group's leader did not answer "
                                       f"a {request['op']} of {request.get('name', '')} "
                                       f"within {bound:g} s")
            except BaseException:
                channel.add(_cancel_key(seq), 1)
                raise
            if changes is not None:
                channel.wait_change(since, CHANGE_WAIT_S)  # type: ignore[attr-defined]
            else:
                time.sleep(pause)
                pause = min(2 * pause, MAX_PAUSE_S)
        answer = json.loads(channel.get(_answer_key(seq)))
        channel.set(_answer_key(seq), "")  # read: its bytes go (a rejoin's metadata)
        if "error" in answer:
            raise _ERRORS.get(answer["error"], RuntimeError)(answer["text"])
        return answer["ok"]


class Relay:
    """The leader's thread that performs its mates' requests with ``store`` (the group's
    one client of etcd) and answers them over ``channel``. Each request runs on a
    thread of its own (a wait may last a round timeout), the channel shared under a
    lock (Paddle's store client is not shared between threads otherwise)."""

    def __init__(self, store: JobStore, channel: Channel, looks: bool = True):
        self.store, self._channel = store, channel
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen = 0  # the highest request number taken from the counter
        self._unwritten: set[int] = set()  # numbered, not written yet
        self._running: dict[int, threading.Event] = {}  # request -> cancelled
        self.served = 0
        # ``looks=False``: no thread of its own; its owner calls :meth:`look` (the
        # simulator: one thread looks at every group's, not a thread per group)
        self._thread: threading.Thread | None = None
        if looks:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="paddle_hsdp-ft-relay")
            self._thread.start()

    def _call(self, op: str, *args: object) -> Any:
        with self._lock:
            return getattr(self._channel, op)(*args)

    def _run(self) -> None:
        pause = PAUSE_S
        while not self._stop.wait(pause):
            pause = PAUSE_S if self.look() else min(2 * pause, MAX_PAUSE_S)

    def look(self) -> bool:
        """Take the requests the mates wrote since the last look (each served on a
        thread of its own): whether there were any."""
        try:
            return self._tick()
        except Exception as e:  # noqa: BLE001 - the group's store is going: next look
            logger.debug("paddle_hsdp.ft relay: %s", e)
            return False

    def _tick(self) -> bool:
        top = int(self._call("add", _SEQ, 0))
        self._unwritten.update(range(self._seen + 1, top + 1))
        self._seen = max(self._seen, top)
        started = False
        for seq in sorted(self._unwritten):
            if not int(self._call("add", _written(_request_key(seq)), 0)):
                continue  # numbered by its mate, not written yet
            self._unwritten.discard(seq)
            request = json.loads(self._call("get", _request_key(seq)))
            self._call("set", _request_key(seq), "")
            cancelled = self._running[seq] = threading.Event()
            threading.Thread(target=self._serve, args=(seq, request, cancelled),
                             daemon=True, name="paddle_hsdp-ft-relay-call").start()
            started = True
        for seq, cancelled in list(self._running.items()):
            if not cancelled.is_set() and int(self._call("add", _cancel_key(seq), 0)):
                cancelled.set()
        return started

    def _serve(self, seq: int, request: dict, cancelled: threading.Event) -> None:
        def abort() -> None:
            if cancelled.is_set() or self._stop.is_set():
                raise _Cancelled()
        try:
            answer = {"ok": perform(self.store, request, abort)}
        except _Cancelled:
            answer = {"error": "Cancelled", "text": "cancelled: the mate stopped waiting, "
                                                    "or the relay stopped"}
        except Exception as e:  # noqa: BLE001 - handed to the mate
            answer = {"error": type(e).__name__, "text": str(e)}
        finally:
            self._running.pop(seq, None)
        try:
            self._call("set", _answer_key(seq), json.dumps(answer))
            self._call("add", _written(_answer_key(seq)), 1)
            self.served += 1
        except Exception as e:  # noqa: BLE001 - the group's store is gone: so is the mate
            logger.debug("paddle_hsdp.ft relay: answer %d: %s", seq, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _Cancelled(Exception):
    """The mate stopped waiting (its abort raised, or its timeout passed)."""


def perform(store: JobStore, request: dict, abort: Callable[[], object]) -> Any:
    """One mate's request, done with the leader's job store."""
    op, name = request["op"], request.get("name", "")
    if op == "set":
        store.set(name, request["value"], request["lease"])
        return None
    if op == "lease":
        return store.lease(float(request["ttl_s"]))
    if op == "add":
        return store.add(name, int(request["amount"]), int(request["lease"]))
    if op == "get":
        return store.get(name, float(request["timeout_s"]), abort).decode()
    if op == "wait_count":
        return store.wait_count(name, int(request["at_least"]), float(request["timeout_s"]),
                                str(request["what"]), abort)
    if op == "set_part":
        store.set_part(name, int(request["part"]), int(request["parts"]), request["value"])
        return None
    if op == "get_part":
        return store.get_part(name, int(request["part"]), float(request["timeout_s"]),
                              abort).decode()
    raise ValueError(f"paddle_hsdp.ft relay: unknown request {op!r} (set, lease, add, get, "
                     "wait_count, set_part, get_part)")


class MemoryChannel:
    """A group store in this process (tests, the simulator): Paddle's store's calls,
    and what Paddle's store lacks, a wait for a change (:meth:`changes`,
    :meth:`wait_change`), so a mate waits for its answer without polling;
    ``on_write`` is called after each write (the simulator: which relay to look at),
    outside the channel's lock."""

    def __init__(self, on_write: Callable[[], None] | None = None) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition(threading.Lock())
        self._version = 0  # writes so far
        self._on_write = on_write
        self.requests = 0

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self.requests += 1
            self._values[key] = value.encode() if isinstance(value, str) else value
            self._wrote()
        if self._on_write is not None:
            self._on_write()

    def get(self, key: str) -> bytes:
        with self._changed:
            self.requests += 1
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            self.requests += 1
            total = int(self._values.get(key, b"0")) + amount
            if not amount:  # a read
                return total
            self._values[key] = str(total).encode()
            self._wrote()
        if self._on_write is not None:
            self._on_write()
        return total

    def _wrote(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def changes(self) -> int:
        """How many writes so far (what :meth:`wait_change` waits past)."""
        with self._changed:
            return self._version

    def wait_change(self, since: int, timeout_s: float) -> None:
        """Return once a write came after ``since`` writes, or after ``timeout_s``."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != since, timeout_s)
