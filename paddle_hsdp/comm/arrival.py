"""Collective entry points called on some ranks only: named, within the watchdog bound.

``state_dict()`` of a sharded model, ``full_state_dict``, ``full_grads`` and the
checkpoint calls are collectives that scripts often call under ``if rank == 0``. Their
first collective would then pair with whatever the other ranks do next (gloo aborts a
peer, NCCL hangs), and the error names neither the call nor the cause. These calls are
off the hot path, so before its first collective each one checks, on the job's TCP store
(no collective, so nothing can pair wrongly), that every member of its group arrived at
the same call: each member counts itself under a key made of the group id and its count
of such calls, and the last to arrive marks the call complete. One that does not see it
complete within ``PADDLE_HSDP_COLLECTIVE_TIMEOUT`` seconds (the watchdog's bound) raises
:class:`CollectiveMismatchError` naming the call and how many ranks arrived, and takes
its arrival back, so the model is unchanged and a later call on every rank works.

Cost, whatever the group's size: two store requests per rank per call, an add and a
blocking wait for the mark (issued by a thread on a store client of the process's own:
Paddle's ``wait`` has no timeout, so the caller bounds the thread instead, and a client
left waiting after a refusal is replaced). Nothing polls the store, whose one server
thread on rank 0 would otherwise take every waiting rank's polls (tens of thousands a
second at 8,192 ranks). The client is made once, on a thread within the bound, and used
only once it sees a key set through the job's store (``PADDLE_MASTER``, as Paddle finds
its store); where it cannot be made or reaches another store, the check polls with a
backoff instead. A refusal leaves a daemon thread waiting on a dropped client.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Callable

import paddle.distributed as dist
from paddle.base import core

from . import watchdog
from .gather_tags import CollectiveMismatchError

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

_KEY = "paddle_hsdp/arrival"
_calls: dict[int, int] = defaultdict(int)  # group id -> calls checked so far


def _store() -> core.Store:
    return core.create_or_get_global_tcp_store()


def expect_everyone(group: Group | None, what: str) -> None:
    """Wait until every member of ``group`` (None: the world) reached this call, or
    raise ``CollectiveMismatchError`` after the watchdog bound. No-op alone, and when
    the watchdog is off (``PADDLE_HSDP_COLLECTIVE_TIMEOUT=0``)."""
    ranks = list(range(dist.get_world_size())) if group is None else list(group.ranks)
    group_id = 0 if group is None else group.id
    limit = watchdog.timeout_s()
    if len(ranks) <= 1 or limit <= 0:
        return
    number = _calls[group_id]
    key = f"{_KEY}/{group_id}/{number}"
    store = _store()
    arrived = store.add(key, 1)
    if arrived >= len(ranks):
        store.set(key + "/complete", "1")
    elif not _await_key(key + "/complete", limit, lambda: store.add(key, 0) >= len(ranks)):
        arrived = store.add(key, -1) + 1  # taken back: the next agreed call reuses the key
        if arrived >= len(ranks):  # the last came between the bound and the take-back,
            store.add(key, 1)      # and went on into the collective: so does this rank
        else:
            raise CollectiveMismatchError(
                f"{what} is a collective over ranks {ranks}, and only {arrived} of them "
                f"(this rank, {dist.get_rank()}, among them) called it within {limit:g} s "
                "(PADDLE_HSDP_COLLECTIVE_TIMEOUT). Call it on every rank (not under `if "
                "rank == 0`; save from one rank after it returns on all). Nothing was "
                "sent; the model is unchanged.")
    _calls[group_id] = number + 1


# The store client this process's waits go through, once it is known to reach the
# job's store (None: it does not, poll instead). Module state: one per process, dropped
# when a refusal leaves a thread waiting on it.
_waiter: list = []


def _await_key(key: str, limit: float, done_by_polling: Callable[[], bool]) -> bool:
    """Whether ``key`` is set in the job's store within ``limit`` seconds: one blocking
    wait on a thread (``done_by_polling``, polled with a backoff, where no client of
    our own reaches the store)."""
    client = _waiting_client(limit)
    if client is None:
        return _poll(limit, done_by_polling)
    finished = threading.Event()

    def wait():
        try:
            client.wait(key)
            finished.set()
        except Exception:  # noqa: BLE001 - the store went away: the caller times out
            pass
    threading.Thread(target=wait, daemon=True, name="paddle_hsdp-arrival").start()
    if finished.wait(limit):
        return True
    _waiter.clear()  # its thread still waits on it: the next call makes another
    return finished.is_set()


def _waiting_client(limit: float) -> core.TCPStore | None:
    """This process's waiting client, made (on a thread, within ``min(limit, 10 s)``)
    and checked to be the job store's: it must see a key set through that store."""
    if _waiter:
        return _waiter[0]
    endpoint = _endpoint()
    made: list = []
    if endpoint is not None:
        probe = f"{_KEY}/probe/{dist.get_rank()}"
        _store().set(probe, "1")

        def connect():
            try:
                client = core.TCPStore(endpoint[0], endpoint[1], False,
                                       dist.get_world_size(), 900)
                client.wait(probe)  # another store never has it: this never returns
                made.append(client)
            except Exception:  # noqa: BLE001 - unreachable: poll instead
                pass
        thread = threading.Thread(target=connect, daemon=True, name="paddle_hsdp-arrival")
        thread.start()
        thread.join(min(limit, 10.0))
    _waiter.append(made[0] if made else None)
    return _waiter[0]


def _endpoint() -> tuple[str, int] | None:
    """The job store's address, found as Paddle's global store finds it (PADDLE_MASTER,
    else the first trainer endpoint; MASTER_ADDR may be the launcher's own server)."""
    endpoint = os.getenv("PADDLE_MASTER") or \
        (os.getenv("PADDLE_TRAINER_ENDPOINTS") or "").split(",")[0]
    host, _, port = (endpoint or "").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _poll(limit: float, done: Callable[[], bool]) -> bool:
    deadline, pause = time.monotonic() + limit, 0.001
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True
