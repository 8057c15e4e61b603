"""Collective entry points called on some ranks only: named, within the watchdog bound.

``state_dict()`` of a sharded model, ``full_state_dict``, ``full_grads`` and the
checkpoint calls are collectives that scripts often call under ``if rank == 0``. Their
first collective would then pair with whatever the other ranks do next (gloo aborts a
peer, NCCL hangs), and the error names neither the call nor the cause. These calls are
off the hot path, so before its first collective each one checks, on the job's TCP store
(no collective, so nothing can pair wrongly), that every member of its group arrived at
the same call: each member counts itself under a key made of the group id and its count
of such calls. One that does not see every member within ``PADDLE_HSDP_COLLECTIVE_TIMEOUT``
seconds (the watchdog's bound) raises :class:`CollectiveMismatchError` naming the call
and how many ranks arrived, and takes its arrival back, so the model is unchanged and a
later call on every rank works. Cost: one store round trip per call (~40 ms on Paddle's
TCP store here) for the last rank to arrive, polls for the others while they would wait
anyway; these calls are off the training path.
"""

from __future__ import annotations

import time
from collections import defaultdict

import paddle.distributed as dist
from paddle.base import core

from . import watchdog
from .gather_tags import CollectiveMismatchError

_KEY = "paddle_hsdp/arrival"
_calls: dict[int, int] = defaultdict(int)  # group id -> calls checked so far


def _store():
    return core.create_or_get_global_tcp_store()


def expect_everyone(group, what: str) -> None:
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
    # One store round trip for the last rank to arrive (a read-modify-write answers in
    # ~40 ms on this store, a set in microseconds); the others poll until it is there,
    # time they would spend waiting in the collective anyway.
    arrived = store.add(key, 1)
    deadline, pause = time.monotonic() + limit, 0.001
    while arrived < len(ranks):
        if time.monotonic() > deadline:
            store.add(key, -1)  # taken back: the next agreed call reuses the key
            raise CollectiveMismatchError(
                f"{what} is a collective over ranks {ranks}, and only {arrived} of them "
                f"(this rank, {dist.get_rank()}, among them) called it within {limit:g} s "
                "(PADDLE_HSDP_COLLECTIVE_TIMEOUT). Call it on every rank (not under `if "
                "rank == 0`; save from one rank after it returns on all). Nothing was "
                "sent; the model is unchanged.")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)
    _calls[group_id] = number + 1
