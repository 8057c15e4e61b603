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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from .etcd import Etcd, Security
from .protocol import Keys
from .trust import UNSIGNED, Signer

_T = TypeVar("_T")


class Counters(Protocol):
    """A store of counters: Paddle's store's ``add`` (``add(name, 0)`` reads one without
    blocking). :class:`JobStore` and the group's :class:`~.store.GroupWatch` are."""

    def add(self, name: str, amount: int) -> int: ...


class JobStore:
    """One rank's client of the job's shared data (``timeout_s``: a ``get``'s bound)."""

    def __init__(self, address: str, job: str, timeout_s: float,
                 security: Security | None = None, signer: Signer = UNSIGNED):
        self.etcd = Etcd(address, security=security, away_s=timeout_s)
        self.keys, self.timeout_s, self.signer = Keys(job), timeout_s, signer
        # whether a failure of a round was announced (set by the replica)
        self.failed: Callable[[int], bool] = lambda round_number: False

    def _key(self, name: str) -> str:
        return f"{self.keys.root}kv/{name}"

    def set(self, name: str, value: str | bytes, lease: int = 0) -> None:
        """Write ``name`` (signed with the job's secret, if any); with ``lease``
        (:meth:`lease`), etcd deletes it when the lease ends."""
        key = self._key(name)
        self.etcd.put(key, self.signer.sign(
            key, value if isinstance(value, str) else value.decode()), lease)

    def lease(self, ttl_s: float) -> int:
        """A new lease that ends by itself after ``ttl_s`` seconds (never renewed): what
        ``set`` and ``add`` attach a key to so that it goes once nobody reads it."""
        if ttl_s <= 0:
            raise ValueError(f"paddle_hsdp.ft: a lease's ttl_s must be > 0, got {ttl_s}")
        return self.etcd.grant(max(2, math.ceil(ttl_s)))

    def get(self, name: str, timeout_s: float | None = None,
            abort: Callable[[], object] | None = None) -> bytes:
        """``name``'s value once written (within ``timeout_s``, default the store's:
        TimeoutError); ``abort()`` is called while it waits (it raises to stop)."""
        key = self._key(name)
        return poll_until(lambda: self.signer.check(key, self.etcd.get(key)),
                          timeout_s or self.timeout_s, f"{name} to be written (by a "
                          "writer with the job's secret, if it has one)", abort).encode()

    def add(self, name: str, amount: int, lease: int = 0) -> int:
        """Add ``amount`` to the counter ``name`` (0 if never written); its new value.
        With ``lease``, the counter is attached to it from this write on."""
        key = self._key(name)
        while True:
            value, revision = self.etcd.get_revision(key)
            total = int(value or 0) + amount
            if amount == 0 or self.etcd.swap(key, revision, str(total), lease):
                return total


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
    it reaches ``at_least``, polled as :func:`poll_until` does."""
    def reached() -> int | None:
        value = int(store.add(name, 0))  # add 0: a read that never blocks
        return value if value >= at_least else None
    return poll_until(reached, timeout_s, what, abort)
