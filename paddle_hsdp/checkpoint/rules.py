"""HFSDP's optimizer rows in the index by rule, not piece by piece.

With outer sub-shards (``fsdp_outer_sharding="optim"``) each rank's optimizer holds
rows of every parameter of its buffers that no other rank holds: listed piece by piece,
the index would hold a piece per state per buffer per rank, growing with the world.
Yet those rows are where the buffer's segment layout puts them (engine/layout.py:
segment ``j = inner rank * parts + outer part``), numbers fixed by the buffer's shapes
and sizes. So a save records, per buffer and mp rank, the layout's numbers and which
parameter sits where (a :class:`Rule`), and each FSDP group's ranks once; every rank
writes its own rows into its own file, their CRCs in the file's header; a load
computes which segments, so which files, hold the rows it needs. The index grows with
the parameters and with the ranks (one number each), never with their product.

Each group's ranks are recorded laid out ``[outer, inner]``: the rank whose segments
start at ``i * parts + q`` (inner index ``i``, outer part ``q``) is ``ranks[q * inner +
i]``, as every member reports its own place (:func:`place_of`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.layout import SegmentLayout
from .boxes import intersect

if TYPE_CHECKING:
    from ..engine.holdings import HeldBuffer
    from .boxes import Box


@dataclass(frozen=True)
class Spot:
    """Where a ruled item's rows sit: its buffer, the parameter's index in the buffer's
    layout, and the full tensor's offset of the slice's row 0 (the box the buffer's
    rows of this parameter are cut from)."""
    buffer: HeldBuffer
    index: int
    base: tuple


def group_id(buf: HeldBuffer, members: list[int]) -> str:
    """A name for the buffer's FSDP group (``members``: its ranks), the same on its every
    rank and distinct from any other group's (explicit meshes may share a first rank)."""
    kind = "expert" if buf.expert else "dense"
    return f"{kind}:{members[0]}:{zlib.crc32(repr(list(members)).encode()):08x}"


def place_of(buf: HeldBuffer, rank: int, gid: str) -> list:
    """``[group, inner index, outer part, rank]``: where this rank sits in the group's
    grid (its segment is ``inner index * parts + outer part``). Rank 0 builds each
    group's ranks from every member's place, so no layout of the group is assumed."""
    return [gid, buf.inner_rank, buf.part, rank]


def grids(places: list, rules: dict) -> dict:
    """``{group: its ranks, laid out [outer, inner]}`` from every member's place
    (:func:`place_of`); raises ValueError unless each group's grid is filled exactly
    once."""
    shape = {r["group"]: (r["inner"], r["parts"]) for r in rules.values()}
    out: dict = {}
    for gid, i, q, rank in places:
        if gid not in shape:
            raise ValueError(f"rank {rank} is in group {gid}, which no rule names")
        inner, parts = shape[gid]
        cells = out.setdefault(gid, [None] * (inner * parts))
        if not (0 <= i < inner and 0 <= q < parts) or cells[q * inner + i] is not None:
            raise ValueError(f"group {gid}: rank {rank} at inner {i}, part {q} clashes")
        cells[q * inner + i] = rank
    for gid, cells in out.items():
        if None in cells:
            raise ValueError(f"group {gid}: {cells.count(None)} places unfilled")
    return out


def rule_of(buf: HeldBuffer, gid: str, stage: int, tensors: dict) -> dict:
    """The rule of ``buf`` (JSON): its layout, its FSDP group ``gid``, and for each
    ruled tensor ``[parameter index, base offset, trailing shape, full shape, dtype,
    split]`` (``tensors``: name -> those)."""
    layout = buf.layout
    return {"group": gid, "inner": buf.inner_size, "parts": buf.parts, "stage": stage,
            "segment_numel": layout.segment_numel, "segments": layout.segments,
            "offsets": list(layout.offsets), "rows": list(layout.rows),
            "row_numels": list(layout.row_numels), "tensors": tensors}


def slice_box(rule: dict, name: str) -> tuple[tuple, tuple]:
    """The box of the full tensor ``name`` that ``rule``'s buffer holds (every row)."""
    k, base, rest = rule["tensors"][name][:3]
    return tuple(base), tuple([rule["rows"][k]] + list(rest))


@dataclass(frozen=True)
class Ruled:
    """A rule as a load uses it: the rule, its group's ranks, its layout."""
    rule: dict
    ranks: list
    layout: SegmentLayout


def link(meta: dict) -> None:
    """Give each ruled tensor of ``meta`` (format 4) its rules, as ``entry["ruled"]``
    (:class:`Ruled`, in memory only)."""
    groups, linked = meta.get("rank_groups", {}), {}
    for rule_id, rule in meta.get("rules", {}).items():
        layout = SegmentLayout(rule["segment_numel"], rule["segments"], tuple(rule["offsets"]),
                               tuple(rule["rows"]), tuple(rule["row_numels"]))
        linked[rule_id] = Ruled(rule, groups[rule["group"]], layout)
    for entry in meta["tensors"].values():
        entry["ruled"] = [linked[r] for r in entry.get("rules", ())]


def pieces(ruled: Ruled, name: str, want: Box) -> list[dict]:
    """The pieces of tensor ``name`` under a rule that overlap the box ``want``
    (``(offset, shape)``): each rank's rows, in its file under the tensor's name (the
    CRCs are in that file's header)."""
    rule, layout = ruled.rule, ruled.layout
    common = intersect(want, slice_box(rule, name))
    if common is None:
        return []
    k, base, rest = rule["tensors"][name][:3]
    row_numel, inner, parts = layout.row_numels[k], rule["inner"], rule["parts"]
    lo = common[0][0] - base[0]
    start = layout.offsets[k] + lo * row_numel
    stop = start + common[1][0] * row_numel
    out = []
    for j in range(start // layout.segment_numel, (stop - 1) // layout.segment_numel + 1):
        first, count = layout.rows_in(k, j)
        if count == 0:
            continue
        i, q = divmod(j, parts)
        out.append({"offset": [base[0] + first] + list(base[1:]), "shape": [count] + list(rest),
                    "file": f"rank-{ruled.ranks[q * inner + i]:05d}.safetensors",
                    "key": name})
    return out


CRC_PREFIX = "crc32/"  # a ruled piece's CRCs, in its file's header


def crc_header(key: str, chunk_rows: int, crcs: list[int]) -> tuple[str, str]:
    return CRC_PREFIX + key, json.dumps([chunk_rows] + crcs)


def crc_of(header: dict, key: str) -> tuple[int, list[int]]:
    """``(chunk rows, CRCs)`` of ``key`` from a file's header (KeyError: none there)."""
    text = (header or {}).get(CRC_PREFIX + key)
    if text is None:
        raise KeyError(f"no CRCs for {key!r} in the file's header")
    values = json.loads(text)
    return values[0], values[1:]
