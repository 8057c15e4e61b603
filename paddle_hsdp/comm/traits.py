"""What a process group is beyond its ranks, declared once as a typed record (issue 52)
rather than attributes on Paddle's ``Group`` objects read with ``getattr`` defaults.

A plain group has :data:`PLAIN`'s traits. paddle_hsdp.ft declares its live outer group's
(an outer all-reduce during backward in one agreed order, hangs ended by the round not
the watchdog, what a failed collective means, the shared HFSDP pieces, the joint save)
and its transfer pairs'; the engine, comm and checkpoint read them with
:func:`traits_of`. Declarations are held weakly: a group that is freed takes its traits
with it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .state import state

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group


class PieceHolders(Protocol):
    """Who holds which HFSDP piece of a group's replicas (ft.pieces.PiecePlan): the
    engine reads it through this, knowing nothing of ft."""

    parts: int  # pieces the shard is cut into
    part: int  # this replica's
    holders: int  # members of the round holding this replica's piece

    def src(self, q: int) -> int:
        """The rank piece ``q`` is broadcast from (``broadcast``'s ``src``)."""
        ...

    def keeps(self, q: int) -> bool:
        """Whether this rank holds a valid copy of piece ``q`` (so it takes that
        piece's broadcast into scratch)."""
        ...


@dataclass(frozen=True)
class GroupTraits:
    # the outer all-reduce may be issued during backward (engine/outer_sync.py)
    early_sync: bool = True
    # the outer-sync order is agreed over this group too (replicas outside the FSDP group)
    order_agreed_on_it: bool = False
    # a hang on it is ended by something else (ft's round), not the watchdog's exit
    watchdog_exempt: bool = False
    # what a failed collective on it means, said in the CollectiveError
    failure_advice: str | None = None
    # HFSDP with redundancy: who holds which optimizer piece (ft.pieces.PiecePlan)
    pieces: PieceHolders | None = None
    # the live replica groups saving one checkpoint together (ft.joint_save.JointSave)
    joint_save: object | None = None
    # members whose grads count this step, when fewer than all (paddle_hsdp.ft: a
    # rejoining replica sits its first step out, adding zeros): the grads' divisor
    contributing: int | None = None


PLAIN = GroupTraits()


def declare(group: Group, **traits: Any) -> GroupTraits:
    """Set ``traits`` (GroupTraits' fields) of ``group``, keeping those declared
    before; returns the group's traits."""
    record = dataclasses.replace(traits_of(group), **traits)
    state.group_traits[group] = record
    return record


def contributing(group: Group) -> int:
    """How many of ``group``'s members add grads to its all-reduce this step: all of
    them, or those paddle_hsdp.ft declared (a rejoining replica adds zeros and is left
    out of the mean until its state arrived)."""
    declared = traits_of(group).contributing
    return group.nranks if declared is None else declared


def traits_of(group: Group | None) -> GroupTraits:
    """``group``'s declared traits (:data:`PLAIN` for any other group, or None)."""
    if group is None:
        return PLAIN
    try:
        return state.group_traits.get(group, PLAIN)
    except TypeError:  # an unhashable stand-in (a test's namespace): a plain group
        return PLAIN
