"""HFSDP in a fault-tolerant job: who holds which piece of the optimizer state.

Under ``fsdp_outer_sharding="optim"`` each replica's optimizer sees one *piece* of the
shard (engine/buffer/outer_pieces.py). Plain HFSDP cuts the shard into one piece per replica,
so a dead replica takes its piece along. Here the shard is cut into
``P = start_replicas // redundancy`` pieces and replica ``r`` holds piece ``r % P``:
every piece is held by ``redundancy`` replicas at the start, and a piece is lost only
when every one of its holders is gone at once.

The cut is fixed for the job: a piece's shape (and so its optimizer state's) follows
from ``P``, and the shard parameters the optimizer was built over are views of it. The
survivors of a failure therefore keep the cut; a piece whose holders died keeps being
served by the ones that are left (a restarted replica takes its old piece, a new id
``r`` piece ``r % P``).
:func:`recut` decides which survivors take a dead replica's pieces besides their own,
so that redundancy comes back without a rejoin (each round, :meth:`PiecePlan.arrange`;
a replica steps such a piece with a copy of its optimizer, engine/piece_optimizer.py).

The engine reads a :class:`PiecePlan` from the outer group's traits
(``traits_of(group).pieces``, comm/traits.py): its grads are all-reduced whole (not
reduce-scattered), and after each step a piece is
broadcast from one valid holder (:meth:`src`) to the rest; a rank that holds a valid
copy takes the broadcast into scratch (:meth:`keeps`), so a failed broadcast never
touches the piece its optimizer updates.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from ..comm.traits import traits_of
from .protocol import FaultToleranceError, Round

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group


class PieceLostError(FaultToleranceError):
    """Every replica holding one piece of the optimizer state is gone: training cannot
    go on from the live replicas (restart from a checkpoint)."""


class PiecePlan:
    """The pieces of one rank's outer group: ``parts`` pieces, this replica's ``part``,
    and per round who holds which piece ([Note: the re-cut]: besides its own, a replica
    may hold others while a piece is short of ``redundancy`` holders), who copies a
    piece's optimizer state to whom, and the replica each piece is served from."""

    def __init__(self, parts: int, replica: int, virtual_rank: Callable[[int], int],
                 redundancy: int = 2):
        self.parts, self.part = parts, replica % parts
        self.replica, self.redundancy = replica, redundancy
        self._virtual_rank = virtual_rank  # replica -> its rank in the outer group
        self._donors: dict[int, int] = {q: replica for q in range(parts)}
        self._valid: frozenset[int] = frozenset({self.part})  # pieces held at its step
        self.extra: frozenset[int] = frozenset()  # the round's pieces besides its own
        self.copies: list[tuple[int, int, int]] = []  # the round's (piece, donor, taker)
        self.holding: dict[int, list[int]] = {}  # the round's piece -> its holders
        self.holders = 1  # members of the round whose own piece is this replica's

    def piece_of(self, replica: int) -> int:
        return replica % self.parts

    def valid_extra(self) -> tuple[int, ...]:
        """The pieces besides its own this replica holds at its step (its arrival
        says them)."""
        return tuple(sorted(self._valid - {self.part}))

    def arrange(self, record: Round) -> None:
        """Take round ``record``: who holds each piece (:func:`recut` over the valid
        copies its members' arrivals name: not a receiver's; in a round where every
        state is fresh, each member's own), the copies that takes, and each piece's
        donor, the lowest valid holder. Raises :class:`PieceLostError` when a piece has
        none, on every member alike."""
        receivers = set(record.receivers)
        all_fresh = all(a.fresh for a in record.members.values())
        valid = {r: (r % self.parts, *(() if all_fresh else record.members[r].extra))
                 for r in record.replicas if all_fresh or r not in receivers}
        valid_holders = holders_by_piece(valid)  # (O(R), not O(P x R))
        donors = {q: holders[0] for q, holders in valid_holders.items()}  # the lowest
        for q in range(self.parts):
            if q not in donors:
                self._lost(record, q)
        extra = recut(record.replicas, {r: v[1:] for r, v in valid.items()}, self.parts,
                      self.redundancy)
        held = {r: (r % self.parts, *sorted(extra[r])) for r in record.replicas}
        self._donors = donors
        copies = piece_copies(valid, held)
        if all_fresh:  # the first round: each receiver takes its piece from its lowest holder
            copies += [(r % self.parts, self._donors[r % self.parts], r)
                       for r in record.receivers if self._donors[r % self.parts] != r]
        self.copies = sorted(copies)
        by_piece = holders_by_piece(held)
        self.holding = {q: by_piece.get(q, []) for q in range(self.parts)}
        mine = set(valid.get(self.replica, ())) & set(held[self.replica])
        self._valid, self.extra = frozenset(mine), extra[self.replica]
        self.holders = sum(1 for r in record.replicas if self.piece_of(r) == self.part)

    def _lost(self, record: Round, q: int) -> None:
        held_by = [r for r in record.replicas if record.members[r].holds(r, q, self.parts)]
        raise PieceLostError(
            f"paddle_hsdp.ft: piece {q} of {self.parts} of the optimizer state "
            f"(fsdp_outer_sharding='optim') has no live holder in round "
            f"{record.number}: replicas {record.replicas} are live, and "
            f"{held_by or 'none of them'} hold it without a valid copy. Every "
            "replica group holding it failed before one could rejoin; restart "
            "the job from the last checkpoint the live groups saved together "
            "(paddle_hsdp.save_checkpoint on every group; a larger redundancy "
            "survives more).")

    def committed(self) -> None:
        """A step of this round committed: every piece the round gave this replica is
        held at its step (the state copied in at the set-up, the params by the step's
        rebuild, the update by its optimizers). Until then a piece it took is not
        valid: it takes that piece's broadcast in place, and a failed attempt leaves
        the piece to be copied again."""
        self._valid = frozenset({self.part, *self.extra})

    def donor(self, q: int) -> int:
        """The replica piece ``q`` is served from in this round (its lowest valid holder)."""
        return self._donors[q]

    def receivers(self, record: Round, q: int) -> list[int]:
        """The members of ``record`` that take piece ``q``'s optimizer state (a receiver
        its own piece, a member a piece the re-cut gave it)."""
        return [taker for piece, _, taker in self.copies if piece == q]

    def src(self, q: int) -> int:
        """The outer-group rank piece ``q`` is broadcast from after a step."""
        return self._virtual_rank(self._donors[q])

    def keeps(self, q: int) -> bool:
        """Whether this rank holds a valid copy of piece ``q`` (it takes that piece's
        broadcast into scratch)."""
        return q in self._valid


def plan_of(group: Group | None) -> PiecePlan | None:
    """The plan declared on ``group`` (ft.init declares it on the live outer group, with
    HFSDP's shared pieces), None where none is."""
    plan = traits_of(group).pieces
    if plan is not None and not isinstance(plan, PiecePlan):
        raise TypeError(f"paddle_hsdp.ft: the pieces declared on {group!r} are a "
                        f"{type(plan).__name__}, not a PiecePlan (only ft.init declares them)")
    return plan


# ---------------------------------------------------------------- the re-cut
def recut(members: Iterable[int], extra: Mapping[int, Iterable[int]], parts: int,
          redundancy: int) -> dict[int, frozenset[int]]:
    """[Note: the re-cut] Which pieces each member of a round holds besides its own
    (``r % parts``, the piece its optimizer was built over), so that every piece is held
    by ``redundancy`` members again (by all of them when fewer are left) without a
    rejoin. ``extra``: the pieces each member holds a valid copy of besides its own
    (as its arrival said; a member missing from it holds none).

    A pure function of its inputs, so every group computes the same from the round's
    record. Extra holdings a piece no longer needs (a holder rejoined) are dropped
    first, from the most loaded member (the higher id on a tie); then each piece short
    of holders, in piece order, takes the least loaded members that lack it (the
    lower id on a tie), a member's load being the pieces it holds. O(R + P x
    redundancy) heap operations of log R for R members and P pieces: no member reads
    another's holdings piece by piece."""
    own = {r: r % parts for r in sorted(set(members))}
    if not own:
        return {}
    holding: dict[int, set[int]] = {r: set() for r in own}
    for r, pieces in extra.items():
        if r in own:
            holding[r].update(_checked_pieces(r, pieces, parts))
            holding[r].discard(own[r])
    holders: list[set[int]] = [set() for _ in range(parts)]
    for r, q in own.items():
        holders[q].add(r)
    for r, pieces in holding.items():
        for q in pieces:
            holders[q].add(r)
    target = min(redundancy, len(own))
    _drop_surplus(holding, holders, target)
    _fill_shortfall(holding, holders, target)
    return {r: frozenset(pieces) for r, pieces in holding.items()}


def _checked_pieces(replica: int, pieces: Iterable[int], parts: int) -> list[int]:
    pieces = list(pieces)
    bad = [q for q in pieces if not isinstance(q, int) or not 0 <= q < parts]
    if bad:
        raise ValueError(f"paddle_hsdp.ft: replica {replica} says it holds pieces {bad} "
                         f"of the optimizer state, outside 0..{parts - 1} (the job's "
                         f"{parts} pieces)")
    return pieces


def _drop_surplus(holding: dict[int, set[int]], holders: list[set[int]],
                  target: int) -> None:
    """Extra holdings beyond ``target`` holders go, the most loaded member's first."""
    for q, members in enumerate(holders):
        surplus = len(members) - target
        if surplus <= 0:
            continue
        extras = sorted((r for r in members if q in holding[r]),
                        key=lambda r: (-len(holding[r]), -r))
        for r in extras[:surplus]:
            holding[r].discard(q)
            members.discard(r)


def _fill_shortfall(holding: dict[int, set[int]], holders: list[set[int]],
                    target: int) -> None:
    """Each piece short of ``target`` holders takes the least loaded members without it."""
    loads = [(1 + len(pieces), r) for r, pieces in holding.items()]
    heapq.heapify(loads)
    for q, members in enumerate(holders):
        skipped = []
        while len(members) < target:
            load, r = heapq.heappop(loads)  # (target <= members: one lacks q)
            if r in members:
                skipped.append((load, r))
                continue
            holding[r].add(q)
            members.add(r)
            heapq.heappush(loads, (load + 1, r))
        for entry in skipped:
            heapq.heappush(loads, entry)


def holders_by_piece(holding: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """``{piece: its holders, the lowest first}`` from ``{member: the pieces it holds}``."""
    holders: dict[int, list[int]] = {}
    for r in sorted(holding):
        for q in holding[r]:
            holders.setdefault(q, []).append(r)
    return holders


def piece_copies(valid: Mapping[int, Iterable[int]], held: Mapping[int, Iterable[int]]
                 ) -> list[tuple[int, int, int]]:
    """``(piece, donor, taker)`` for every piece a member holds in ``held`` (all its
    pieces, its own included) without a valid copy in ``valid`` (the same form), in
    piece then taker order: a piece's takers take its valid holders in turn (the lower
    id first), so several takers load several donors. A piece with no valid holder
    is left out (the caller raises :class:`PieceLostError`)."""
    donors = holders_by_piece(valid)
    takers: dict[int, list[int]] = {}
    for r in sorted(held):
        have = set(valid.get(r, ()))
        for q in held[r]:
            if q not in have:
                takers.setdefault(q, []).append(r)
    return [(q, donors[q][i % len(donors[q])], r)
            for q in sorted(takers) if q in donors for i, r in enumerate(takers[q])]
