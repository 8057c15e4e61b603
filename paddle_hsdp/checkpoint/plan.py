"""Who writes what in a save, decided by rule on each rank alone: no rank learns what
the others hold, so a rank's planning costs what its own items cost, at any world size.

An item's **holders** are the ranks that hold the identical box: the ranks that differ
from this one only on the item's replica axes (:class:`Replicas`: the outer replicas
of a sharded block, the mp ranks of a tensor parallelism does not split, the sharding
ranks of an unsharded tensor, the data-parallel replicas). Every holder holds the same
items of that kind (same axes), in the same boxes, so each can run the same plan over
them and find the same answer: each item is cut into row chunks of at most a quarter
of its bytes per holder (and no smaller than :data:`MIN_CHUNK_BYTES`), so no chunk
exceeds a quarter of a holder's fair share of the kind, and the chunks go, largest
first, to the holder with the fewest bytes so far (ties by a
rotation of the holders particular to the kind, so the first holder does not take the
largest chunk of every kind). A holder writes the chunks that fall to its own index:
every distinct box is written once, and the slowest writer carries at most about
1.25x the mean (the chunk bound) where the model is large enough to cut.

Scalars (AdamW's beta powers: one element per parameter, held by every rank) are not
written into files: their one writer returns the value, and it goes into the metadata
(:data:`INLINE_MAX`), so no file holds only scalars and a load opens none for them.
"""

from __future__ import annotations

import heapq
import math
import zlib
from dataclasses import dataclass
from typing import Collection, Generic, Iterable, Protocol, TypeVar

from .boxes import volume

MIN_CHUNK_BYTES = 32 << 20  # never cut finer: the index stays small (8 CRC chunks)
INLINE_MAX = 1  # elements: a tensor this small goes into the metadata, not a file
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8,
             "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "uint16": 2}


@dataclass(frozen=True)
class Replicas:
    """The axes along which other ranks hold the same box: ``((axis, size, my index),
    ...)`` in one order on every rank; () for a box only this rank holds."""
    axes: tuple = ()

    @property
    def count(self) -> int:
        return math.prod(size for _, size, _ in self.axes)

    @property
    def index(self) -> int:
        """This rank's place among the holders (mixed radix over the axes)."""
        index = 0
        for _, size, mine in self.axes:
            index = index * size + mine
        return index

    @property
    def kind(self) -> tuple:
        """What tells one kind of item from another: the axes and their sizes."""
        return tuple((axis, size) for axis, size, _ in self.axes)

    def without(self, names: Collection[str]) -> Replicas:
        return Replicas(tuple(a for a in self.axes if a[0] not in names))


class PlannedItem(Protocol):
    """What a plan reads of an item (checkpoint/items.py's, which imports this module):
    its name, full shape, box and dtype, and who else holds the box."""

    name: str
    shape: list[int]
    offset: list[int]
    size: list[int]
    dtype: str
    replicas: Replicas


# the items a plan is made of (checkpoint/items.py's Item), which its writes hand back
ItemT = TypeVar("ItemT", bound=PlannedItem)


@dataclass(frozen=True)
class Write(Generic[ItemT]):
    """Rows ``[lo, hi)`` of ``item`` (its own rows: ``item.offset[0] + lo`` in the full
    tensor) go to a file; ``inline``: the whole item goes into the metadata instead."""
    item: ItemT
    lo: int
    hi: int
    inline: bool = False

    @property
    def whole(self) -> bool:
        """Every row of the item (not one chunk of it)."""
        return (self.lo, self.hi) == (0, self.item.size[0])

    @property
    def offset(self) -> list:
        """Where the rows start in the full tensor."""
        return [self.item.offset[0] + self.lo] + list(self.item.offset[1:])

    @property
    def shape(self) -> list:
        return [self.hi - self.lo] + list(self.item.size[1:])


def item_bytes(item: PlannedItem) -> int:
    return volume(item.size) * _ITEMSIZE.get(item.dtype, 4)


def inline(item: PlannedItem) -> bool:
    return volume(item.size) <= INLINE_MAX and volume(item.shape) <= INLINE_MAX


def plan_writes(items: Iterable[ItemT], drop_axes: Collection[str] = ()) -> list[Write[ItemT]]:
    """What this rank writes of ``items`` (each with ``name``, ``size``, ``dtype`` and
    ``replicas``, a :class:`Replicas`), by the rule of the module docstring. Axes named
    in ``drop_axes`` do not count as replicas (a fault-tolerant job's replica groups:
    which group writes is decided there)."""
    kinds: dict[tuple, list[ItemT]] = {}  # by the axes with this rank's index on each
    for item in items:
        replicas = item.replicas.without(drop_axes)
        kinds.setdefault(replicas.axes, []).append(item)
    writes = []
    for axes in sorted(kinds, key=repr):
        replicas = Replicas(axes)
        group = sorted(kinds[axes], key=lambda item: item.name)
        for write, holder in assign(replicas.kind, group, replicas.count):
            if holder == replicas.index:
                writes.append(write)
    return writes


def assign(kind: tuple, items: list[ItemT], holders: int) -> list[tuple[Write[ItemT], int]]:
    """Every chunk of ``items`` (one kind, sorted by name, the same on every holder)
    with the holder index that writes it."""
    if holders == 1:
        return [(Write(it, 0, it.size[0], inline(it)), 0) for it in items]
    small = [it for it in items if inline(it)]
    large = [it for it in items if not inline(it)]
    chunks = []
    for it in large:
        rows = it.size[0]
        row_bytes = max(1, item_bytes(it) // max(rows, 1))
        # the cuts depend on the item and the holders alone: a box held on two stages
        # (a tied layer), whose kinds hold other items, is cut alike on both
        cap = max(MIN_CHUNK_BYTES, math.ceil(item_bytes(it) / holders / 4))
        step = max(1, cap // row_bytes)
        chunks += [(min(step, rows - lo) * row_bytes, Write(it, lo, min(lo + step, rows)))
                   for lo in range(0, rows, step)]
    chunks += [(item_bytes(it), Write(it, 0, it.size[0], True)) for it in small]
    # largest first, the same order on every holder (ties by name and rows)
    chunks.sort(key=lambda c: (-c[0], c[1].item.name, c[1].lo))
    turn = zlib.crc32(repr(kind).encode()) % holders  # this kind's first holder
    loads = [(0, (h - turn) % holders, h) for h in range(holders)]
    heapq.heapify(loads)
    out = []
    for nbytes, write in chunks:
        load, order, holder = heapq.heappop(loads)
        out.append((write, holder))
        heapq.heappush(loads, (load + nbytes, order, holder))
    return out
