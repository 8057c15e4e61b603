"""What a replica group must share with the others to take part in a round: its ranks
per group, outer sharding, piece count and model (every sharded parameter's name,
full shape and dtype). A group arrives with a hash of it (:class:`~.rounds.Arrival`
``config``); the full description is written once under that hash, so the group that
closes a round can name the first difference when it leaves a joiner out
(:meth:`~.rounds.Rounds._close`), before any process group is created for it. Plain
JSON: nothing here is executed when read.
"""

from __future__ import annotations

import hashlib
import json

from .store import count, key


def describe(ranks_per_group: int, outer_sharding: str, pieces: int, tensors) -> dict:
    """The configuration; ``tensors``: ``(name, full shape, dtype)`` of every sharded
    parameter, in the engine's order (the same on every rank and every group)."""
    return {"ranks_per_group": ranks_per_group, "outer_sharding": outer_sharding,
            "pieces": pieces, "tensors": [[n, list(s), str(d)] for n, s, d in tensors]}


def publish(store, config: dict) -> str:
    """Write ``config`` under its hash (once per hash) and return the hash."""
    text = json.dumps(config, sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    if not count(store, key("config", digest, "set")):
        store.set(key("config", digest), text)
        store.add(key("config", digest, "set"), 1)
    return digest


def read(store, digest: str) -> dict | None:
    if not digest or not count(store, key("config", digest, "set")):
        return None
    text = store.get(key("config", digest))
    return json.loads(text.decode() if isinstance(text, bytes) else text)


def first_difference(theirs: dict | None, ours: dict | None) -> str:
    """The first thing in which a joiner's configuration (``theirs``) differs from the
    members' (``ours``), in words."""
    if theirs is None or ours is None:
        return "its configuration could not be read"
    for field in ("ranks_per_group", "outer_sharding", "pieces"):
        if theirs[field] != ours[field]:
            return f"{field} {theirs[field]!r} where the running groups have {ours[field]!r}"
    a, b = theirs["tensors"], ours["tensors"]
    for mine, other in zip(a, b):
        if mine != other:
            return (f"parameter {mine[0]} {mine[1]} {mine[2]} where the running groups "
                    f"have {other[0]} {other[1]} {other[2]}")
    if len(a) != len(b):
        return f"{len(a)} sharded parameters where the running groups have {len(b)}"
    return "no difference found"
