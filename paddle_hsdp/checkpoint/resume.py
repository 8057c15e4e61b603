"""A fault-tolerant job resumed from its own joint checkpoint: the checkpoint side.

paddle_hsdp.ft and this package know nothing of each other (.importlinter): ft's
``Replica.load_checkpoint`` reaches this through :data:`paddle_hsdp.comm.state.state`'s
``resumer``, which ``paddle_hsdp.checkpoint`` registers at its import. Two calls:

* :meth:`Resumer.read` (``Replica.load_checkpoint``, before any round): the metadata,
  read once per group and broadcast inside it; refused on every rank of the group
  alike when it is no fault-tolerant job's joint checkpoint or does not fit the
  model. Returns what a resume needs beyond tensors (the metadata's ``ft``: the step,
  and per rank of the group that saved it its RNG, scheduler and user state).
* :meth:`Resumer.load` (inside the resumed job's first round, once the outer groups
  over the live groups exist): the tensors, read by the layout the job has now (a
  checkpoint's boxes are layout-free). When every member of the round loads, the
  groups split the reading over their outer group (each reads a disjoint share of
  the rows and broadcasts it; HFSDP's pieces of the optimizer state split among each
  piece's holders), so the job reads the checkpoint about once, not once per group.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

from .format import CheckpointError, read_metadata_once
from .items import all_items
from .load import load_counted

if TYPE_CHECKING:
    import paddle
    from paddle.distributed.communication.group import Group


class Resumer:
    """What ``paddle_hsdp.ft`` calls to resume from a checkpoint (see the module)."""

    def read(self, path: str | os.PathLike, model: paddle.nn.Layer,
             optimizer: paddle.optimizer.Optimizer) -> dict:
        """The checkpoint's resume state ``{"step", "ranks": [per rank]}``, after
        checking that it is a joint checkpoint of this model and optimizer (a
        collective inside the replica group: every rank raises alike)."""
        where = os.path.abspath(os.fspath(path))
        call = f"Replica.load_checkpoint({where!r})"
        items, holdings = all_items(model, optimizer, call)
        meta = read_metadata_once(where, call)
        resume = meta.get("ft")
        if not isinstance(resume, dict) or not resume.get("ranks"):
            raise CheckpointError(
                f"{call}: {where} holds no fault-tolerant job's resume state (its step, "
                "RNG, scheduler and attach()'s user state): it was saved outside a "
                "fault-tolerant job, or by a version before 2026-12-07. Load its tensors "
                "with paddle_hsdp.load_checkpoint(path, model, optimizer) instead (the "
                "job then trains from replica.step 0).")
        why = _mismatch(meta["tensors"], items, holdings.aliases)
        if why:
            raise CheckpointError(f"{call}: {where} is not a checkpoint of this model and "
                                  f"optimizer: {why}")
        return resume

    def load(self, path: str | os.PathLike, model: paddle.nn.Layer,
             optimizer: paddle.optimizer.Optimizer, together: bool,
             piece_group: Group | None = None) -> int:
        """Load the tensors into the model and optimizer as laid out now; returns the
        bytes this rank read from the checkpoint's files. ``together``: every member
        of the round loads (the groups split the reading over the outer group);
        ``piece_group``: then HFSDP's shared pieces too, a process group of the ranks
        holding this rank's piece (they split its rows)."""
        return load_counted(path, model, optimizer, live_groups_read_together=together,
                            piece_group=piece_group if together else None)[1]


def _mismatch(saved: dict, items: list, aliases: Mapping[str, str]) -> str | None:
    """Why the checkpoint's tensors (``saved``: the metadata's) are not this rank's
    items' (names, full shapes, dtypes), or None. Every rank of every group holds the
    same names (a fault-tolerant job has no expert parallelism across groups)."""
    mine = {it.name: it for it in items}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine) - set(aliases))
    if missing or unexpected:
        return (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, it in sorted(mine.items()):
        entry = saved[name]
        if list(entry["shape"]) != list(it.shape) or entry["dtype"] != it.dtype:
            return (f"{name} is saved as {entry['shape']} {entry['dtype']}, this model's is "
                    f"{list(it.shape)} {it.dtype}")
    return None
