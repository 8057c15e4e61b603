"""Placements ``fully_shard(shard_placement_fn=...)`` takes beyond torch's: :class:`Owned`,
a parameter kept whole on one rank of its FSDP group ([Note: owned parameters] in
:mod:`~paddle_hsdp.engine.layout`), and :func:`owned_matrices`, the placement function
that owns what a Muon-style optimizer updates as a whole matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import paddle

from ..optim.muon import MUON_EXCLUDE


class Owned:
    """Keep the parameter whole on one rank of its inner group (one rank of inner x
    outer with ``fsdp_outer_sharding="optim"``); the others hold a 0-row shard. Its
    buffer's collectives stay the same; the owners are balanced by bytes. For
    optimizers that update a matrix as a whole (Muon): the owner's optimizer sees the
    whole matrix, and its state lives there only."""

    def __repr__(self) -> str:
        return "Owned()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Owned)

    def __hash__(self) -> int:
        return hash(Owned)


def owned_matrices(exclude_patterns: Sequence[str] = MUON_EXCLUDE,
                   names: dict[int, str] | None = None
                   ) -> Callable[[paddle.Tensor], Owned | None]:
    """A ``shard_placement_fn`` that owns every 2-D parameter whose name contains none of
    ``exclude_patterns`` (case-insensitive; Paddle's Muon's rule), the others keep the
    row layout. A 3-D expert stack needs no owner: its rows are whole matrices, and the
    row layout cuts only between rows. ``names``: ``{id(param): structured name}``
    (``dict((id(p), n) for n, p in model.named_parameters())``) to match those as well as
    ``param.name``, as PaddleFormers does."""
    patterns = tuple(p.lower() for p in exclude_patterns)

    def placement(param: paddle.Tensor) -> Owned | None:
        if len(param.shape) != 2:
            return None
        labels = [param.name.lower()] + ([names[id(param)].lower()]
                                         if names and id(param) in names else [])
        if any(p in label for p in patterns for label in labels):
            return None
        return Owned()
    return placement
