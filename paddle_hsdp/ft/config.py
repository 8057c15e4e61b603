"""What a replica group must share with the others to take part in a round: its ranks
per group, outer sharding, piece count and model (every sharded parameter's name,
full shape and dtype). A group arrives with a hash of it (:class:`~.protocol.Arrival`
``config``); the full description is written once under that hash on the job's etcd,
so the round's decider can name the first difference when it leaves a joiner out
(:func:`~.protocol.first_difference`), before any process group is created for it.
Plain JSON: nothing here is executed when read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence


def describe(ranks_per_group: int, outer_sharding: str, pieces: int,
             tensors: Iterable[tuple[str, Sequence[int], object]],
             outer_sync: Sequence[Sequence] = (), layout_degree: int | None = None) -> dict:
    """The configuration; ``tensors``: ``(name, full shape, dtype)`` of every sharded
    parameter, in the engine's order (the same on every rank and every group);
    ``outer_sync``: ``[unit index, DiLoCo policy's fields]`` of every unit that syncs
    every H steps (none without DiLoCo); ``layout_degree``: the segments every buffer is
    laid out over (engine/layout.py, [Note: the layout degree]; None: not recorded)."""
    return {"ranks_per_group": ranks_per_group, "outer_sharding": outer_sharding,
            "pieces": pieces, "tensors": [[n, list(s), str(d)] for n, s, d in tensors],
            "outer_sync": [list(u) for u in outer_sync],
            **({"layout_degree": layout_degree} if layout_degree is not None else {})}


def digest(config: dict) -> tuple[str, str]:
    """``(hash, text)`` of ``config``: the group arrives with the hash and publishes the
    text under it."""
    text = json.dumps(config, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16], text
