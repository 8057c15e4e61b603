"""A fault-tolerant job resumed from its own joint checkpoint: the replica's side.

After the whole job stopped, every rank of every group calls
``replica.load_checkpoint(path)`` after ``attach`` and before the first ``train_step``:

1. :func:`start` (no cross-group collective): the checkpoint's metadata is read once
   per group and checked (a joint checkpoint of this model, saved by groups of as many
   ranks); the step, RNG, scheduler and ``attach``'s user state (a loader's position)
   of the rank of the same index in the group that saved it are loaded now, and the
   group is no longer fresh: it arrives at the first round with the checkpoint's step,
   so no state moves between groups that all resumed.
2. :func:`load_in_round` (the round's set-up, once the outer groups exist, before any
   transfer): the tensors, by the job's layout now (another number of groups or
   another outer sharding reads the same layout-free boxes). When every member of the
   round resumes (none fresh, none behind, no receiver), the groups split the reading
   over the outer group: each reads a disjoint share of the rows and broadcasts it
   (HFSDP's pieces of the optimizer state: among each piece's holders,
   :func:`piece_holders`, over a process group of them), so the job reads the
   checkpoint about once. Otherwise (a fresh group joined the first round) each
   resuming group reads its own copy, then the round's transfer runs as usual. A
   receiver takes its donor's state instead, and reads nothing.

The resume stays pending until the group commits a step: a round that fails after
the load (a group died) loads again in the next, over the groups then live.

The checkpoint code is reached through ``paddle_hsdp.comm.state``'s ``resumer``
(checkpoint/resume.py): this package and paddle_hsdp.checkpoint import nothing of
each other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..comm.gloo_store import forget_group_store
from ..comm.state import state
from . import groups

if TYPE_CHECKING:
    from .pieces import PiecePlan
    from .protocol import Round


def _resumer() -> Any:
    resumer = state.resumer
    if resumer is None:  # paddle_hsdp.checkpoint registers it at import
        raise RuntimeError("Replica.load_checkpoint: paddle_hsdp.checkpoint is not "
                           "imported (`import paddle_hsdp` first)")
    return resumer


def start(replica: Any, path: str | os.PathLike) -> str:
    """Check ``path`` and load what the checkpoint holds besides tensors (see the
    module); returns the absolute path the round's set-up loads the tensors from."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"Replica.load_checkpoint: path must be a checkpoint folder (str "
                        f"or os.PathLike), got {path!r}")
    if replica.model is None or replica.optimizer is None:
        raise RuntimeError("Replica.load_checkpoint: call attach(model, optimizer, ...) "
                           "first (the checkpoint loads into what attach was given)")
    if replica.step != 0 or replica.round is not None or replica.history:
        raise RuntimeError(
            f"Replica.load_checkpoint: call it before the first train_step (this group "
            f"has taken {replica.step} steps, or its first round already formed): a "
            "resume sets the step every group arrives with at the first round.")
    where = os.path.abspath(os.fspath(path))
    resume = _resumer().read(where, replica.model, replica.optimizer)
    ranks = resume["ranks"]
    if len(ranks) != replica.ranks_per_replica:
        raise ValueError(
            f"Replica.load_checkpoint({where!r}): it was saved by replica groups of "
            f"{len(ranks)} ranks, this group has {replica.ranks_per_replica}: each rank "
            "takes the RNG and user state of the saving group's rank of its index. "
            f"Launch the groups with --nproc_per_node={len(ranks)}.")
    replica._load_plain_state(ranks[replica.rank])
    return where


def load_in_round(replica: Any, path: str, record: Round, receiving: bool) -> int:
    """The round's set-up: this group's tensors from ``path`` (see the module);
    returns the bytes this rank read (0 for a receiver)."""
    if receiving:
        return 0
    # every member is a group that resumed and has not stepped since: all take part
    # in the split reading (decided from the round's record, alike on every member)
    together = not record.receivers and all(
        not a.fresh and a.step == record.step for a in record.members.values())
    plan = replica.piece_plan
    holders = piece_holders(plan, record) if together else []
    # HFSDP: the holders of this replica's piece split its reading over a group of their
    # own (all of them take this branch: the holders follow from the round's record)
    piece_group = groups.connect_holders(
        replica.store, record.number, plan.part, holders, replica.outer,
        replica.round_timeout_s) if plan is not None and len(holders) > 1 else None
    try:
        return int(_resumer().load(path, replica.model, replica.optimizer, together,
                                   piece_group))
    finally:
        if piece_group is not None:  # every holder connected: the rendezvous is over
            forget_group_store(piece_group.id)


def piece_holders(plan: PiecePlan | None, record: Round) -> list[int]:
    """HFSDP's shared pieces: the round's members whose own piece is this replica's
    (their optimizers hold its rows; sorted), from the round's record, alike on each
    of them; [] without pieces. A member the re-cut gives the piece besides its own
    takes it from a holder in the round's transfer, after the load."""
    if plan is None:
        return []
    return [r for r in sorted(record.replicas) if plan.piece_of(r) == plan.part]
