"""Gradient reductions across units: the reduce-scatters in flight (one unit's while the
next unit's backward computes) and the step boundary's outer syncs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..comm import collectives as comm
from . import offload
from .context import context
from .outer_sync import finish_outer_syncs, schedule_of
from .pending import PendingReduce, settle
from .states import GradState

if TYPE_CHECKING:
    from .buffer import ShardBuffer

# The reduce-scatters issued and not waited for yet (one unit's, across all units) are
# ``context.reduces``. An entry leaves the list only to be waited for
# (finish_reduce_scatter waits first), so an error anywhere leaves the rest there for
# the next wait or for drop_pending_reduces.


def track(buf: ShardBuffer, pending: PendingReduce) -> None:
    """``buf``'s reduce-scatter was issued: in flight until a wait takes it."""
    context.reduces.append((buf, pending))


def in_flight() -> int:
    """How many reduce-scatters are in flight."""
    return len(context.reduces)


def wait_pending_reduces() -> None:
    """Wait for every reduce-scatter in flight and accumulate its result."""
    while context.reduces:
        _finish_first()


def finish_transferred_reduces() -> None:
    """Accumulate the reduce-scatters in flight whose transfer is over, oldest first,
    without waiting for any: their inputs go back to the staging pool, where the next
    unit's grad grid finds one. On gloo that is every one (its emulation exchanges at
    the issue); on a device none, so they keep overlapping the next unit's backward
    (with a second grid). Never decided by timing: accumulating one lets its outer
    sync be issued (outer_sync.py), and the order of collectives across groups must
    not differ between ranks."""
    reduces = context.reduces
    while reduces and reduces[0][1].handle.transferred():
        _finish_first()


def _finish_first() -> None:
    buf, pending = context.reduces.pop(0)
    buf.finish_reduce_scatter(pending)
    schedule = schedule_of(buf.owner)
    if schedule is not None:  # its outer sync may start now (engine/outer_sync.py)
        schedule.reduced(buf)


def drop_pending_reduces() -> None:
    """After a failed backward: wait for the reduce-scatters in flight without using
    their results (their buffers may not be freed before the collective is done)."""
    pending, context.reduces[:] = list(context.reduces), []
    settle(p for _, p in pending)
    for buf, _ in pending:
        buf.grads.abandon_reduce()


def sync_grads(units) -> None:
    """The step boundary for ``units`` (in one global order): their outer all-reduces
    are issued back to back, then waited for and scaled. If anything raises, every
    all-reduce already issued is waited for before the error propagates."""
    for unit in units:  # before any collective: a refusal comes on every rank alike
        unit.check_outer_sync()
    work: list = []
    try:
        for unit in units:
            unit.finish_reductions()
        # offloaded grads: every copy back from the reduce-scatters in, after one wait
        offload.settle_all(b for unit in units for b in unit.buffers)
        for unit in units:
            unit.start_grad_sync(work)
    except BaseException:
        comm.settle(pending.handle for _, pending, _ in work)
        for buf, _, _ in work:  # waited, not landed: taken as synced, as before the wait
            buf.grads.reset(GradState.SYNCED)
        raise
    finish_outer_syncs(work)
