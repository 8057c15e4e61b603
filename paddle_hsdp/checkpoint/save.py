"""``save_checkpoint``: every rank says which boxes it holds, each distinct box gets one
writer among its holders (spread over them), every rank writes its pieces into
``CKPT.tmp-<token>``, all agree that every write succeeded, rank 0 writes the metadata
and renames the directory into place (an older ``CKPT`` is replaced only then). A
failure on any rank leaves the previous checkpoint as it was and raises on every rank.

Which ranks hold the same box is learnt, not derived from the layout: outer replicas,
the mp ranks of a parameter tensor parallelism does not split, the sharding ranks of
an unsharded tensor, two stages of a shared layer all hold the same box, so one of
them writes it. Boxes of one name that overlap without being equal (two EP ranks'
local experts without global indices) are refused before anything is written.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import zlib

import numpy as np
from safetensors.numpy import save_file

from ..comm.arrival import expect_everyone
from ..engine.registry import registry

from .boxes import tiling_error
from .format import (FORMAT, META, CheckpointError, _chunk_rows, _gather_json, _rank_world,
                     _token, read_metadata)
from .items import _all_items


def _write_rank_file(path: str, tensors: dict) -> None:
    save_file(tensors, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(path, model, optimizer=None, extra=None) -> None:
    """Save ``model`` (and ``optimizer``, and JSON-serialisable ``extra``) to the
    directory ``path``. A collective: call it on every rank. See the module docstring."""
    if extra is not None:
        json.dumps(extra)  # not serialisable: TypeError here, on every rank alike
    path = os.path.abspath(os.fspath(path))
    rank, world = _rank_world()
    items, aliases, optimizer, axes = _all_items(model, optimizer, "save_checkpoint")
    call = f"save_checkpoint({path!r})"
    expect_everyone(None, call)
    joint = _joint_save(model)  # a fault-tolerant job: the live replica groups save together
    token = joint.begin(path) if joint is not None else _token(call)
    tmp = f"{path}.tmp-{token}"
    held = [it for it in items if not it.empty and (joint is None or joint.writes(it.piece))]
    everyone = _gather_json([it.descriptor() for it in held], call)
    # jointly, one group's boxes need not tile: the publisher checks every group's
    pieces, error = {}, _refusal_to_replace(path) or (
        _refusal_to_tile(everyone) if joint is None else None)
    if error is None:
        try:
            mine = writers(everyone)
            pieces = _write_pieces(tmp, joint.file_rank() if joint is not None else rank,
                                   [it for it in held if mine[_key(it.descriptor())] == rank])
        except Exception as e:  # every rank must learn of it: agree below
            error = f"rank {rank}: {type(e).__name__}: {e}"
    manifests = _gather_json({"pieces": pieces, "error": error}, call)
    errors = [r["error"] for r in manifests if r["error"]]
    if joint is not None and rank != 0:  # the group's leader decides; wait in the store
        outcome = joint.outcome()
        errors = [outcome] if outcome else []
    elif joint is not None:
        errors = _publish_jointly(joint, path, tmp, items, manifests, everyone, errors,
                                  aliases, optimizer, extra, axes)
    elif rank == 0:
        if not errors:
            try:
                _publish(path, tmp, items, manifests, aliases, optimizer, extra, world, axes)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        if errors:  # before the others learn the outcome: they return to a clean dir
            shutil.rmtree(tmp, ignore_errors=True)
    # rank 0 decides; a refusal every rank made is said once
    outcome = _gather_json("; ".join(dict.fromkeys(errors)) if rank == 0 else None, call)[0]
    if outcome:
        raise CheckpointError(f"save_checkpoint({path!r}) failed; the previous checkpoint "
                              f"(if any) is unchanged. {outcome}")


def _joint_save(model):
    """The live replica groups' :class:`paddle_hsdp.ft.joint_save.JointSave` when
    ``model`` trains in a fault-tolerant job (its outer group carries one), else None."""
    for unit in registry.units_under(model):
        for buf in unit.buffers:
            return getattr(buf.outer, "joint_save", None)
    return None


def _publish_jointly(joint, path, tmp, items, manifests, everyone, errors, aliases,
                     optimizer, extra, axes) -> list[str]:
    """A replica group's leader: hand this group's part to the others; the group that
    completes the set checks that every group's pieces tile every tensor and publishes,
    the others learn its outcome. Returns the save's errors (none: published)."""
    try:
        groups = joint.gather({"manifests": manifests, "descriptors": everyone,
                                     "errors": errors})
        if groups is None:
            outcome = joint.outcome()
            return [outcome] if outcome else []
        errors = [e for g in groups for e in g["errors"]]
        refusal = None if errors else _refusal_to_tile(
            [d for g in groups for d in g["descriptors"]])
        errors += [refusal] if refusal else []
        if not errors:
            try:
                _publish(path, tmp, items, [m for g in groups for m in g["manifests"]],
                         aliases, optimizer, extra, joint.world_size, axes)
            except Exception as e:
                errors.append(f"the publishing group: {type(e).__name__}: {e}")
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
        joint.announce("; ".join(dict.fromkeys(errors)))
        return errors
    except Exception as e:  # the coordinator's store failed us: the save failed
        return [f"the replica groups' save: {type(e).__name__}: {e}"]


def _key(descriptor) -> str:
    return json.dumps(descriptor)


def writers(everyone: list) -> dict:
    """``{box key: the rank that writes it}`` from every rank's descriptors (the same on
    every rank): one holder per distinct box, chosen by a hash of the box so the
    writing spreads over its holders."""
    holders = {}
    for rank, descriptors in enumerate(everyone):
        for d in descriptors:
            holders.setdefault(_key(d), []).append(rank)
    return {key: ranks[zlib.crc32(key.encode()) % len(ranks)] for key, ranks in holders.items()}


def _refusal_to_tile(everyone: list) -> str | None:
    """Why the ranks' boxes do not tile every tensor exactly once (the same answer on
    every rank, from the same descriptors), or None."""
    boxes, shapes = {}, {}
    for descriptors in everyone:
        for name, offset, size, tag, shape in descriptors:
            boxes.setdefault(name, {})[json.dumps([offset, size, tag])] = (offset, size, tag)
            shapes.setdefault(name, set()).add(tuple(shape))
    for name, distinct in sorted(boxes.items()):
        if len(shapes[name]) > 1:
            return (f"{name}: the ranks disagree on its full shape "
                    f"({' vs '.join(str(list(s)) for s in sorted(shapes[name]))})")
        why = tiling_error(next(iter(shapes[name])),
                           [(tuple(o), tuple(s)) for o, s, _ in distinct.values()])
        if why is None:
            continue
        hint = ""
        if len({tag for _, _, tag in distinct.values()}) > 1:
            hint = (" These are local experts of different EP ranks under one name: give "
                    "them their global indices: mark_expert_params(layer, global_indices=...)")
        return f"{name}: the ranks' pieces do not tile it: {why}.{hint}"
    return None


def _write_pieces(tmp: str, rank: int, items) -> dict:
    """Write this rank's pieces into ``tmp``; return their manifest entries."""
    os.makedirs(tmp, exist_ok=True)
    fname = f"rank-{rank:05d}.safetensors"
    pieces, tensors = {}, {}
    for it in items:
        array = np.ascontiguousarray(it.get()).reshape(it.size)
        tensors[it.name] = array
        chunk = _chunk_rows(array)
        pieces[it.name] = {"file": fname, "key": it.name, "offset": it.offset,
                           "shape": it.size, "full_shape": it.shape, "dtype": it.dtype,
                           "split": it.split, "stage": it.stage, "chunk_rows": chunk,
                           "crc32": [zlib.crc32(array[i:i + chunk].tobytes())
                                     for i in range(0, int(array.shape[0]), chunk)]}
    if tensors:
        _write_rank_file(os.path.join(tmp, fname), tensors)
    return pieces


def _refusal_to_replace(path: str) -> str | None:
    """Why ``path`` must not be replaced, or None. Only a paddle_hsdp checkpoint (its
    metadata says so) is replaced: anything else there is the user's and stays."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return (f"{path} exists and is not a directory; save_checkpoint replaces only a "
                f"{FORMAT} checkpoint directory. Choose another path or remove it.")
    try:
        read_metadata(path)
        return None  # one of ours: replaced when the new one is in place
    except (CheckpointError, AttributeError):  # AttributeError: metadata JSON not a dict
        pass
    entries = sorted(os.listdir(path))
    if not entries:
        return None  # an empty directory holds nothing to lose
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    return (f"{path} exists and is not a {FORMAT} checkpoint (it holds {shown}); "
            "save_checkpoint replaces only its own checkpoints, so nothing was written. "
            "Choose another path or remove it.")


def _publish(path, tmp, items, manifests, aliases, optimizer, extra, world, axes) -> None:
    tensors = {}
    for it in items:
        tensors[it.name] = _entry(it.shape, it.dtype, it.split)
    stages = {}
    for record in manifests:  # other ranks hold tensors rank 0 has not (experts, stages)
        for name, piece in record["pieces"].items():
            shape, dtype = piece.pop("full_shape"), piece.pop("dtype")
            split, stage = piece.pop("split"), piece.pop("stage")
            entry = tensors.setdefault(name, _entry(shape, dtype, split))
            if [entry["shape"], entry["dtype"]] != [shape, dtype]:
                raise CheckpointError(f"{name}: ranks disagree on its full shape or dtype "
                                      f"({entry['shape']} {entry['dtype']} vs {shape} {dtype})")
            entry["pieces"].append(piece)
            stages.setdefault(name, set()).add(stage)
    for name, t in tensors.items():
        t["pieces"].sort(key=lambda p: p["offset"])
        if axes.pp_degree > 1:
            t["stages"] = sorted(stages.get(name, ()))
    lr = getattr(optimizer, "_learning_rate", None)
    meta = {"format": FORMAT, "world_size": world, "layout": axes.layout(),
            "tensors": tensors, "aliases": aliases,
            "lr_scheduler": lr.state_dict() if hasattr(lr, "state_dict") else None,
            "extra": extra, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    meta_path = os.path.join(tmp, META)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.rename(path, f"{path}.old-{os.path.basename(tmp).rsplit('-', 1)[-1]}")
    os.rename(tmp, path)
    # the replaced checkpoint, and what an earlier save left when a rank died mid-write
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _entry(shape, dtype, split) -> dict:
    entry = {"shape": shape, "dtype": dtype, "pieces": []}
    if split is not None:
        entry["split"] = split
    return entry
