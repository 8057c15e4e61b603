"""``load_checkpoint``: read and check, on every rank, the rows this rank's blocks need;
agree that all is well; only then write parameters and optimizer state."""

from __future__ import annotations

import os

from ..comm.arrival import expect_everyone
from ..engine.registry import units_under
from .format import (CheckpointError, _errors_everywhere, _gather_json, _rank_world, _Reader,
                     read_box, read_metadata)
from .items import _all_items


def load_checkpoint(path, model, optimizer=None, strict=True):
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``), whatever layout either was in; return the saved ``extra``. A
    collective on a sharded model: call it on every rank. Nothing changes unless every
    rank read everything it needs."""
    path = os.path.abspath(os.fspath(path))
    items, aliases, optimizer, _ = _all_items(model, optimizer, "load_checkpoint")
    call = f"load_checkpoint({path!r})"
    expect_everyone(None, call)
    loaded, error, meta, unexpected = [], None, None, []
    try:
        meta = read_metadata(path)
        params_saved = {n for n in meta["tensors"] if "/optim/" not in n}
        unexpected = sorted(params_saved - {it.name for it in items} - set(aliases))
    except Exception as e:
        error = e
    # unexpected only if no rank wants it: an EP rank holds only its own experts
    for other in _gather_json(unexpected if strict and error is None else None, call):
        if other is not None:
            unexpected = sorted(set(unexpected) & set(other))
    if error is None:
        try:
            loaded = _read_items(path, meta, items, optimizer, unexpected if strict else [])
        except Exception as e:
            error = e
    errors = _errors_everywhere(None if error is None else f"rank {_rank_world()[0]}: {error}",
                                call)
    if errors:
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"load_checkpoint({path!r}): {error}") from error
        raise CheckpointError(f"load_checkpoint({path!r}) failed on another rank, nothing "
                              f"was changed: {'; '.join(errors)[:2000]}")
    for unit in units_under(model):
        unit.reshard(force=True)  # gathered copies would be stale
    for it, array in loaded:
        it.put(array)
    lr = getattr(optimizer, "_learning_rate", None)
    if meta.get("lr_scheduler") and hasattr(lr, "set_state_dict"):
        lr.set_state_dict(meta["lr_scheduler"])
    return meta.get("extra")


def _read_items(path, meta, items, optimizer, unexpected) -> list:
    """``[(item, box read)]`` for every item, after checking names, full shapes, CRCs."""
    tensors = meta["tensors"]
    missing = sorted({it.name for it in items} - set(tensors))
    if optimizer is None:
        missing = [m for m in missing if "/optim/" not in m]
    if missing or unexpected:
        raise CheckpointError(
            f"{path!r} does not match this model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (strict=False ignores unexpected ones)")
    reader, loaded = _Reader(path), []
    for it in items:
        entry = tensors[it.name]
        if list(entry["shape"]) != it.shape or entry["dtype"] != it.dtype:
            raise CheckpointError(
                f"{it.name}: the checkpoint has full shape {entry['shape']} {entry['dtype']}, "
                f"this model {it.shape} {it.dtype}{_split_note(entry, it)}; a layout maps only "
                "onto a model with the same full tensors")
        if not it.empty:
            loaded.append((it, read_box(reader, it.name, entry, it.offset, it.size)))
    return loaded


def _split_note(entry, item) -> str:
    """How each side's tensor parallelism cut the tensor, when either did."""
    saved, here = entry.get("split"), item.split
    if saved is None and here is None:
        return ""
    return (f" (tensor-parallel split saved {saved or 'none'}, here {here or 'none'}: the "
            "full shapes are compared, so a different mp degree alone is fine)")
