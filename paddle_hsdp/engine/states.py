"""The engine's state machines, one enum each, and the check every transition starts
with (as torch FSDP2's ``_assert_in_states``): a call in the wrong order is a traceback
at that call, naming what it found and what it needed, not a wrong sum later.

* :class:`ParamState` — a unit's parameters: sharded, being gathered, gathered.
* :class:`GradState` — a buffer's grad shard within one optimizer step: empty,
  inner-reduced, outer-synced, and the collectives in between.
* :class:`RebuildState` — with outer sub-shards (HFSDP), whether a buffer's flat shard
  holds every replica's latest piece.
* :class:`SyncSchedule` — a root's outer syncs during backward: recording their order,
  waiting, or issuing them early in the step's last backward.
* :class:`EarlyReduce` — within one backward, whether a buffer was reduce-scattered
  before its end (its every parameter had its grad).

Each machine's transitions are a table (:data:`TRANSITIONS`), and every change of a
state goes through :func:`move`, which checks it. Full-size grads that wait for a
reduce-scatter under ``set_requires_gradient_sync(False)`` are the unit's
``full_grads_pending`` (a flag, not a machine: they exist or not).
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class EngineStateError(RuntimeError):
    """An engine call came in a state it cannot run from (an ordering bug)."""


class ParamState(enum.Enum):
    """A unit's parameters."""

    #: the modules hold the shard parameters; no full-size storage exists
    SHARDED = "sharded"
    #: the all-gathers are issued (a prefetch) and not waited for; the modules still
    #: hold the shards, the gathered storage exists
    GATHERING = "gathering"
    #: the full parameters are materialised and the modules hold them
    UNSHARDED = "unsharded"


class GradState(enum.Enum):
    """A buffer's grad shard (its flat grad, or MixPrecisionLayer's main grads) within
    one optimizer step. ``clear_grad`` makes it ``EMPTY`` from any state at rest."""

    #: nothing reduced into it since ``clear_grad`` (zeros, or no storage yet)
    EMPTY = "empty"
    #: an inner reduce-scatter into it is issued and not waited for
    REDUCING = "reducing"
    #: it holds the sum over the inner group of this step's grads so far (with earlier
    #: micro-steps and direct grads): the outer sync is owed
    REDUCED = "reduced"
    #: the step's outer all-reduce (outer reduce-scatter with sub-shards) is issued and
    #: not waited for
    SYNCING = "syncing"
    #: it holds the step's mean gradient (with sub-shards: this rank's piece of it,
    #: the other pieces zero); more grads first bring it back to ``REDUCED``
    SYNCED = "synced"


class RebuildState(enum.Enum):
    """With outer sub-shards: the flat shard against the replicas' pieces."""

    #: every piece holds its owner's latest values
    CURRENT = "current"
    #: this rank's piece changed (an optimizer step, an edit): an outer all-gather is
    #: owed, issued at the next root forward or read
    OWED = "owed"
    #: that all-gather is issued; the next read of the shard waits for it
    REBUILDING = "rebuilding"


class SyncSchedule(enum.Enum):
    """A root's schedule of outer syncs during backward (engine/outer_sync.py)."""

    #: its first backward (or the first after a fault-tolerant round changed who
    #: trains) records the order its buffers' reduce-scatters finish in
    RECORDING = "recording"
    #: the order is agreed; this backward is not predicted to be the step's last
    WAITING = "waiting"
    #: this backward is predicted to be the step's last: outer syncs are issued as
    #: their buffers' reduce-scatters finish, in the agreed order
    EARLY = "early"


class EarlyReduce(enum.Enum):
    """A buffer within one backward of a unit whose post-backward does not fire
    (engine/grad_hooks.py)."""

    #: its parameters' grads are arriving; it is reduced at the end of backward
    #: unless all of them complete first
    COLLECTING = "collecting"
    #: every parameter had its grad: it was reduce-scattered before the end of backward
    REDUCED = "reduced early"


_P, _G, _R, _S, _E = ParamState, GradState, RebuildState, SyncSchedule, EarlyReduce

#: Every transition each machine may take, as ``(from, to)``: :func:`move` refuses any
#: other, so an engine call out of order fails at that call. docs/engine.md's table is
#: this one (test/test_engine_states.py keeps them alike).
TRANSITIONS: dict[type[enum.Enum], frozenset[tuple[enum.Enum, enum.Enum]]] = {
    ParamState: frozenset({
        (_P.UNSHARDED, _P.SHARDED),    # fully_shard's first sharding; reshard
        (_P.SHARDED, _P.GATHERING),    # prefetch: the all-gathers issued
        (_P.GATHERING, _P.UNSHARDED),  # unshard: waited for, modules hold the full params
        (_P.GATHERING, _P.SHARDED),    # a prefetch never used, or a gather that failed
    }),
    GradState: frozenset({
        (_G.EMPTY, _G.REDUCING), (_G.REDUCED, _G.REDUCING),  # a reduce-scatter issued
        (_G.REDUCING, _G.REDUCED),                          # ... added in (or abandoned
        (_G.REDUCING, _G.EMPTY),                            # ... back to where it was)
        (_G.EMPTY, _G.REDUCED), (_G.REDUCED, _G.REDUCED),   # a direct grad added
        (_G.EMPTY, _G.SYNCING), (_G.REDUCED, _G.SYNCING),   # the outer sync issued
        (_G.SYNCING, _G.SYNCED),                            # ... and landed
        (_G.SYNCING, _G.REDUCED),                           # ... waited, not landed: owed
        (_G.EMPTY, _G.SYNCED), (_G.REDUCED, _G.SYNCED),     # sync_locally (no outer sum)
        (_G.SYNCED, _G.REDUCED),                            # more grads after the sync
        (_G.EMPTY, _G.EMPTY), (_G.REDUCED, _G.EMPTY),       # clear_grad (or a dropped
        (_G.SYNCING, _G.EMPTY), (_G.SYNCED, _G.EMPTY),      # step's grads)
    }),
    SyncSchedule: frozenset({
        (_S.RECORDING, _S.RECORDING),  # a backward begins, or one that failed: record again
        (_S.RECORDING, _S.WAITING),    # its end: the order agreed over the ranks
        (_S.WAITING, _S.WAITING),      # a backward not predicted the step's last
        (_S.WAITING, _S.EARLY),        # ... predicted the last: sync early
        (_S.EARLY, _S.WAITING),        # its end (or a failure): the rest issued, all waited
        (_S.EARLY, _S.EARLY),          # a backward begins again, predicted the last too
        (_S.WAITING, _S.RECORDING),    # a fault-tolerant round changed who trains
        (_S.EARLY, _S.RECORDING),
    }),
    RebuildState: frozenset({
        (_R.CURRENT, _R.OWED), (_R.OWED, _R.OWED),           # this rank's piece changed
        (_R.CURRENT, _R.REBUILDING), (_R.OWED, _R.REBUILDING),  # the all-gather issued
        (_R.REBUILDING, _R.CURRENT),                          # ... and waited for
        (_R.CURRENT, _R.CURRENT), (_R.OWED, _R.CURRENT),      # shared pieces broadcast
    }),
    EarlyReduce: frozenset({
        (_E.COLLECTING, _E.REDUCED),    # its last parameter's grad arrived: reduced now
        (_E.REDUCED, _E.COLLECTING),    # the backward ended (or failed)
        (_E.COLLECTING, _E.COLLECTING),  # ... without reducing it early
    }),
}


def move(owner: object, field: str, to: enum.Enum, call: str,
         who: str | Callable[[], str] | None = None) -> None:
    """Set ``owner.<field>`` (a state) to ``to`` if :data:`TRANSITIONS` allows it from
    the state it is in, else raise :class:`EngineStateError` naming ``call`` and
    ``who`` (default: the owner's ``describe()`` or ``label``). Every write of a state
    after its birth goes through here."""
    now = getattr(owner, field)
    if (now, to) not in TRANSITIONS[type(to)]:
        name = who or getattr(owner, "describe", None) or getattr(owner, "label", owner)
        name = name() if callable(name) else name
        raise EngineStateError(
            f"paddle_hsdp: {call} moves {name} from {now.value!r} to {to.value!r}, which "
            "its state machine does not allow (paddle_hsdp/engine/states.py "
            "TRANSITIONS). An engine call came out of order (a bug in paddle_hsdp, or a "
            "call into its internals): please report it with this traceback.")
    setattr(owner, field, to)


def expect(state: enum.Enum, allowed: tuple, call: str, who: str | Callable[[], str]) -> None:
    """Raise :class:`EngineStateError` unless ``state`` is one of ``allowed``.
    ``who``: what is in that state (its ``describe()`` or ``label`` names it)."""
    if state not in allowed:
        name = who() if callable(who) else who
        raise EngineStateError(
            f"paddle_hsdp: {call} on {name} in state {state.value!r}; it runs from "
            f"{' or '.join(repr(s.value) for s in allowed)}. An engine call came out of "
            "order (a bug in paddle_hsdp, or a call into its internals): please report "
            "it with this traceback.")


def transitions_markdown() -> str:
    """:data:`TRANSITIONS` as the Markdown table docs/engine.md shows."""
    rows = ["| machine | from | to |", "|---|---|---|"]
    order: dict[enum.Enum, int] = {
        member: i for machine in TRANSITIONS for i, member in enumerate(machine)}
    for machine, pairs in TRANSITIONS.items():
        for a, b in sorted(pairs, key=lambda pair: (order[pair[0]], order[pair[1]])):
            rows.append(f"| `{machine.__name__}` | {a.value} | {b.value} |")
    return "\n".join(rows)
