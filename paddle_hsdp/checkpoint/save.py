"""``save_checkpoint``: every rank writes its pieces into ``CKPT.tmp-<token>``, all agree
that every write succeeded, rank 0 writes the metadata and renames the directory into
place (an older ``CKPT`` is replaced only then). A failure on any rank leaves the
previous checkpoint as it was and raises on every rank."""

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
    items, aliases, optimizer = _all_items(model, optimizer, "save_checkpoint")
    call = f"save_checkpoint({path!r})"
    expect_everyone(None, call)
    token = _token(call)
    tmp = f"{path}.tmp-{token}"
    pieces, error = {}, _refusal_to_replace(path)
    if error is None:
        try:
            pieces = _write_pieces(tmp, rank, items)
        except Exception as e:  # every rank must learn of it: agree below
            error = f"rank {rank}: {type(e).__name__}: {e}"
    everyone = _gather_json({"pieces": pieces, "error": error}, call)
    errors = [r["error"] for r in everyone if r["error"]]
    if rank == 0:
        if not errors:
            try:
                _publish(path, tmp, items, everyone, aliases, optimizer, extra, world)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        if errors:  # before the others learn the outcome: they return to a clean dir
            shutil.rmtree(tmp, ignore_errors=True)
    # rank 0 decides; a refusal every rank made is said once
    outcome = _gather_json("; ".join(dict.fromkeys(errors)) if rank == 0 else None, call)[0]
    if outcome:
        raise CheckpointError(f"save_checkpoint({path!r}) failed; the previous checkpoint "
                              f"(if any) is unchanged. {outcome}")


def _write_pieces(tmp: str, rank: int, items) -> dict:
    """Write this rank's pieces into ``tmp``; return their manifest entries."""
    os.makedirs(tmp, exist_ok=True)
    fname = f"rank-{rank:05d}.safetensors"
    pieces, tensors = {}, {}
    for it in items:
        if not it.writes or it.rows == 0:
            continue
        array = np.ascontiguousarray(it.get())
        tensors[it.name] = array
        chunk = _chunk_rows(array)
        pieces[it.name] = {"file": fname, "key": it.name, "row0": it.row0,
                           "shape": it.shape, "dtype": it.dtype,
                           "rows": int(array.shape[0]), "chunk_rows": chunk,
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


def _publish(path, tmp, items, everyone, aliases, optimizer, extra, world) -> None:
    tensors = {}
    for it in items:
        tensors[it.name] = {"shape": it.shape, "dtype": it.dtype, "pieces": []}
    for record in everyone:  # other ranks may hold tensors rank 0 has not (experts)
        for name, piece in record["pieces"].items():
            shape, dtype = piece.pop("shape"), piece.pop("dtype")
            entry = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            if [entry["shape"], entry["dtype"]] != [shape, dtype]:
                raise CheckpointError(f"{name}: ranks disagree on its shape or dtype "
                                      f"({entry['shape']} {entry['dtype']} vs {shape} {dtype})")
            entry["pieces"].append(piece)
    for name, t in tensors.items():
        t["pieces"].sort(key=lambda p: p["row0"])
        rows = t["shape"][0] if t["shape"] else 1
        covered = sum(p["rows"] for p in t["pieces"])
        if covered > rows:
            raise CheckpointError(
                f"{name}: more than one rank holds different rows {covered} > {rows} under "
                "this name. Are these local experts of different EP ranks? Give them "
                "their global indices: mark_expert_params(layer, global_indices=...)")
        if covered != rows:
            raise CheckpointError(f"{name}: pieces cover {covered} of {rows} rows")
    lr = getattr(optimizer, "_learning_rate", None)
    meta = {"format": FORMAT, "world_size": world, "tensors": tensors, "aliases": aliases,
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
