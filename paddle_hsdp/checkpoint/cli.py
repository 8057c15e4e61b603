"""``python -m paddle_hsdp.checkpoint inspect CKPT`` / ``consolidate CKPT OUT``: what a
checkpoint holds, and its model tensors as one safetensors file with the unsharded
model's keys."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Sequence

import numpy as np
from safetensors.paddle import save_file

import paddle

from .format import CheckpointError, Reader, numpy_dtype, pieces_of, read_metadata, read_whole


# The file's safetensors metadata: what it is, so no loader or reader takes it for a
# Hugging Face checkpoint (PaddleFormers' from_pretrained reads safetensors as HF layout
# and would load these Paddle-layout weights transposed, without a word).
CONSOLIDATED_METADATA = {
    "format": "paddle_hsdp-consolidated", "layout": "paddle",
    "load_with": "safetensors.paddle.load_file + model.set_state_dict",
    "not_for": "from_pretrained: use paddle_hsdp.integrations.paddleformers.export_pretrained"}
# Names Hugging Face / PaddleFormers loaders pick up from a model directory.
_LOADER_NAMES = re.compile(r"^(model|pytorch_model|diffusion_pytorch_model)"
                           r"(-\d{5}-of-\d{5})?\.safetensors$")


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Write the checkpoint's model tensors as one safetensors file with the unsharded
    model's ``state_dict()`` keys (tied aliases included) in Paddle layout; return the
    keys written. Plain Paddle loads it with ``safetensors.paddle.load_file`` +
    ``set_state_dict``. Names a ``from_pretrained`` directory would pick up
    (``model.safetensors``) are refused: that needs Hugging Face layout, which
    ``paddle_hsdp.integrations.paddleformers.export_pretrained`` writes."""
    if _LOADER_NAMES.match(os.path.basename(os.fspath(out))):
        raise CheckpointError(
            f"consolidate: {os.fspath(out)!r} is a name from_pretrained loads as Hugging Face "
            "layout, and this file is in Paddle layout (it would load transposed); name it "
            "e.g. full.paddle.safetensors, or write a from_pretrained directory with "
            "paddle_hsdp.integrations.paddleformers.export_pretrained(model, dir)")
    meta = read_metadata(path)
    reader = Reader(os.fspath(path))
    full = {}
    for name, entry in meta["tensors"].items():
        if "/optim/" in name:
            continue
        full[name] = read_whole(reader, name, entry)
    for alias, name in meta["aliases"].items():
        full[alias] = full[name]
    parent = os.path.dirname(os.path.abspath(os.fspath(out)))
    os.makedirs(parent, exist_ok=True)  # like `cp`, but the folders are made
    # safetensors.paddle writes bfloat16 as BF16 (numpy has no bfloat16). (Paddle's
    # DTypeLike takes dtype names only as literals; these are the metadata's, which
    # engine/holdings.py's dtype_name wrote from paddle dtypes)
    save_file({k: paddle.to_tensor(np.ascontiguousarray(v),
                                   dtype=_dtype_of(meta, k))  # type: ignore[arg-type]
               for k, v in full.items()}, os.fspath(out), metadata=CONSOLIDATED_METADATA)
    return list(full)


def _dtype_of(meta: dict, name: str) -> str:
    return meta["tensors"][meta["aliases"].get(name, name)]["dtype"]


def describe(path: str | os.PathLike) -> str:
    """What a checkpoint holds, as text (the ``inspect`` command): the saving layout,
    then each tensor's full shape, dtype, pieces and how tensor and pipeline
    parallelism held it."""
    meta = read_metadata(path)
    layout = meta.get("layout") or {}
    shown = ", ".join(f"{k} {v}" for k, v in layout.items())
    lines = [f"{path}: {meta['format']}, saved {meta.get('saved_at')} by "
             f"{meta['world_size']} rank(s){f' ({shown})' if shown else ''}; extra: "
             f"{json.dumps(meta.get('extra'))}"]
    full = written = 0
    files: set[str] = set()
    for name, t in sorted(meta["tensors"].items()):
        itemsize = np.dtype(numpy_dtype(t["dtype"])).itemsize
        full += int(np.prod(t["shape"])) * itemsize if t["shape"] else itemsize
        pieces = pieces_of(name, t)
        written += sum(int(np.prod(p["shape"])) for p in pieces) * itemsize
        # (a few numbers sit in the metadata itself, in no file)
        files.update(p["file"] for p in pieces if "file" in p)
        axes = []
        if t.get("split"):
            axes.append(f"tp: axis {t['split']['axis']} / {t['split']['degree']}")
        if t.get("stages"):
            axes.append(f"stage {','.join(str(s) for s in t['stages'])}")
        lines.append(f"  {name:50s} {str(t['shape']):>18s} {t['dtype']:8s} "
                     f"{len(pieces)} piece(s){'  ' + '; '.join(axes) if axes else ''}")
    for alias, name in sorted(meta["aliases"].items()):
        lines.append(f"  {alias:50s} = {name} (tied)")
    disk = sum(os.path.getsize(os.path.join(os.fspath(path), f)) for f in files)
    lines.append(f"{len(meta['tensors'])} tensors, {full / 2**20:.1f} MiB; written once: "
                 f"{written} of {full} bytes in {len(files)} file(s), {disk} bytes on disk")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_hsdp.checkpoint",
                                 description="Inspect or consolidate a paddle_hsdp checkpoint.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print what a checkpoint holds").add_argument("ckpt")
    c = sub.add_parser("consolidate", help="one safetensors file with the unsharded keys")
    c.add_argument("ckpt")
    c.add_argument("out")
    args = ap.parse_args(argv)
    try:
        if args.command == "inspect":
            print(describe(args.ckpt))
        else:
            keys = consolidate(args.ckpt, args.out)
            print(f"wrote {len(keys)} tensors to {args.out}")
    except (CheckpointError, OSError) as e:  # one line, like every error of this command
        print(f"error: {e}")
        return 1
    return 0
