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

The layout depends on the shapes and the two sizes only, so every rank (and the
planner, which builds no buffer) computes the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
        for k, offset in enumerate(self.offsets):
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


def segment_layout(shapes: Sequence[Sequence[int]], segments: int) -> SegmentLayout:
    """The smallest ``s`` (and the placement under it) this module's rules allow for
    parameters of ``shapes`` (in order) over ``segments`` segments."""
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
