"""The engine's state machines, one enum each, and the check every transition starts
with (as torch FSDP2's ``_assert_in_states``): a call in the wrong order is a traceback
at that call, naming what it found and what it needed, not a wrong sum later.

* :class:`ParamState` — a unit's parameters: sharded, being gathered, gathered.
* :class:`GradState` — a buffer's grad shard within one optimizer step: empty,
  inner-reduced, outer-synced, and the collectives in between.
* :class:`RebuildState` — with outer sub-shards (HFSDP), whether a buffer's flat shard
  holds every replica's latest piece.

Full-size grads that wait for a reduce-scatter under ``set_requires_gradient_sync(False)``
are the unit's ``full_grads_pending`` (a flag, not a machine: they exist or not).
"""

from __future__ import annotations

import enum


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


def expect(state: enum.Enum, allowed: tuple, call: str, who) -> None:
    """Raise :class:`EngineStateError` unless ``state`` is one of ``allowed``.
    ``who``: what is in that state (its ``describe()`` or ``label`` names it)."""
    if state not in allowed:
        name = who() if callable(who) else who
        raise EngineStateError(
            f"paddle_hsdp: {call} on {name} in state {state.value!r}; it runs from "
            f"{' or '.join(repr(s.value) for s in allowed)}. An engine call came out of "
            "order (a bug in paddle_hsdp, or a call into its internals): please report "
            "it with this traceback.")
