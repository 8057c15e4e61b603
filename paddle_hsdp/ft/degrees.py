"""Replica groups of different sizes (inner degrees) in one job (issue 63, item 3).

A group of ``d`` ranks holds ``1/d`` of each flat buffer per rank. Groups of sizes
that divide one another (1, 2, 4, 8) can share the outer all-reduce: with ``D`` the
largest size present, outer group ``j < D`` holds rank ``j`` of each ``D``-group and
rank ``j * d // D`` of each ``d``-group, so a rank of a ``d``-group is in ``D / d``
outer groups and all-reduces one slice of its shard in each (:class:`OuterPlan`,
:func:`all_reduce_across_degrees`). Every outer group holds exactly one rank of every
live group, so the grad divisor stays the number of groups and every group ends with
the same full mean grad (the clip's norm, computed inside each group over its shards
of that grad, is then the same everywhere).

[Note: slices line up only on one layout] A buffer's layout depends on its number of
segments (engine/layout.py: boundaries move to row boundaries), so a 1-rank group's
flat buffer and a 2-rank group's are different arrangements of the same parameters.
The slices above line up only when every group lays its buffers out over the same
``L`` segments (``L``: a multiple of every size present), a rank of a ``d``-group
holding ``L / d`` of them: the full buffers are then identical and slice ``k`` of
rank ``i`` of a ``d``-group is exactly the shard of rank ``i * D / d + k`` of a
``D``-group. :func:`check_lines_up` refuses anything else by name. The engine lays
them out so under ``PADDLE_HSDP_FT_MAX_GROUP_SIZE`` (engine/layout.py, [Note: the layout
degree]); unset, over each group's own inner degree. This module is not wired into the
rounds yet (the per-size outer groups, the engine's outer sync and its divisor, the
transfer), so a group of another size is still refused at arrival (:func:`size_refusal`).

A joiner of another size takes its rows from the donor ranks that hold them
(:func:`transfer_cuts`): each joiner rank receives from ``max(1, donor / joiner)``
donor ranks, each donor rank sends to ``max(1, joiner / donor)`` joiner ranks.

Nothing here grows with the world: a rank creates ``D / d <= D`` outer groups (at
most 8 for 8-GPU machines), each of one rank per live group, the same count a plain
HSDP rank's one outer group has members. Paddle-free: the round's decider
(:mod:`.protocol`) names the sizes with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SIZES_NAME = "PADDLE_HSDP_FT group sizes"  # (--nproc_per_node of each replica group)


def sizes_fit(sizes: Mapping[int, int] | list[int]) -> bool:
    """Whether the group sizes divide one another (each distinct size the next's divisor)."""
    values = sorted(set(sizes.values() if isinstance(sizes, Mapping) else sizes))
    return all(size >= 1 for size in values) and \
        all(big % small == 0 for small, big in zip(values, values[1:], strict=False))


NAMED_PER_SIZE = 4  # replicas named per size: a refusal stays short at any job size


def describe_sizes(sizes: Mapping[int, int]) -> str:
    """``sizes`` (replica -> ranks per group) in words, largest size first, at most
    ``NAMED_PER_SIZE`` replicas named per size (the others counted)."""
    by_size: dict[int, list[int]] = {}
    for replica, size in sorted(sizes.items()):
        by_size.setdefault(size, []).append(replica)
    parts = []
    for size, replicas in sorted(by_size.items(), reverse=True):
        named = ", ".join(map(str, replicas[:NAMED_PER_SIZE]))
        more = len(replicas) - NAMED_PER_SIZE
        parts.append(f"{size} rank{'s' if size != 1 else ''}: replica"
                     f"{'s' if len(replicas) > 1 else ''} {named}"
                     + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)


def size_refusal(joiner: int, sizes: Mapping[int, int], running: int) -> str | None:
    """Why group ``joiner`` is refused for its size (None if it is the ``running``
    groups' size). ``sizes``: replica -> ranks per group of the groups present. The
    round's decider writes it into the record, so every rank of the refused group
    raises the same text (its leader hands it to its mates) before any collective."""
    size = sizes[joiner]
    if size == running:
        return None
    why = ("sizes that divide one another (1, 2, 4, 8) can share the outer all-reduce "
           "(paddle_hsdp/ft/degrees.py), but a group of another size is not wired into "
           "the rounds yet" if sizes_fit([size, running]) else
           f"{size} and {running} do not divide one another, so no layout lines their "
           "shards up")
    return (f"{SIZES_NAME} present: {describe_sizes(sizes)}; allowed: {running}, the "
            f"running groups' size ({why})")


@dataclass(frozen=True)
class OuterPlan:
    """The outer groups of one round over groups of different sizes."""

    sizes: Mapping[int, int]  # replica -> ranks per group, of every live group

    def __post_init__(self) -> None:
        if not self.sizes or not sizes_fit(self.sizes):
            raise ValueError(f"OuterPlan: {SIZES_NAME} must divide one another (1, 2, 4, "
                             f"8), got {describe_sizes(self.sizes) or 'none'}")

    @property
    def largest(self) -> int:
        """``D``: the largest size present, and so the number of outer groups."""
        return max(self.sizes.values())

    @property
    def divisor(self) -> int:
        """What the outer sum is divided by: the number of live groups (each outer
        group holds one rank of each)."""
        return len(self.sizes)

    def groups_of(self, replica: int, local_rank: int) -> range:
        """The outer groups rank ``local_rank`` of ``replica`` is in, ascending."""
        size = self._size(replica, local_rank)
        per = self.largest // size
        return range(local_rank * per, (local_rank + 1) * per)

    def members(self, j: int) -> list[tuple[int, int]]:
        """``(replica, local rank)`` of outer group ``j``'s members, by replica."""
        if not 0 <= j < self.largest:
            raise ValueError(f"OuterPlan.members: j must be in [0, {self.largest}), got {j}")
        return [(r, j * size // self.largest) for r, size in sorted(self.sizes.items())]

    def slice_of(self, replica: int, local_rank: int, j: int, shard_numel: int
                 ) -> tuple[int, int]:
        """``(start, stop)`` in rank ``local_rank`` of ``replica``'s flat shard of
        ``shard_numel`` elements that outer group ``j`` all-reduces."""
        mine = self.groups_of(replica, local_rank)
        if j not in mine:
            raise ValueError(f"OuterPlan.slice_of: replica {replica} rank {local_rank} is "
                             f"in outer groups {list(mine)}, not {j}")
        if shard_numel % len(mine):
            raise ValueError(
                f"OuterPlan.slice_of: a shard of {shard_numel} elements cannot be cut into "
                f"the {len(mine)} slices its outer groups take: lay the buffers out over "
                f"a multiple of {self.largest} segments (paddle_hsdp/ft/degrees.py)")
        piece = shard_numel // len(mine)
        return (j - mine.start) * piece, (j - mine.start + 1) * piece

    def _size(self, replica: int, local_rank: int) -> int:
        if replica not in self.sizes:
            raise ValueError(f"OuterPlan: replica {replica} is not live (live: "
                             f"{sorted(self.sizes)})")
        size = self.sizes[replica]
        if not 0 <= local_rank < size:
            raise ValueError(f"OuterPlan: replica {replica} has {size} ranks, no rank "
                             f"{local_rank}")
        return size


def check_lines_up(plan: OuterPlan, segments: int) -> None:
    """Refuse a layout whose shards would not line up across the sizes present: every
    group must lay its buffers out over the same ``segments``, a multiple of ``D``
    ([Note: slices line up only on one layout])."""
    if segments < 1 or segments % plan.largest:
        raise ValueError(
            f"paddle_hsdp.ft: {SIZES_NAME} present ({describe_sizes(plan.sizes)}) need "
            f"every buffer laid out over a multiple of {plan.largest} segments, got "
            f"{segments}: another layout cuts the groups' shards at other rows")


def all_reduce_across_degrees(flat: Any, plan: OuterPlan, replica: int, local_rank: int,
                              all_reduce: Callable[[Any, int], Any]) -> None:
    """Sum rank ``local_rank`` of ``replica``'s flat shard ``flat`` with the matching
    rows of every live group, in place (divide by ``plan.divisor`` for the mean).
    ``all_reduce(piece, j)`` sums ``piece`` over outer group ``j`` and returns it.

    No deadlock: every rank walks its outer groups in ascending ``j``. Take the
    lowest ``j`` whose all-reduce has not finished: each of its members has finished
    every group below ``j`` it is in (all below are finished), so each is in ``j``'s
    all-reduce, which therefore completes; by induction every one does."""
    numel = int(flat.shape[0])
    for j in plan.groups_of(replica, local_rank):
        start, stop = plan.slice_of(replica, local_rank, j, numel)
        # a slice may be a copy (Paddle): reduced, then written back
        flat[start:stop] = all_reduce(flat[start:stop], j)


@dataclass(frozen=True)
class Cut:
    """One piece a joiner rank receives: ``donor_rank``'s elements ``[start, stop)``
    of its shard go to the joiner rank's shard from ``at``."""

    donor_rank: int
    start: int
    stop: int
    at: int


def transfer_cuts(donor_size: int, joiner_size: int, joiner_rank: int, segments: int,
                  segment_numel: int) -> list[Cut]:
    """What rank ``joiner_rank`` of a ``joiner_size``-group receives from a
    ``donor_size``-group when both lay a buffer out over ``segments`` segments of
    ``segment_numel`` elements (a rank of a ``d``-group holding ``segments / d`` of
    them): the model's and each optimizer state's flat shard are cut alike."""
    for name, size in (("donor_size", donor_size), ("joiner_size", joiner_size)):
        if size < 1 or segments % size:
            raise ValueError(f"transfer_cuts: {name} must divide segments={segments}, "
                             f"got {size}")
    if not 0 <= joiner_rank < joiner_size:
        raise ValueError(f"transfer_cuts: joiner_rank must be in [0, {joiner_size}), got "
                         f"{joiner_rank}")
    donor_span = segments // donor_size * segment_numel
    joiner_span = segments // joiner_size * segment_numel
    lo, hi = joiner_rank * joiner_span, (joiner_rank + 1) * joiner_span
    cuts = []
    for donor in range(lo // donor_span, -(-hi // donor_span)):
        first, last = max(lo, donor * donor_span), min(hi, (donor + 1) * donor_span)
        cuts.append(Cut(donor, first - donor * donor_span, last - donor * donor_span,
                        first - lo))
    return cuts
