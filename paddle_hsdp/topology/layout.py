"""HSDP layout math: FSDP rank lists in, ``[outer, inner]`` lists out.

Pure functions, no Paddle processes, so every layout rule is unit-testable.

An FSDP group (the sharding group for dense params, the moe_sharding group for expert
params when EP > 1) is reshaped row-major to ``[outer, inner]``: each row is an inner
group (the ranks that shard a buffer between them, meant to sit on one machine), each
column an outer group (the replicas of one shard, one per machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

Ranks = tuple[int, ...]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_outer_degree(outer_degree: object, group_sizes: dict[str, int]) -> int:
    """Check ``fsdp_outer_degree`` against every FSDP group size; return it as an int.

    ``group_sizes`` maps a label ("dense", "expert") to that FSDP group's size.  Raises
    ``ValueError`` naming the value, the sizes and the valid choices.
    """
    sizes = ", ".join(f"{k} FSDP group size {v}" for k, v in group_sizes.items())
    common = sorted(set.intersection(*(set(divisors(v)) for v in group_sizes.values())))
    if isinstance(outer_degree, bool) or not isinstance(outer_degree, int):
        raise ValueError(
            f"sharding_configs['fsdp_outer_degree'] must be an int, got "
            f"{outer_degree!r} ({type(outer_degree).__name__}); with {sizes} the valid "
            f"choices are {common}."
        )
    bad = [k for k, v in group_sizes.items() if outer_degree < 1 or v % outer_degree]
    if bad:
        raise ValueError(
            f"sharding_configs['fsdp_outer_degree']={outer_degree} must be >= 1 and divide "
            f"the FSDP group size ({sizes}); valid choices: {common}."
        )
    return outer_degree


def split_fsdp_group(ranks: Sequence[int], outer_degree: int) -> tuple[list[Ranks], list[Ranks]]:
    """Reshape one FSDP group to ``[outer, inner]``; return (inner rows, outer columns)."""
    ranks = tuple(ranks)
    validate_outer_degree(outer_degree, {"FSDP": len(ranks)})
    inner = len(ranks) // outer_degree
    rows = [ranks[o * inner:(o + 1) * inner] for o in range(outer_degree)]
    cols = [tuple(row[i] for row in rows) for i in range(inner)]
    return rows, cols


@dataclass(frozen=True)
class RankGroups:
    """The FSDP, inner and outer groups one rank belongs to, for dense or expert params."""

    fsdp: Ranks
    inner: Ranks
    outer: Ranks


@dataclass
class HSDPLayout:
    """Every HSDP group of the job, in the one order all ranks create them.

    ``creation_order`` lists each distinct member tuple once: a dense and an expert
    outer group with the same ranks are one communicator, never two.
    """

    outer_degree: int
    dense: dict[int, RankGroups] = field(default_factory=dict)
    expert: dict[int, RankGroups] = field(default_factory=dict)
    creation_order: list[Ranks] = field(default_factory=list)

    def groups_of(self, rank: int, is_expert: bool = False) -> RankGroups:
        return (self.expert if is_expert else self.dense)[rank]


def _sorted_unique(groups: Sequence[Sequence[int]]) -> list[Ranks]:
    return sorted({tuple(g) for g in groups})


def plan_hsdp_layout(
    dense_fsdp_groups: Sequence[Sequence[int]],
    expert_fsdp_groups: Sequence[Sequence[int]] | None,
    outer_degree: int,
) -> HSDPLayout:
    """Plan the inner/outer groups of every FSDP group of the job.

    ``dense_fsdp_groups`` are all sharding groups (several when mp or pp > 1),
    ``expert_fsdp_groups`` all moe_sharding groups (``None``: experts use the dense
    groups).  The creation order is global: dense groups by first rank (inner rows then
    outer columns of each), then expert groups likewise, skipping member tuples already
    listed.  Every rank computes the same plan, so group ids stay consistent.
    """
    dense = _sorted_unique(dense_fsdp_groups)
    expert = _sorted_unique(expert_fsdp_groups) if expert_fsdp_groups is not None else dense
    sizes = {"dense": len(dense[0])}
    if expert is not dense:
        sizes["expert"] = len(expert[0])
    validate_outer_degree(outer_degree, sizes)
    _check_partition(dense, "dense")
    _check_partition(expert, "expert")

    layout = HSDPLayout(outer_degree)
    seen: set[Ranks] = set()
    for kind, fsdp_groups in (("dense", dense), ("expert", expert)):
        table = layout.dense if kind == "dense" else layout.expert
        for fsdp in fsdp_groups:
            rows, cols = split_fsdp_group(fsdp, outer_degree)
            for members in rows + cols:
                if members not in seen:
                    seen.add(members)
                    layout.creation_order.append(members)
            # each rank sits in one row and one column: O(ranks), not rows x columns
            row_of = {rank: row for row in rows for rank in row}
            col_of = {rank: col for col in cols for rank in col}
            for rank in fsdp:
                table[rank] = RankGroups(fsdp, row_of[rank], col_of[rank])
    return layout


def _check_partition(groups: list[Ranks], kind: str) -> None:
    """FSDP groups of one kind must be equal-sized and disjoint (a partition of ranks)."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"{kind} FSDP groups have different sizes: {groups}")
    flat = [r for g in groups for r in g]
    if len(flat) != len(set(flat)):
        raise ValueError(f"{kind} FSDP groups overlap: {groups}")
