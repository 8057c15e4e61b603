"""Placements ``fully_shard(shard_placement_fn=...)`` takes beyond torch's: :class:`Owned`,
a parameter kept whole on one rank of its FSDP group ([Note: owned parameters] in
:mod:`~paddle_hsdp.engine.layout`), and :func:`owned_matrices`, the placement function
that owns what a Muon-style optimizer updates as a whole matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import paddle

from ..optim.muon import MUON_EXCLUDE, MuonParamInfo, default_should_use_muon


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
                   info: dict[str, MuonParamInfo] | None = None
                   ) -> Callable[[paddle.Tensor], Owned | None]:
    """A ``shard_placement_fn`` that owns every 2-D parameter Muon updates, the others
    keeping the row layout: by ``info`` (``{param.name: MuonParamInfo}``, the map given
    to ``Muon(muon_param_info_map=...)``; :func:`~paddle_hsdp.optim.muon.muon_param_info`
    builds one from structured names), else Muon's default rule on ``param.name``
    (2-D, no ``exclude_patterns`` fragment). A 3-D expert stack needs no owner: its rows
    are whole matrices, and the row layout cuts only between rows. A frozen matrix
    (``stop_gradient``) keeps the row layout: no optimizer updates it, and an owner
    would only unbalance the others."""
    def placement(param: paddle.Tensor) -> Owned | None:
        if len(param.shape) != 2 or param.stop_gradient:
            return None
        entry = (info or {}).get(param.name)
        use = entry.use_muon if entry is not None else \
            default_should_use_muon(param.name, param.shape, exclude_patterns)
        return Owned() if use else None
    return placement
