"""``load_checkpoint``: read and check the rows this rank's blocks need; agree that all is
well; only then write parameters and optimizer state.

Outer replicas hold the same blocks: rather than each reading its own copy (the
checkpoint read once per replica), they split the reading by the save's rule
(checkpoint/plan.py: row chunks, largest first to the least loaded replica), each reads
and checks its chunks, and once every rank has read without error each chunk is
broadcast over the outer group from its reader. Bytes read from storage per load are
then about the checkpoint's size at any outer degree (whole CRC chunks: a chunk that
straddles two readers' rows is read by both). HFSDP's shared pieces of the optimizer
state (a fault-tolerant job's, ft/pieces.py) are held by a few of the outer group's
ranks each: a piece's holders split its rows alike, and each chunk goes from its reader
to the piece's other holders over a process group of them (no rank receives another
piece's rows)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from ..comm import collectives as comm
from ..comm.arrival import expect_everyone
from ..comm.traits import traits_of
from .format import (CheckpointError, errors_everywhere, gather_json,
                     largest_everywhere, rank_world, Reader,
                     numpy_dtype, read_box, read_metadata_once)
from .items import all_items
from .plan import assign
from .save import wait_for_pending_save

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from .items import Item
    from .plan import Write


def load_checkpoint(path: str | os.PathLike, model: paddle.nn.Layer,
                    optimizer: paddle.optimizer.Optimizer | None = None,
                    strict: bool = True, trainable_only: bool = False) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``), whatever layout either was in; return the saved ``extra``. A
    collective on a sharded model: call it on every rank. Nothing changes unless every
    rank read everything it needs. ``trainable_only=True``: only the parameters that
    are not frozen (``stop_gradient``) are read; the frozen ones keep their values."""
    return load_counted(path, model, optimizer, strict, trainable_only)[0]


def load_counted(path: str | os.PathLike, model: paddle.nn.Layer,
                 optimizer: paddle.optimizer.Optimizer | None = None, strict: bool = True,
                 trainable_only: bool = False, live_groups_read_together: bool = False,
                 piece_group: Group | None = None) -> tuple[Any, int]:
    """:func:`load_checkpoint`, returning ``(extra, bytes this rank read from the
    files)``. ``live_groups_read_together``: a fault-tolerant job's groups split the
    reading over their live outer group as outer replicas do (only inside a round every
    member loads in: checkpoint/resume.py); otherwise each group reads its own copy.
    ``piece_group``: with it, HFSDP's shared pieces: a process group of the ranks
    holding this rank's piece of the optimizer state, which split its rows as outer
    replicas do."""
    wait_for_pending_save()  # an async save still in flight is published first
    path = os.path.abspath(os.fspath(path))
    items, holdings = all_items(model, optimizer, "load_checkpoint", trainable_only)
    aliases, optimizer = holdings.aliases, holdings.optimizer
    call = f"load_checkpoint({path!r})"
    expect_everyone(None, call)
    loaded: list[tuple[Item, np.ndarray]] = []
    shared: list[SplitReading] = []
    bytes_read = 0
    error: Exception | None = None
    meta: dict = {}  # read only where error is None, so once read_metadata_once returned
    unexpected: list[str] = []
    try:
        meta = read_metadata_once(path, call)  # rank 0 reads, every rank parses
        params_saved = {n for n in meta["tensors"] if "/optim/" not in n}
        unexpected = sorted(params_saved - {it.name for it in items} - set(aliases))
    except Exception as e:
        error = e
    # unexpected only if no rank wants it (an EP rank holds only its own experts): the
    # names are gathered only where every rank that read the metadata has some
    mine, none = (unexpected if strict and error is None else None), 1 << 40
    fewest = -largest_everywhere(-(len(mine) if mine is not None else none), call)
    if fewest == 0:
        unexpected = []
    elif fewest != none:  # (none: not strict, or no rank read the metadata)
        for other in gather_json(mine, call):
            if other is not None:
                unexpected = sorted(set(unexpected) & set(other))
    if error is None:
        try:
            loaded, shared, bytes_read = _read_items(path, meta, items, optimizer,
                                                     unexpected if strict else [],
                                                     live_groups_read_together,
                                                     piece_group)
        except Exception as e:
            error = e
    errors = errors_everywhere(None if error is None else f"rank {rank_world()[0]}: {error}",
                                call)
    if errors:
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"load_checkpoint({path!r}): {error}") from error
        raise CheckpointError(f"load_checkpoint({path!r}) failed on another rank, nothing "
                              f"was changed: {'; '.join(errors)[:2000]}")
    for split in shared:  # every rank read its chunks: hand them round
        split.share()
    holdings.drop_gathered_copies()
    for it, array in loaded:
        it.put(array)
    if optimizer is None:  # DiLoCo's anchors: the params at the last sync, now these
        for unit in holdings.units:
            if unit.outer_sync is not None:
                unit.outer_sync.reanchor(unit)
    lr = getattr(optimizer, "_learning_rate", None)
    if meta.get("lr_scheduler") and lr is not None and hasattr(lr, "set_state_dict"):
        lr.set_state_dict(meta["lr_scheduler"])
    return meta.get("extra"), bytes_read


def _read_items(path: str, meta: dict, items: list[Item],
                optimizer: paddle.optimizer.Optimizer | None, unexpected: list[str],
                live_groups_read_together: bool = False, piece_group: Group | None = None,
                ) -> tuple[list[tuple[Item, np.ndarray]], list[SplitReading], int]:
    """``[(item, box read)]`` for every item, after checking names, full shapes, CRCs;
    the split readings to share; the bytes this rank read."""
    tensors = meta["tensors"]
    missing = sorted({it.name for it in items} - set(tensors))
    if optimizer is None:
        missing = [m for m in missing if "/optim/" not in m]
    if missing or unexpected:
        raise CheckpointError(
            f"{path!r} does not match this model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (strict=False ignores unexpected ones)")
    reader = Reader(path)
    loaded: list[tuple[Item, np.ndarray]] = []
    by_group: dict[tuple[int, ...], tuple[Group, list[Item]]] = {}
    pieces: list[Item] = []
    for it in items:
        entry = tensors[it.name]
        if list(entry["shape"]) != it.shape or entry["dtype"] != it.dtype:
            raise CheckpointError(
                f"{it.name}: the checkpoint has full shape {entry['shape']} {entry['dtype']}, "
                f"this model {it.shape} {it.dtype}{_split_note(entry, it)}; a layout maps only "
                "onto a model with the same full tensors")
        if it.empty:
            continue
        group = it.outer_group if any(a[0] == "outer" for a in it.replicas.axes) else None
        if it.piece is not None and piece_group is not None and piece_group.nranks > 1:
            # HFSDP's shared piece: its holders split its rows (a round of a
            # fault-tolerant job where every member resumes: checkpoint/resume.py)
            pieces.append(it)
        elif group is None or group.nranks <= 1 or (
                traits_of(group).joint_save is not None and not live_groups_read_together):
            loaded.append((it, read_box(reader, it.name, entry, it.offset, it.size)))
        else:  # the outer replicas split the reading (a fault-tolerant job's groups only
            # when they load together, in a round)
            by_group.setdefault(tuple(group.ranks), (group, []))[1].append(it)
    # one order on every member of each group
    shared = [SplitReading(group, group_items, "outer")
              for group, group_items in (by_group[k] for k in sorted(by_group))]
    if pieces and piece_group is not None:
        shared.append(SplitReading(piece_group, pieces, "piece"))
    for split in shared:
        split.read(reader, tensors)
        loaded += [(it, split.arrays[it.name]) for it in split.items]
    return loaded, shared, reader.bytes_read


class SplitReading:
    """Boxes that every rank of ``group`` holds alike: each reads the chunks the plan
    gives its index (:func:`split_plan`), then :meth:`share` broadcasts each chunk from
    its reader to the others."""

    def __init__(self, group: Group, items: list[Item], kind: str):
        self.group = group
        self.items = sorted(items, key=lambda it: it.name)
        self.plan = split_plan(self.items, group.nranks, kind)
        self.arrays = {it.name: np.empty(it.size, numpy_dtype(it.dtype)) for it in self.items}

    def read(self, reader: Reader, tensors: dict) -> None:
        for write, reader_index in self.plan:
            if reader_index == self.group.rank:
                name = write.item.name
                self.arrays[name][write.lo:write.hi] = read_box(
                    reader, name, tensors[name], write.offset, write.shape)

    def share(self) -> None:
        """Each chunk from the rank that read it to the others (as bytes: bfloat16's
        bits travel as they are)."""
        group = self.group
        for write, reader_index in self.plan:
            raw = self.arrays[write.item.name][write.lo:write.hi].reshape(-1).view(np.uint8)
            message = paddle.to_tensor(raw) if reader_index == group.rank else \
                paddle.zeros([raw.size], dtype="uint8")
            comm.broadcast(message, src=group.ranks[reader_index], group=group,
                           tag="checkpoint", what=f"load_checkpoint: rows {write.lo}.."
                                                  f"{write.hi} of {write.item.name}")
            if reader_index != group.rank:
                raw[:] = message.numpy()


def split_plan(items: list[Item], readers: int, kind: str) -> list[tuple[Write, int]]:
    """Which reader (an index among ``readers``) reads which rows of ``items`` (sorted
    by name, the same on every reader): checkpoint/plan.py's chunks, largest first to
    the least loaded, so each reads about 1/``readers`` of the bytes, every row once."""
    return assign(((kind, readers),), items, readers)


def _split_note(entry: dict, item: Item) -> str:
    """How each side's tensor parallelism cut the tensor, when either did."""
    saved, here = entry.get("split"), item.split
    if saved is None and here is None:
        return ""
    return (f" (tensor-parallel split saved {saved or 'none'}, here {here or 'none'}: the "
            "full shapes are compared, so a different mp degree alone is fine)")
