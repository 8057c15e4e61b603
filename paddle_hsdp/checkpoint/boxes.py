"""Boxes: the rectangular blocks of a tensor that a checkpoint piece holds or a rank
needs, as ``(offset, shape)`` in the full (logical) tensor's coordinates.

A piece written by one rank is its inner block of rows of its tensor-parallel slice: a
box. A rank that loads needs the box of its own block in its own layout; it reads the
intersections with the pieces that overlap it. A 0-d tensor is one element, box
``([0], [1])``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


def dims(shape: Sequence[int]) -> list[int]:
    """``shape`` as a box's dimensions (a 0-d tensor is one element)."""
    return [int(d) for d in shape] or [1]


def volume(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None when they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The index of box ``inner`` inside an array holding box ``outer``."""
    return tuple(slice(i - o, i - o + n) for i, o, n in zip(inner[0], outer[0], inner[1]))


def tiling_error(full_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` (distinct) do not tile a tensor of ``full_shape`` exactly once, or
    None when they do: each inside it, no two overlapping, together all of it.

    O(n log n): the boxes fall into bands of one extent on every dim but the first (a
    tensor-parallel slice's column block); bands whose extents are disjoint are checked
    by sorting each band's row intervals. Bands that partly overlap each other (no
    layout makes them) fall back to comparing every pair."""
    full = dims(full_shape)
    if not boxes:
        return "no rank holds any of it"
    lo = np.array([b[0] for b in boxes], dtype=np.int64)
    hi = lo + np.array([b[1] for b in boxes], dtype=np.int64)
    if lo.shape[1] != len(full):
        return f"pieces of {lo.shape[1]} dims for a tensor of shape {list(full_shape)}"
    if (lo < 0).any() or (hi > np.array(full)).any():
        bad = int(np.flatnonzero((lo < 0).any(1) | (hi > np.array(full)).any(1))[0])
        return f"a piece {list(boxes[bad][0])} + {list(boxes[bad][1])} lies outside it"
    bands: dict[tuple, list[int]] = {}
    for i in range(len(boxes)):
        bands.setdefault((tuple(lo[i, 1:]), tuple(hi[i, 1:])), []).append(i)
    pair = _overlapping_pair(lo, hi, bands)
    if pair is not None:
        i, j = pair
        return (f"two different pieces overlap ({list(boxes[i][0])} + {list(boxes[i][1])} and "
                f"{list(boxes[j][0])} + {list(boxes[j][1])})")
    covered = int((hi - lo).prod(axis=1).sum())
    if covered != volume(full):
        return f"its pieces cover {covered} of its {volume(full)} elements"
    return None


def _overlapping_pair(lo: np.ndarray, hi: np.ndarray, bands: dict) -> tuple[int, int] | None:
    """Two overlapping boxes (indices), or None."""
    keys = list(bands)
    if len(keys) > 1:
        blo = np.array([k[0] for k in keys], dtype=np.int64).reshape(len(keys), -1)
        bhi = np.array([k[1] for k in keys], dtype=np.int64).reshape(len(keys), -1)
        if blo.shape[1]:
            cross = ((blo[:, None, :] < bhi[None, :, :])
                     & (blo[None, :, :] < bhi[:, None, :])).all(-1)
            np.fill_diagonal(cross, False)
            if cross.any():  # bands that share columns: compare every pair of boxes
                return _any_pair(lo, hi)
    for members in bands.values():  # within a band, only the rows can overlap
        members = sorted(members, key=lambda i: (lo[i, 0], hi[i, 0]))
        for a, b in zip(members, members[1:]):
            if lo[b, 0] < hi[a, 0]:
                return a, b
    return None


def _any_pair(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    overlap = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(-1)
    np.fill_diagonal(overlap, False)
    if overlap.any():
        i, j = (int(k) for k in np.argwhere(overlap)[0])
        return i, j
    return None
