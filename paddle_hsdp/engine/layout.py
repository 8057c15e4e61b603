"""Where a buffer's parameters sit in its full flat buffer, and which rows each rank holds.

[Note: the segment layout] A buffer's parameters lie one after another in one flat
buffer of ``V * s`` elements, cut into ``V = inner * parts`` segments of ``s`` elements
(``parts``: the outer sub-shards of HFSDP, 1 otherwise). Inner rank ``i`` holds the
``S = parts * s`` elements ``[i * S, (i + 1) * S)``, its outer part ``q`` of them
segment ``i * parts + q``. One all-gather of every rank's ``S`` elements therefore *is*
the full buffer, and each full parameter a view of it: no copy-out after the gather, no
second layer-sized grid beside the parameters (Megatron-FSDP's buffer does the same).

Rows stay whole. A segment boundary that falls inside a parameter falls on one of its
row boundaries, so each rank's piece of a parameter is a box of whole rows (possibly
none), and the optimizer, clipping and checkpoints see row blocks with the parameter's
trailing shape, as with per-parameter sharding. To get there a parameter may start up to
one row late (a gap of zeros before it), and ``s`` is a multiple of the row length of
every parameter longer than ``s`` (one that may cross two boundaries). Every start is
aligned to ``ALIGN`` elements first (vectorised kernels read views of the buffer).

Padding is per buffer (the gaps and the tail), not per parameter: per-parameter dim-0
blocks pad every parameter to a multiple of ``inner`` rows. It is largest when a
parameter has fewer rows than there are segments; such a parameter is cut at row
boundaries anyway, so some segments hold none of it.

[Note: owned parameters] A parameter marked *owned* (``paddle_hsdp.Owned()``: a matrix
Muon-style optimizers update as a whole) lies inside one segment, so one rank (one
outer part with HFSDP) holds all of it and the others a 0-row shard. The other
parameters are laid out as above, from the start of a rotating segment (the unit's
index; from segment 0 where they do not fit there); the owned ones then go, largest
first, to the segment that owns the fewest elements so far and still has room (greedy
by bytes; ties from the same rotating segment, so identical units do not all load the
same rank most), and ``s``, a multiple of ``ALIGN``, is the smallest size under which
they all fit. The buffer's collectives are
unchanged: the same all-gather of every rank's ``S`` elements, so an imbalance between
segments costs padding, which :func:`owner_balance` reports.

The layout depends on the shapes, the two sizes and which parameters are owned only,
so every rank (and the planner, which builds no buffer) computes the same one.

[Note: the layout degree] Where the boundaries move depends on the number of segments,
so a 2-rank and a 4-rank group lay the same parameters out differently. A fault-tolerant
job whose groups may have different sizes (paddle_hsdp/ft/degrees.py) gives every group
one *layout degree* ``L``, a multiple of each group's inner degree ``d``:
:func:`buffer_layout` lays the buffer out over ``L * parts`` segments and then merges
each ``L / d`` consecutive ones into one segment of a ``d * parts``-segment layout. The
full flat buffer (offsets, padding, total) is then the same in every group and only the
cut between ranks differs; every boundary of the merged layout is one of the fine
layout's, so rows stay whole and owned parameters inside one segment. Every consumer sees
an ordinary layout of ``d * parts`` segments. Unset (``L = d``) it is
:func:`segment_layout` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALIGN = 16  # elements: 64 bytes in float32, 32 in bfloat16


@dataclass(frozen=True)
class SegmentLayout:
    """The layout of one buffer: ``offsets[k]`` is where parameter ``k`` starts in the
    full flat buffer of ``segments * segment_numel`` elements."""

    segment_numel: int
    segments: int
    offsets: tuple[int, ...]
    rows: tuple[int, ...]
    row_numels: tuple[int, ...]
    owned: tuple[bool, ...] = ()  # per parameter: kept in one segment (none: ())

    @property
    def total_numel(self) -> int:
        return self.segments * self.segment_numel

    def numel(self, k: int) -> int:
        return self.rows[k] * self.row_numels[k]

    def rows_in(self, k: int, first_segment: int, count: int = 1) -> tuple[int, int]:
        """``(first row, row count)`` of parameter ``k`` inside segments
        ``[first_segment, first_segment + count)``; the count is 0 when none of it is
        there (the first row is then where it would start)."""
        start = first_segment * self.segment_numel
        stop = start + count * self.segment_numel
        offset, numel, row = self.offsets[k], self.numel(k), self.row_numels[k]
        lo, hi = max(offset, start), min(offset + numel, stop)
        if hi <= lo:
            return (0 if stop <= offset else self.rows[k]), 0
        return (lo - offset) // row, (hi - lo) // row

    def gaps(self) -> list[tuple[int, int]]:
        """``[(start, stop)]`` of the elements no parameter covers, in order."""
        out, pos = [], 0
        for offset, k in sorted((offset, k) for k, offset in enumerate(self.offsets)):
            if offset > pos:
                out.append((pos, offset))
            pos = offset + self.numel(k)
        if pos < self.total_numel:
            out.append((pos, self.total_numel))
        return out


def row_split(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, elements per row)`` of a parameter of ``shape``: its first dim and the
    product of the others (a 0-d parameter is one row of one element)."""
    return (int(shape[0]) if len(shape) else 1,
            math.prod(int(d) for d in shape[1:]) if len(shape) > 1 else 1)


def segment_layout(shapes: Sequence[Sequence[int]], segments: int,
                   owned: Sequence[bool] | None = None, rotation: int = 0) -> SegmentLayout:
    """The smallest ``s`` (and the placement under it) this module's rules allow for
    parameters of ``shapes`` (in order) over ``segments`` segments; ``owned[k]``: keep
    parameter ``k`` inside one segment ([Note: owned parameters]), ties going to the
    segment ``rotation`` first."""
    if owned is not None and any(owned):
        return _owner_layout(shapes, segments, owned, rotation)
    rows, row_numels = zip(*(row_split(shape) for shape in shapes), strict=True)
    numels = [r * n for r, n in zip(rows, row_numels, strict=True)]
    size = max(1, -(-sum(numels) // segments))
    while True:
        # a parameter longer than a segment may cross two boundaries: both must fall
        # on its row boundaries, so the segment is a multiple of its row length
        step = math.lcm(1, *(n for n, total in zip(row_numels, numels, strict=True)
                             if total > size))
        size = -(-size // step) * step
        offsets, end = _place(numels, row_numels, size)
        if end <= segments * size:
            return SegmentLayout(size, segments, offsets, rows, row_numels)
        size = max(size + 1, -(-end // segments))


def buffer_layout(shapes: Sequence[Sequence[int]], inner: int, parts: int = 1,
                  owned: Sequence[bool] | None = None, rotation: int = 0,
                  degree: int | None = None) -> SegmentLayout:
    """The layout of a buffer of ``shapes`` cut among ``inner`` ranks, each holding
    ``parts`` outer sub-shards, laid out as a ``degree``-rank group would lay it out
    ([Note: the layout degree]; None: ``inner``)."""
    degree = inner if degree is None else degree
    if not isinstance(degree, int) or degree < 1 or degree % inner:
        raise ValueError(f"layout degree must be a positive multiple of the inner degree "
                         f"{inner}, got {degree!r}")
    fine = segment_layout(shapes, degree * parts, owned, rotation)
    if degree == inner:
        return fine
    merged = degree // inner  # fine segments per merged one
    return SegmentLayout(fine.segment_numel * merged, inner * parts, fine.offsets,
                         fine.rows, fine.row_numels, fine.owned)


def _place(numels: Sequence[int], row_numels: Sequence[int], size: int,
           ) -> tuple[tuple[int, ...], int]:
    """Offsets of parameters laid out in order under segment size ``size`` (each
    aligned, then moved on so the first boundary inside it is on a row boundary), and
    the end of the last one."""
    offsets, pos = [], 0
    for numel, row in zip(numels, row_numels, strict=True):
        pos = -(-pos // ALIGN) * ALIGN
        boundary = (pos // size + 1) * size
        if boundary < pos + numel:
            pos += (boundary - pos) % row
        offsets.append(pos)
        pos += numel
    return tuple(offsets), pos


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _owner_layout(shapes: Sequence[Sequence[int]], segments: int,
                  owned: Sequence[bool], rotation: int) -> SegmentLayout:
    """[Note: owned parameters]: the smallest segment size under which the free
    parameters (laid out first, as :func:`segment_layout` does) and every owned one
    (inside one segment each) fit; found by doubling, then bisection."""
    if len(owned) != len(shapes):
        raise ValueError(f"owned has {len(owned)} flags for {len(shapes)} parameters")
    rows, row_numels = zip(*(row_split(shape) for shape in shapes), strict=True)
    numels = [r * n for r, n in zip(rows, row_numels, strict=True)]
    largest = max(_aligned(n) for n, own in zip(numels, owned, strict=True) if own)
    low = max(1, -(-sum(numels) // segments), largest)
    free = [k for k, own in enumerate(owned) if not own]

    def stepped(size: int) -> int:
        # as segment_layout: a free parameter longer than a segment may cross two
        # boundaries, so the size is a multiple of its row length (rounded up to it);
        # and of ALIGN, so every segment starts aligned wherever the free span starts
        while True:
            step = math.lcm(ALIGN, *(row_numels[k] for k in free if numels[k] > size))
            rounded = -(-size // step) * step
            if rounded == size:
                return size
            size = rounded

    def fit(size: int) -> tuple[int, ...] | None:
        return _fit_owned(numels, row_numels, owned, segments, stepped(size), rotation)
    high = low
    while fit(high) is None:
        high *= 2
    while low < high:  # the smallest size that fits (fitting grows with the size, up
        # to the alignment of the owned parameters' starts: a size found may then be a
        # few ALIGN steps above the least, never one that does not fit)
        middle = (low + high) // 2
        if fit(middle) is None:
            low = middle + 1
        else:
            high = middle
    size = stepped(high)
    offsets = _fit_owned(numels, row_numels, owned, segments, size, rotation)
    if offsets is None:  # (fit(high) succeeded on this very size)
        raise AssertionError("owner layout: the size found does not fit")
    return SegmentLayout(size, segments, offsets, tuple(rows), tuple(row_numels), tuple(owned))


def _fit_owned(numels: Sequence[int], row_numels: Sequence[int], owned: Sequence[bool],
               segments: int, size: int, rotation: int) -> tuple[int, ...] | None:
    """Offsets with the free parameters laid out from segment ``rotation`` (from 0 where
    they do not fit there) and each owned one in the least-filled segment that has
    room, or None when they do not fit in ``segments * size``."""
    free = [k for k, own in enumerate(owned) if not own]
    free_numels = [numels[k] for k in free]
    step = math.lcm(ALIGN, *(row_numels[k] for k in free if numels[k] > size))
    if size % step:
        return None
    offsets = [0] * len(numels)
    placed, end = _place(free_numels, [row_numels[k] for k in free], size)
    if end > segments * size:
        return None
    # the free span starts at segment `rotation` where it fits there, so the segment
    # it shortens (and the owners' heaviest, which the minimal size puts elsewhere)
    # turns with the unit as the ties do
    shift = (rotation % segments) * size
    if end + shift > segments * size:
        shift = 0
    for k, offset in zip(free, placed, strict=True):
        offsets[k] = offset + shift
    # where each segment's next element goes: after its share of the free span
    nxt = [j * size if (j + 1) * size <= shift else
           min((j + 1) * size, max(j * size, shift + end)) for j in range(segments)]
    load = [0] * segments  # owned elements so far: the owner's work, what is balanced
    for k in sorted((k for k, own in enumerate(owned) if own), key=lambda k: -numels[k]):
        room = [j for j in range(segments) if _aligned(nxt[j]) + numels[k] <= (j + 1) * size]
        if not room:
            return None
        # the least loaded; ties from segment `rotation` on
        j = min(room, key=lambda j: (load[j], (j - rotation) % segments))
        offsets[k] = _aligned(nxt[j])
        nxt[j] = offsets[k] + numels[k]
        load[j] += numels[k]
    return tuple(offsets)


def owner_balance(layout: SegmentLayout) -> dict[str, float]:
    """How evenly a layout spreads its owned parameters: elements owned per segment,
    their largest over their mean (1.0: even), and the buffer's padding (elements no
    parameter covers, over the total)."""
    loads = [0] * layout.segments
    for k, own in enumerate(layout.owned):
        if own:
            loads[layout.offsets[k] // layout.segment_numel] += layout.numel(k)
    mean = sum(loads) / len(loads)
    covered = sum(layout.numel(k) for k in range(len(layout.offsets)))
    return {"owned_max": max(loads), "owned_mean": mean,
            "imbalance": max(loads) / mean if mean else 1.0,
            "padding": 1 - covered / layout.total_numel}



def orthogonalisation_work(shape: Sequence[int]) -> int:
    """What orthogonalising a matrix of ``shape`` costs, up to a constant: one
    Newton-Schulz iteration multiplies ``m x n x m``, ``m x m x m`` and ``m x m x n``
    (``m <= n``), so ``m * m * (2n + m)``; a 3-D stack is that per matrix."""
    *batch, a, b = (list(shape) if len(shape) >= 2 else [1, 1])
    m, n = min(a, b), max(a, b)
    return math.prod(batch) * m * m * (2 * n + m)


def owned_loads(layout: SegmentLayout, weights: Sequence[int]) -> list[int]:
    """Per segment, the sum of ``weights[k]`` over the owned parameters it holds."""
    loads = [0] * layout.segments
    for k, own in enumerate(layout.owned):
        if own:
            loads[layout.offsets[k] // layout.segment_numel] += weights[k]
    return loads


BALANCE_SEGMENTS_MAX = 512  # past this, the search's segments**2 per buffer is not worth it


def balanced_rotations(loads: Sequence[Sequence[int]]) -> list[int] | None:
    """A rotation per buffer such that, over all of them, every segment's owners carry
    about the same work; None past ``BALANCE_SEGMENTS_MAX`` segments (keep the unit
    index). ``loads[b]``: buffer ``b``'s load per segment at rotation 0
    (:func:`owned_loads`); a rotation turns its ties, and so its loads, by that many
    segments (up to where the free parameters fit). Greedy, heaviest buffer first: each
    takes the turn that leaves the model's heaviest segment lightest (ties: the
    smallest sum of squares, then the lowest turn). The unit index as the rotation
    evens the work out only where the units outnumber the segments (two Llama blocks a
    unit over 32 segments leave one rank 2x the mean; this leaves it even)."""
    if not loads:
        return []
    segments = len(loads[0])
    if segments > BALANCE_SEGMENTS_MAX:
        return None
    turn = (np.arange(segments)[None, :] - np.arange(segments)[:, None]) % segments
    total = np.zeros(segments, dtype=np.float64)
    rotations = [0] * len(loads)
    for b in sorted(range(len(loads)), key=lambda b: (-sum(loads[b]), b)):
        turned = total[None, :] + np.asarray(loads[b], dtype=np.float64)[turn]  # [r, j]
        # lexicographic (max, sum of squares, r): argmin takes the lowest r of a tie
        peak = turned.max(axis=1)
        best = np.flatnonzero(peak == peak.min())
        squares = (turned[best] ** 2).sum(axis=1)
        rotations[b] = int(best[np.flatnonzero(squares == squares.min())[0]])
        total = turned[rotations[b]]
    return rotations
