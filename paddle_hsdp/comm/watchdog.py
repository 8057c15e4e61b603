"""A bound on how long any collective may take: no rank waits forever for a dead peer.

A peer that *dies* makes gloo fail the next collective within seconds (its connection
closes): :mod:`paddle_hsdp.comm.collectives` turns that into a ``CollectiveError`` naming the
operation and the group. A peer that *hangs* (stuck in a loop, a deadlock, a paused
host) closes nothing, and NCCL waits for a dead peer too: then every blocking
collective this package issues is watched by a daemon thread, and one that has not
finished after ``PADDLE_HSDP_COLLECTIVE_TIMEOUT`` seconds (default 300; 0 turns the
watchdog off) makes the rank print what it was waiting for and exit with status 124,
so the launcher ends the job. Backends release the GIL while they wait, so the thread
runs while the main thread is blocked.

On NCCL, ``wait()`` returns at once (it makes the compute stream wait for the
collective's event), so a dead peer blocks the next *host read* of the device instead:
paddle_hsdp's own host reads (the step boundary's tag-flag read, the clip norm it reports,
the checkpoint exchanges) run under :func:`host_sync`, which the same bound watches and
whose message names the last collectives issued. Host reads in user code (``loss.item()``)
are not ours to watch: Paddle's own process-group timeout (``PADDLE_PG_TIMEOUT``,
milliseconds, default 30 minutes) is what bounds them there.

Cost: a dict insert and delete and a clock read per collective, and a deque append; the
thread wakes every few seconds.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from .state import state

EXIT_STATUS = 124
# token -> (when it started, what describes it: called only for the message)
_inflight: dict[int, tuple[float, Callable[[], str]]] = {}
_ids = itertools.count()
_lock = threading.Lock()
# The last collectives issued (their descriptions, built only if a message needs them):
# on NCCL, wait() only orders streams and returns at once, so a dead peer blocks the
# next host read of the device instead; host_sync names these as what it waits for.
_issued: deque[Callable[[], str]] = deque(maxlen=4)


def timeout_s() -> float:
    """The bound, from ``PADDLE_HSDP_COLLECTIVE_TIMEOUT`` (seconds; 0: no watchdog)."""
    try:
        value = float(os.environ.get("PADDLE_HSDP_COLLECTIVE_TIMEOUT", "300"))
    except ValueError:
        raise ValueError("PADDLE_HSDP_COLLECTIVE_TIMEOUT must be a number of seconds (0 "
                         "turns the watchdog off), got "
                         f"{os.environ['PADDLE_HSDP_COLLECTIVE_TIMEOUT']!r}") from None
    if value < 0:
        raise ValueError(f"PADDLE_HSDP_COLLECTIVE_TIMEOUT must be >= 0, got {value}")
    return value


@contextmanager
def watched(describe: Callable[[], str]) -> Iterator[None]:
    """Run the body under the watchdog; ``describe()`` names it if it times out."""
    limit = timeout_s()
    if limit <= 0:
        yield
        return
    _ensure_thread(limit)
    token = next(_ids)
    _inflight[token] = (time.monotonic(), describe)
    try:
        yield
    finally:
        _inflight.pop(token, None)


def note_issued(describe: Callable[[], str]) -> None:
    """Remember a collective just issued (``describe()`` names it; not called now)."""
    _issued.append(describe)


@contextmanager
def host_sync(what: str) -> Iterator[None]:
    """A host read of the device (``.numpy()``, ``.item()``, ``bool()``) under the same
    bound as a blocking collective. On gloo the collectives before it are complete
    already; on NCCL the read waits for every collective queued before it, so a dead or
    absent peer blocks here: the message names the read and the last collectives."""
    def describe() -> str:
        last = "; ".join(d() for d in _issued) or "none"
        return (f"{what} (a host read: on NCCL it waits for the collectives queued before "
                f"it, the last ones: {last})")
    with watched(describe):
        yield


def _ensure_thread(limit: float) -> None:
    with _lock:
        if state.watchdog_thread is None or not state.watchdog_thread.is_alive():
            state.watchdog_thread = threading.Thread(target=_watch, args=(limit,), daemon=True,
                                       name="paddle_hsdp-watchdog")
            state.watchdog_thread.start()


def _watch(limit: float) -> None:
    tick = min(5.0, max(limit / 10, 0.05))
    while True:
        time.sleep(tick)
        now = time.monotonic()
        for start, describe in list(_inflight.values()):
            if now - start > limit:
                _expire(describe, now - start)


def _expire(describe: Callable[[], str], waited: float) -> None:
    try:
        what = describe()
    except Exception as e:  # never let a message stop the exit
        what = f"a collective ({type(e).__name__} while describing it)"
    rank = os.environ.get("PADDLE_TRAINER_ID", "?")
    sys.stderr.write(
        f"paddle_hsdp watchdog (rank {rank}): {what} has not finished after {waited:.0f} s "
        f"(PADDLE_HSDP_COLLECTIVE_TIMEOUT={timeout_s():g}): a rank of the group died or "
        f"hangs. Exiting with status {EXIT_STATUS} so the job ends instead of hanging; "
        "restart it from the last checkpoint.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_STATUS)
