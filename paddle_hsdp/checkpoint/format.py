"""The checkpoint format: its metadata, reading checked rows back, and the ranks' agreement.

Format (a directory)::

    CKPT/metadata.json            every tensor: global shape, dtype, where its pieces are
    CKPT/rank-00003.safetensors   the pieces one rank wrote

A tensor is a model parameter or buffer (by its structured name in the unsharded
model; tied aliases are recorded as aliases) or an optimizer state of a parameter
(``NAME/optim/moment1``, ``.../moment2``, ``.../beta1_pow_acc``, ...,
``.../master_weight``). A piece is a run of dim-0 rows, without padding rows, with the
file and key that hold it and a CRC-32 per chunk of about 4 MiB of its rows. Each
distinct block is written once: of the outer replicas that hold it, one writes, chosen
per buffer so the writing spreads over the replicas. Tensor data is safetensors, metadata JSON: nothing is
unpickled when loading.

``load_checkpoint`` reads, of the pieces overlapping this rank's blocks, only the CRC
chunks covering its rows (memory-mapped safetensors slices), checks shapes, dtypes and
CRCs, agrees with every rank that all is well
(one small all-reduce), and only then writes parameters and optimizer state: a bad
checkpoint raises ``CheckpointError`` on every rank and changes nothing. It loads into
any inner/outer layout and world size, and into a plain model and optimizer in a
process that never called ``fleet.init``.

Saving is atomic: ranks write into ``CKPT.tmp-<token>``, agree that every write
succeeded, rank 0 writes the metadata and renames the directory into place (an older
``CKPT`` is replaced only then). A failure on any rank leaves the previous checkpoint
as it was and raises on every rank. The directory must be visible to every rank (a
shared filesystem across machines).

Expert parameters: local experts marked with ``mark_expert_params(layer,
global_indices=...)`` are stored under their global expert index, so a checkpoint saved
with one expert-parallel degree loads with another (EP 2 -> EP 1 and back).

Not yet (docs/checkpoints.md): tensor or pipeline parallelism next to HSDP.
"""


from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np
from safetensors import safe_open

import paddle
import paddle.distributed as dist

from ..comm import collectives as comm
from ..comm import watchdog

FORMAT = "paddle_hsdp-checkpoint/1"
META = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (missing, corrupted, another model)."""


# ---------------------------------------------------------------- job helpers
def _rank_world():
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _errors_everywhere(error: str | None, what: str = "a checkpoint call") -> list[str]:
    """Every rank's error message (None: fine), on every rank: all ranks learn why."""
    return [e for e in _gather_json(error, what) if e]


# Through paddle_hsdp.comm, so a peer that dies mid-save or mid-load gives the others a
# CollectiveError naming the call (and a hung one the watchdog's exit), not gloo's own.
_TAG = "checkpoint"


def _gather_json(obj, what: str = "a checkpoint call") -> list:
    """Every rank's JSON-serialisable ``obj``, in rank order (no pickling)."""
    rank, world = _rank_world()
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    if world == 1:
        return [obj]
    group = dist.collective._get_global_group()
    sizes = paddle.zeros([world], dtype="int64")
    comm.all_gather_into(sizes, paddle.to_tensor([len(data)], dtype="int64"), group,
                         tag=_TAG, what=f"{what}: the ranks' message sizes")
    with watchdog.host_sync(f"{what}: reading the ranks' message sizes"):
        sizes = [int(n) for n in sizes.numpy()]
    padded = np.zeros(max(sizes), dtype=np.uint8)
    padded[:len(data)] = data
    parts = paddle.zeros([world * max(sizes)], dtype="uint8")
    comm.all_gather_into(parts, paddle.to_tensor(padded), group, tag=_TAG,
                         what=f"{what}: the ranks' messages")
    with watchdog.host_sync(f"{what}: reading the ranks' messages"):
        rows = parts.numpy().reshape(world, max(sizes))
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(rows, sizes)]


def _token(what: str = "a checkpoint call") -> str:
    """The same fresh token on every rank (rank 0's clock, broadcast)."""
    rank, world = _rank_world()
    t = paddle.to_tensor([int(time.time() * 1e6) % (2 ** 62)], dtype="int64")
    if world > 1:
        comm.broadcast(t, 0, dist.collective._get_global_group(), tag=_TAG,
                       what=f"{what}: the save's token")
    with watchdog.host_sync(f"{what}: reading the save's token"):
        return f"{int(t.item()):x}"


# ---------------------------------------------------------------- reading
def read_metadata(path) -> dict:
    meta_path = os.path.join(os.fspath(path), META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not a checkpoint: no {META}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({e})") from None
    if meta.get("format") != FORMAT or not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"{meta_path}: not a {FORMAT} checkpoint")
    return meta


CHUNK_BYTES = 4 << 20  # a CRC per ~4 MiB of rows: a load reads and checks only those


def _chunk_rows(array: np.ndarray) -> int:
    row_bytes = max(array[:1].nbytes, 1)
    return max(1, CHUNK_BYTES // row_bytes)


class _Reader:
    """Reads rows of pieces from the rank files (memory-mapped): only the CRC chunks
    that cover the rows asked for, each checked."""

    def __init__(self, path):
        self.path, self.files = path, {}

    def rows(self, name, piece, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of ``piece`` (piece-relative)."""
        chunk = piece.get("chunk_rows", piece["rows"])
        crcs = piece["crc32"] if isinstance(piece["crc32"], list) else [piece["crc32"]]
        first, last = lo // chunk, (hi - 1) // chunk
        start, stop = first * chunk, min((last + 1) * chunk, piece["rows"])
        fname = os.path.join(self.path, piece["file"])
        try:
            if fname not in self.files:
                self.files[fname] = safe_open(fname, framework="numpy")
            array = self.files[fname].get_slice(piece["key"])[start:stop]
        except Exception as e:
            raise CheckpointError(f"{name}: cannot read {piece['file']} ({e})") from None
        array = np.ascontiguousarray(array)
        if array.shape[:1] != (stop - start,):
            raise CheckpointError(f"{name}: {piece['file']} is truncated")
        for i, crc in enumerate(crcs[first:last + 1]):
            if zlib.crc32(array[i * chunk:(i + 1) * chunk].tobytes()) != crc:
                raise CheckpointError(f"{name}: {piece['file']} is corrupted (CRC mismatch "
                                      f"in rows {start + i * chunk}..)")
        return array[lo - start:hi - start]


def _read_rows(reader, name, entry, row0, rows):
    """Rows ``[row0, row0 + rows)`` of a tensor, from the pieces that overlap them."""
    parts = []
    for piece in entry["pieces"]:
        lo, hi = max(row0, piece["row0"]), min(row0 + rows, piece["row0"] + piece["rows"])
        if lo < hi:
            parts.append(reader.rows(name, piece, lo - piece["row0"], hi - piece["row0"]))
    got = sum(p.shape[0] for p in parts)
    if got != rows:
        raise CheckpointError(f"{name}: the checkpoint holds {got} of the {rows} rows needed")
    return np.concatenate(parts) if len(parts) > 1 else parts[0]
