"""The job's shared data on etcd, as the data plane's helpers use it (Paddle-free).

A round's outer groups publish their rendezvous address here, a donor its transfer's
metadata, the live groups a joint checkpoint's commit records (:mod:`.groups`,
:mod:`.transfer`, :mod:`.joint_save`): ``set``, ``get`` (waits until written, bounded,
and stops once ``abort()`` raises) and ``add`` (an atomic counter: a compare-and-swap
transaction), under ``/paddle_hsdp/ft/<job>/kv/``. Each is a few requests per rank per
round, never per step; whether a round failed is read from ``failed``, which the
replica sets (its group's own flag, :class:`~.store.GroupWatch`).

With the job's secret (:mod:`.trust`) every value ``set`` writes is signed and ``get``
takes only a value whose signature holds: a forged one (a group-store address pointing
elsewhere, a rejoin's metadata, a joint save's record) is named in the log and waited
past, as if not written yet. Counters (``add``) are not signed: a forged count can stop
a save or a transfer's wait (bounded by its timeout), not steer either.

**Keys that go away.** A round's keys (named by :func:`~.protocol.round_kv`) are
deleted by the decider of the round two later (:meth:`~.protocol.GroupControl._forget`);
a joint save's are written with a lease that ends by itself once every reader's wait
is over (:mod:`.joint_save`). So the shared data holds a few rounds' keys whatever the
job's length.

**One client per replica group.** Only a group's leader holds a :class:`JobStore`;
its other ranks reach it through the group's own store (:mod:`.relay`). A wait
(``get``, :meth:`JobStore.wait_count`) reads the key once and, if it is not there yet,
watches it from the revision of that read (nothing is missed; no poll of etcd), or,
for a round's value every group waits for (its outer groups' addresses, a receiver's
receipts: under the round's ``ctl/<n>/kv/``, :meth:`~.protocol.Keys.shared_data`),
hears it from the group's one watch (no stream of its own); the
ranks of a group waiting for the same key share one wait, and a value once read is
kept (a few dozen, a few MB at most), so a group's ranks cost etcd what its leader
alone would. Values a round needs from each local rank (a group-store address per
outer group, a receiver's receipt per local rank) go as *parts* of one value per group
(:meth:`JobStore.set_part`, :meth:`JobStore.get_part`): one request per group, not
one per rank.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

from .etcd import Etcd, Security, Watch, _b64, _text
from .protocol import Keys
from .trust import UNSIGNED, Signer

_T = TypeVar("_T")


class Counters(Protocol):
    """A store of counters: Paddle's store's ``add`` (``add(name, 0)`` reads one without
    blocking). :class:`JobStore` and the group's :class:`~.store.GroupWatch` are."""

    def add(self, name: str, amount: int) -> int: ...


class SharedData(Protocol):
    """What the data plane's helpers (:mod:`.groups`, :mod:`.transfer`,
    :mod:`.joint_save`) call on the job's shared data: a leader's :class:`JobStore`,
    or a mate's :class:`~.relay.RelayedStore` (the same calls, through its leader)."""

    keys: Keys
    timeout_s: float
    signer: Signer
    failed: Callable[[int], bool]

    def set(self, name: str, value: str | bytes, lease: int = 0) -> None: ...
    def lease(self, ttl_s: float) -> int: ...
    def add(self, name: str, amount: int, lease: int = 0) -> int: ...
    def get(self, name: str, timeout_s: float | None = None,
            abort: Callable[[], object] | None = None) -> bytes: ...
    def wait_count(self, name: str, at_least: int, timeout_s: float, what: str,
                   abort: Callable[[], object] | None = None) -> int: ...
    def set_part(self, name: str, part: int, parts: int, value: str) -> None: ...
    def get_part(self, name: str, part: int, timeout_s: float | None = None,
                 abort: Callable[[], object] | None = None) -> bytes: ...


class JobStore:
    """The leader's client of the job's shared data (``timeout_s``: a ``get``'s bound),
    for its own rank and, through :class:`~.relay.Relay`, for its mates. Safe to use
    from several threads: requests go one at a time over one connection, which the
    group's protocol shares (``GroupControl(shared=store.etcd)``); a wait for a round's
    value every group waits for is heard from the protocol's one watch (2 connections
    to etcd per group), the waits for other keys share ONE watch of the store's (one
    more connection while any waits): it watches one key at a time, the oldest wait's,
    and moves on to the next once that wait ends (:meth:`_watch_next`). A rejoin's
    receiver, whose G ranks each wait for their own metadata key, so holds 3
    connections, not 2 + G; a wait whose key is written while an older wait's is not
    is read once that one ends (its value, or its timeout)."""

    # a value read once is kept for the group's other ranks: at most this many values
    # and bytes (a rejoin's metadata is a few hundred KB per local rank)
    CACHED_VALUES, CACHED_BYTES = 64, 16 << 20
    PARTS_KEPT = 64  # values being assembled from parts (a dead rank's never complete)

    def __init__(self, address: str, job: str, timeout_s: float,
                 security: Security | None = None, signer: Signer = UNSIGNED):
        self.etcd = Etcd(address, security=security, away_s=timeout_s)
        self.keys, self.timeout_s, self.signer = Keys(job), timeout_s, signer
        # whether a failure of a round was announced (set by the replica)
        self.failed: Callable[[int], bool] = lambda round_number: False
        self._calls = threading.Lock()  # one request at a time: one connection
        self._waits_lock = threading.Lock()
        self._waits: dict[tuple, _KeyWait] = {}  # (name, at least) -> the shared wait
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._counts: OrderedDict[str, int] = OrderedDict()  # counters seen, their values
        self._parts: OrderedDict[str, dict[int, str]] = OrderedDict()
        self.watches = 0  # watches made for waits (each a connection while it waits)
        self._watching: _KeyWait | None = None  # the wait the store's one watch serves
        # waits whose key was not written at their first read, for the watch in turn
        self._parked: list[tuple[_KeyWait, str, Callable[[str | None], str | None]]] = []

    def _key(self, name: str) -> str:
        return self.keys.shared_data(name)

    def set(self, name: str, value: str | bytes, lease: int = 0) -> None:
        """Write ``name`` (signed with the job's secret, if any); with ``lease``
        (:meth:`lease`), etcd deletes it when the lease ends."""
        key = self._key(name)
        signed = self.signer.sign(key, value if isinstance(value, str) else value.decode())
        with self._calls:
            self.etcd.put(key, signed, lease)

    def lease(self, ttl_s: float) -> int:
        """A new lease that ends by itself after ``ttl_s`` seconds (never renewed): what
        ``set`` and ``add`` attach a key to so that it goes once nobody reads it."""
        if ttl_s <= 0:
            raise ValueError(f"paddle_hsdp.ft: a lease's ttl_s must be > 0, got {ttl_s}")
        with self._calls:
            return self.etcd.grant(max(2, math.ceil(ttl_s)))

    def get(self, name: str, timeout_s: float | None = None,
            abort: Callable[[], object] | None = None) -> bytes:
        """``name``'s value once written (within ``timeout_s``, default the store's:
        TimeoutError); ``abort()`` is called while it waits (it raises to stop)."""
        with self._waits_lock:
            if name in self._cache:
                self._cache.move_to_end(name)
                return self._cache[name]
        key = self._key(name)
        text = self._wait((name, None), lambda raw: self.signer.check(key, raw),
                          timeout_s, f"{name} to be written (by a writer with the job's "
                          "secret, if it has one)", abort)
        value = text.encode()
        with self._waits_lock:
            self._cache[name] = value
            while len(self._cache) > self.CACHED_VALUES or \
                    sum(map(len, self._cache.values())) > self.CACHED_BYTES:
                self._cache.popitem(last=False)
        return value

    def wait_count(self, name: str, at_least: int, timeout_s: float, what: str,
                   abort: Callable[[], object] | None = None) -> int:
        """The counter ``name`` once it reaches ``at_least`` (a watch of it, as ``get``
        waits; TimeoutError naming ``what`` after ``timeout_s``)."""
        with self._waits_lock:  # a counter only grows: one seen high enough stays so
            seen = self._counts.get(name, 0)
        if seen >= at_least:
            return seen

        def reached(raw: str | None) -> str | None:
            return raw if raw is not None and int(raw or 0) >= at_least else None
        value = int(self._wait((name, at_least), reached, timeout_s, what, abort))
        with self._waits_lock:
            self._counts[name] = max(value, self._counts.pop(name, 0))
            while len(self._counts) > self.CACHED_VALUES:
                self._counts.popitem(last=False)
        return value

    def _wait(self, wanted: tuple, accept: Callable[[str | None], str | None],
              timeout_s: float | None, what: str,
              abort: Callable[[], object] | None) -> str:
        """The first value of key ``wanted[0]`` that ``accept`` takes (it returns the
        value, or None for "not yet"): read once, then watched from that read's
        revision. Waiters of the same ``wanted`` share one read and one watch."""
        timeout_s = timeout_s or self.timeout_s
        with self._waits_lock:
            wait = self._waits.get(wanted)
            first = wait is None
            if wait is None:
                wait = self._waits[wanted] = _KeyWait()
            wait.users += 1
        try:
            if first:
                self._start(wait, self._key(wanted[0]), accept)
            try:
                return wait.result(timeout_s, what, abort)
            except TimeoutError as timed_out:
                # a parked wait hears nothing until the store's watch comes to it: its
                # key may have been written meanwhile, so one last read before giving up
                # (the timeout stands if that read fails too: etcd away)
                try:
                    late, _ = self._read_once(self._key(wanted[0]), accept)
                except Exception:  # noqa: BLE001
                    raise timed_out from None
                if late is None:
                    raise
                return late
        finally:
            with self._waits_lock:
                wait.users -= 1
                last = wait.users == 0
                if last and self._waits.get(wanted) is wait:
                    del self._waits[wanted]
            if last:
                self._release(wait)

    def _start(self, wait: _KeyWait, key: str, accept: Callable[[str | None], str | None]
               ) -> None:
        try:
            # a key the group's one watch carries (Keys.shared_data): heard from it, no
            # watch of its own; listened to before the read, so nothing falls between
            if self.etcd.relays(key):
                wait.unlisten = self.etcd.listen(key, _on_put(wait, key, accept))
            self._read_or_watch(wait, key, accept)
        except BaseException as e:  # noqa: BLE001 - every waiter of it hears it
            wait.done(None, e)

    def _read_once(self, key: str, accept: Callable[[str | None], str | None]
                   ) -> tuple[str | None, int]:
        """``key``'s value as ``accept`` takes it (None: not yet), and the read's
        revision."""
        with self._calls:
            found = self.etcd.call("kv/range", {"key": _b64(key)})
        kvs = found.get("kvs", [])
        return (accept(_text(kvs[0].get("value")) if kvs else None),
                int(found["header"]["revision"]))

    def _read_or_watch(self, wait: _KeyWait, key: str,
                       accept: Callable[[str | None], str | None]) -> bool:
        """Read ``key`` once: its value ends ``wait``; if not there yet, the store's one
        watch watches it from that read's revision (nothing missed) if free or already
        this wait's, else the wait is parked for it. Whether it now watches."""
        value, revision = self._read_once(key, accept)
        if value is not None:
            wait.done(value)
            return False
        if wait.unlisten is not None:
            return False  # heard from the group's watch
        with self._waits_lock:
            if self._watching not in (None, wait):
                self._parked.append((wait, key, accept))
                return False
            self._watching = wait
        self.watches += 1
        wait.watch = self.etcd.watch(key, _on_put(wait, key, accept),
                                     start_revision=revision + 1)
        if wait.stopped:  # its waiters left meanwhile (_release ran before the watch)
            wait.stop()
        return True

    def _release(self, wait: _KeyWait) -> None:
        """``wait``'s last waiter left: its watch or listener goes, and the store's
        watch, if it was this wait's, to the next parked wait."""
        wait.stop()
        with self._waits_lock:
            self._parked = [p for p in self._parked if p[0] is not wait]
            handing = self._watching is wait
            if handing:
                self._watching = None
        if handing:
            self._watch_next()

    def _watch_next(self) -> None:
        """Hand the store's one watch to the oldest parked wait: its key read again (it
        may have been written since its first read) and, if still not there, watched;
        a wait found written ends, and the next is tried."""
        while True:
            with self._waits_lock:
                if self._watching is not None or not self._parked:
                    return
                wait, key, accept = self._parked.pop(0)
                self._watching = wait
            try:
                if self._read_or_watch(wait, key, accept):
                    return
            except BaseException as e:  # noqa: BLE001 - every waiter of it hears it
                wait.done(None, e)
            with self._waits_lock:
                if self._watching is wait:
                    self._watching = None

    def add(self, name: str, amount: int, lease: int = 0) -> int:
        """Add ``amount`` to the counter ``name`` (0 if never written); its new value.
        With ``lease``, the counter is attached to it from this write on."""
        key = self._key(name)
        while True:
            with self._calls:
                value, revision = self.etcd.get_revision(key)
                total = int(value or 0) + amount
                if amount == 0 or self.etcd.swap(key, revision, str(total), lease):
                    return total

    def set_part(self, name: str, part: int, parts: int, value: str) -> None:
        """Part ``part`` (of ``parts``, 0 to parts - 1) of the value ``name``: written
        once every part is in, as one value (JSON, part -> value), so that what each
        local rank of a group publishes in a round costs one request, not one per rank."""
        if not 0 <= part < parts:
            raise ValueError(f"paddle_hsdp.ft: part must be in [0, {parts}), got {part}")
        with self._waits_lock:
            got = self._parts.setdefault(name, {})
            got[part] = value
            if len(got) < parts:
                while len(self._parts) > self.PARTS_KEPT:
                    self._parts.popitem(last=False)
                return
            del self._parts[name]
        self.set(name, json.dumps({str(k): v for k, v in sorted(got.items())}))

    def get_part(self, name: str, part: int, timeout_s: float | None = None,
                 abort: Callable[[], object] | None = None) -> bytes:
        """Part ``part`` of the value ``name`` (:meth:`set_part`), once written."""
        parts = json.loads(self.get(name, timeout_s, abort))
        if str(part) not in parts:
            raise ValueError(f"paddle_hsdp.ft: {name} has no part {part} (it has "
                             f"{sorted(parts, key=int)})")
        return parts[str(part)].encode()


def _on_put(wait: "_KeyWait", key: str, accept: Callable[[str | None], str | None]):
    """A watch's callback: a put of exactly ``key`` that ``accept`` takes ends ``wait``
    (a longer key shares the prefix)."""
    def on_event(kind: str, event_key: str, raw: str, revision: int) -> None:
        if kind == "PUT" and event_key == key:
            taken = accept(raw)
            if taken is not None:
                wait.done(taken)
    return on_event


# a wait with an ``abort`` calls it this often (a leader runs one such wait per mate's
# request: a few; tools/sim_ft.py, a thousand leaders in one machine, raises it)
ABORT_TICK_S = 0.05


class _KeyWait:
    """One wait for a key, shared by every rank of the group that waits for it."""

    def __init__(self) -> None:
        self.users = 0
        self.stopped = False  # its last waiter left (a watch made after is stopped)
        self.watch: Watch | None = None  # the etcd watch, while the value is not there
        self.unlisten: Callable[[], None] | None = None  # or the group's watch's listener
        self._event = threading.Event()
        self._value: str | None = None
        self._error: BaseException | None = None

    def done(self, value: str | None, error: BaseException | None = None) -> None:
        if not self._event.is_set():
            self._value, self._error = value, error
            self._event.set()

    def result(self, timeout_s: float, what: str,
               abort: Callable[[], object] | None) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._event.wait(ABORT_TICK_S if abort is not None else
                                   max(0.0, deadline - time.monotonic())):
            if abort is not None:
                abort()
            if time.monotonic() > deadline:
                raise TimeoutError(f"paddle_hsdp.ft: waited {timeout_s:g} s for {what}")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def stop(self) -> None:
        self.stopped = True
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()
        unlisten, self.unlisten = self.unlisten, None
        if unlisten is not None:
            unlisten()


def poll_until(read: Callable[[], _T | None], timeout_s: float, what: str,
               abort: Callable[[], object] | None = None) -> _T:
    """``read()`` again until it returns something other than None (every 2 ms at
    first, backing off to 50 ms), and return that; ``abort()`` is called between reads
    (it raises to stop waiting); TimeoutError naming ``what`` after ``timeout_s``."""
    deadline, pause = time.monotonic() + timeout_s, 0.002
    while True:
        value = read()
        if value is not None:
            return value
        if abort is not None:
            abort()
        if time.monotonic() > deadline:
            raise TimeoutError(f"paddle_hsdp.ft: waited {timeout_s:g} s for {what}")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def wait_count(store: Counters, name: str, at_least: int, timeout_s: float, what: str,
               abort: Callable[[], object] | None = None) -> int:
    """The counter ``name`` of ``store`` (anything with Paddle's store's ``add``) once
    it reaches ``at_least``: a store with a ``wait_count`` of its own (:class:`JobStore`,
    a mate's :class:`~.relay.RelayedStore`) waits as it does (a watch of etcd, not a
    poll); the group's own store is polled as :func:`poll_until` does."""
    own = getattr(store, "wait_count", None)
    if own is not None:
        return int(own(name, at_least, timeout_s, what, abort))
    def reached() -> int | None:
        value = int(store.add(name, 0))  # add 0: a read that never blocks
        return value if value >= at_least else None
    return poll_until(reached, timeout_s, what, abort)
