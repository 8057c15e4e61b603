"""The checkpoint format: its metadata, reading checked boxes back, and the ranks'
agreement.

Format (a directory)::

    CKPT/metadata.json            every tensor: full shape, dtype, where its pieces are
    CKPT/rank-00003.safetensors   the pieces one rank wrote

A tensor is a model parameter or buffer under its checkpoint name (engine/saved_names.py:
the unsharded one-process model's name; tied aliases recorded as aliases; local experts
by global index) or an optimizer state of a parameter (``NAME/optim/moment1``,
``.../moment2``, ``.../beta1_pow_acc``, ..., ``.../master_weight``), with its full
(logical) shape: a tensor-parallel parameter's whole, not its slice. A piece is a box of
it (checkpoint/boxes.py: ``offset`` and ``shape``, without padding; the inner block of
rows of one mp slice), with the file and key that hold it and a CRC-32 per chunk of
about 4 MiB of its rows. A tensor-parallel tensor records its ``split`` (axis, degree)
and, under pipeline parallelism, the ``stages`` that hold it. Each distinct piece is
written once, by one of the ranks that hold it (checkpoint/save.py). HFSDP's
optimizer rows (every rank's own) are not listed: a tensor names the ``rules`` that
place them (checkpoint/rules.py), their CRCs are in their files' headers. Tensor data
is safetensors, metadata JSON: nothing is unpickled when loading.

``load_checkpoint`` reads, of the pieces overlapping this rank's boxes, only the CRC
chunks covering them (memory-mapped safetensors slices), checks shapes, dtypes and
CRCs, agrees with every rank that all is well (an all-reduce of a flag), and only then
writes parameters and optimizer state: a bad checkpoint raises ``CheckpointError`` on
every rank and changes nothing. It loads into any (mp, pp, sharding, outer, ep) layout
whose model has the same full tensors, and into a plain model and optimizer in a
process that never called ``fleet.init``; versions 1 (rows only), 2 and 3 (no rules)
still load.

Saving is atomic: ranks write into ``CKPT.tmp-<token>``, agree that every write
succeeded, rank 0 writes the metadata and renames the directory into place (an older
``CKPT`` is replaced only then). A failure on any rank leaves the previous checkpoint
as it was and raises on every rank. The directory must be visible to every rank (a
shared filesystem across machines).
"""


from __future__ import annotations

import json
import os
import zlib
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from safetensors import safe_open

import paddle
import paddle.distributed as dist

from ..comm import collectives as comm
from ..comm import watchdog
from .boxes import dims, intersect, relative, volume
from .rules import crc_of, link, pieces

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from .boxes import Box

FORMAT = "paddle_hsdp-checkpoint/4"
FORMAT_V3 = "paddle_hsdp-checkpoint/3"  # no rules (checkpoint/rules.py): still loads
FORMAT_V2 = "paddle_hsdp-checkpoint/2"  # every piece in a file: still loads (and is read so)
FORMAT_V1 = "paddle_hsdp-checkpoint/1"  # rows only (no tensor-parallel boxes): still loads
_READABLE = (FORMAT, FORMAT_V3, FORMAT_V2, FORMAT_V1)
META = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (missing, corrupted, another model)."""


# ---------------------------------------------------------------- job helpers
def rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def errors_everywhere(error: str | None, what: str = "a checkpoint call") -> list[str]:
    """Every rank's error message (None: fine), on every rank: all ranks learn why. One
    all-reduce of a flag when all is well; the messages are gathered only if not."""
    if largest_everywhere(1 if error else 0, what) == 0:
        return []
    return [e for e in gather_json(error, what) if e]


def largest_everywhere(value: int, what: str = "a checkpoint call") -> int:
    """The largest of every rank's ``value`` (one all-reduce of one number)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    flag = paddle.to_tensor([value], dtype="int64")
    comm.all_reduce(flag, dist.collective._get_global_group(), op="max", tag=_TAG,
                    what=f"{what}: the largest of the ranks' numbers")
    with watchdog.host_sync(f"{what}: reading the largest of the ranks' numbers"):
        return int(flag)


# Through paddle_hsdp.comm, so a peer that dies mid-save or mid-load gives the others a
# CollectiveError naming the call (and a hung one the watchdog's exit), not gloo's own.
_TAG = "checkpoint"


def gather_json(obj: object, what: str = "a checkpoint call",
                 group: Group | None = None) -> list:
    """Every rank's JSON-serialisable ``obj``, in rank order (no pickling), over
    ``group`` (default: every rank)."""
    if not dist.is_initialized() or (group is not None and group.nranks == 1):
        return [obj]
    group = dist.collective._get_global_group() if group is None else group
    world = group.nranks
    if world == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    sizes = paddle.zeros([world], dtype="int64")
    comm.all_gather_into(sizes, paddle.to_tensor([len(data)], dtype="int64"), group,
                         tag=_TAG, what=f"{what}: the ranks' message sizes")
    with watchdog.host_sync(f"{what}: reading the ranks' message sizes"):
        lengths = [int(n) for n in sizes.numpy()]
    padded = np.zeros(max(lengths), dtype=np.uint8)
    padded[:len(data)] = data
    parts = paddle.zeros([world * max(lengths)], dtype="uint8")
    comm.all_gather_into(parts, paddle.to_tensor(padded), group, tag=_TAG,
                         what=f"{what}: the ranks' messages")
    with watchdog.host_sync(f"{what}: reading the ranks' messages"):
        rows = parts.numpy().reshape(world, max(lengths))
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(rows, lengths)]


def gather_sizes_to_root(values: Sequence[int], what: str = "a checkpoint call"
                         ) -> list[list[int]] | None:
    """Every rank's few integers (``values``: the same count on every rank) on rank 0,
    in rank order; None on the others, which receive nothing. A fixed-size gather:
    8 bytes per integer per rank reach rank 0 (a save's manifests follow as files,
    each rank's exactly, not W times the longest: checkpoint/save.py)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    group = dist.collective._get_global_group()
    parts: list[paddle.Tensor] | None = [] if dist.get_rank() == 0 else None
    comm.gather(paddle.to_tensor(np.array(values, dtype=np.int64)), parts, 0, group,
                tag=_TAG, what=f"{what} to rank 0")
    if parts is None:  # not rank 0
        return None
    with watchdog.host_sync(f"{what}: reading them"):
        return [[int(v) for v in p.numpy()] for p in parts]


def broadcast_json(obj: object, what: str = "a checkpoint call") -> Any:
    """Rank 0's JSON-serialisable ``obj`` on every rank (``obj`` elsewhere is ignored)."""
    data = json.dumps(obj).encode() if rank_world()[0] == 0 else b""
    return json.loads(_broadcast_bytes(data, what).decode())


def _broadcast_bytes(data: bytes, what: str = "a checkpoint call") -> bytes:
    """Rank 0's ``data`` on every rank (a size, then the bytes: two broadcasts)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return data
    group = dist.collective._get_global_group()
    size = paddle.to_tensor([len(data)], dtype="int64")
    comm.broadcast(size, 0, group, tag=_TAG, what=f"{what}: rank 0's message size")
    with watchdog.host_sync(f"{what}: reading rank 0's message size"):
        n = int(size)
    if n == 0:
        return b""
    buf = paddle.to_tensor(np.frombuffer(data, np.uint8) if dist.get_rank() == 0
                           else np.zeros(n, np.uint8))
    comm.broadcast(buf, 0, group, tag=_TAG, what=f"{what}: rank 0's message")
    with watchdog.host_sync(f"{what}: reading rank 0's message"):
        return buf.numpy().tobytes()


# ---------------------------------------------------------------- reading
def read_metadata(path: str | os.PathLike) -> dict:
    meta_path = os.path.join(os.fspath(path), META)
    return parse_metadata(_read_bytes(path, meta_path), meta_path)


def read_metadata_once(path: str | os.PathLike, what: str = "a checkpoint call") -> dict:
    """:func:`read_metadata` on every rank from one read: rank 0 reads the file and
    broadcasts its bytes (or why it could not), every rank parses them. Storage serves
    the index once per load, not once per rank."""
    meta_path = os.path.join(os.fspath(path), META)
    message = b""
    if rank_world()[0] == 0:
        try:
            message = b"ok:" + _read_bytes(path, meta_path)
        except CheckpointError as e:
            message = b"error:" + str(e).encode()
    message = _broadcast_bytes(message, what)
    if message.startswith(b"error:"):
        raise CheckpointError(message[len(b"error:"):].decode())
    return parse_metadata(message[len(b"ok:"):], meta_path)


def _read_bytes(path: str | os.PathLike, meta_path: str) -> bytes:
    try:
        with open(meta_path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not a checkpoint: no {META}") from None
    except OSError as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({e})") from None


def parse_metadata(text: bytes, meta_path: str) -> dict:
    """A checkpoint's metadata from its JSON bytes (checked; version 1 upgraded)."""
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE \
            or not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"{meta_path}: not a {FORMAT} checkpoint")
    if meta["format"] == FORMAT_V1:
        _upgrade_v1(meta)
    try:
        link(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable rules ({type(e).__name__}: {e})") \
            from None
    return meta


def _upgrade_v1(meta: dict) -> None:
    """A version 1 checkpoint's pieces (runs of dim-0 rows) as boxes."""
    for entry in meta["tensors"].values():
        rest = dims(entry["shape"])[1:]
        for piece in entry["pieces"]:
            piece["offset"] = [piece.pop("row0")] + [0] * len(rest)
            piece["shape"] = [piece.pop("rows")] + rest


CHUNK_BYTES = 4 << 20  # a CRC per ~4 MiB of rows: a load reads and checks only those


def chunk_rows(array: np.ndarray) -> int:
    row_bytes = max(array[:1].nbytes, 1)
    return max(1, CHUNK_BYTES // row_bytes)


class Reader:
    """Reads rows of pieces from the rank files (memory-mapped): only the CRC chunks
    that cover the rows asked for, each checked."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files: dict[str, Any] = {}  # file name -> its safetensors handle
        self.bytes_read = 0  # from the files (whole CRC chunks), for the load's figures

    def rows(self, name: str, piece: dict, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of ``piece`` (piece-relative)."""
        if "value" in piece:  # a few numbers kept in the metadata (checkpoint/plan.py)
            array = np.array(piece["value"], dtype=piece["value_dtype"])
            return array.reshape(piece["shape"])[lo:hi]
        total = piece["shape"][0]
        fname = os.path.join(self.path, piece["file"])
        try:
            handle = self._open(fname)
            if "crc32" in piece:
                chunk = piece.get("chunk_rows", total)
                crcs = piece["crc32"] if isinstance(piece["crc32"], list) else [piece["crc32"]]
            else:  # a ruled piece: its CRCs are in its file's header
                chunk, crcs = crc_of(handle.metadata(), piece["key"])
            first, last = lo // chunk, (hi - 1) // chunk
            start, stop = first * chunk, min((last + 1) * chunk, total)
            array = handle.get_slice(piece["key"])[start:stop]
        except Exception as e:
            raise CheckpointError(f"{name}: cannot read {piece['file']} ({e})") from None
        array = np.ascontiguousarray(array)
        self.bytes_read += array.nbytes
        if array.shape[:1] != (stop - start,):
            raise CheckpointError(f"{name}: {piece['file']} is truncated")
        for i, crc in enumerate(crcs[first:last + 1]):
            if zlib.crc32(array[i * chunk:(i + 1) * chunk].tobytes()) != crc:
                raise CheckpointError(f"{name}: {piece['file']} is corrupted (CRC mismatch "
                                      f"in rows {start + i * chunk}..)")
        return array[lo - start:hi - start]

    def _open(self, fname: str):
        if fname not in self.files:
            self.files[fname] = safe_open(fname, framework="numpy")
        return self.files[fname]


def numpy_dtype(name: str) -> str:
    """The numpy dtype a tensor of checkpoint dtype ``name`` is read as (bfloat16 as
    its raw bits)."""
    return "uint16" if name == "bfloat16" else name


def read_whole(reader: Reader, name: str, entry: dict) -> np.ndarray:
    """The whole tensor ``name`` (its full shape), from every piece."""
    shape = dims(entry["shape"])
    return read_box(reader, name, entry, [0] * len(shape), shape).reshape(entry["shape"])


def read_box(reader: Reader, name: str, entry: dict, offset: Sequence[int],
             shape: Sequence[int]) -> np.ndarray:
    """The box ``offset`` + ``shape`` of a tensor, from the pieces that overlap it."""
    want = (tuple(offset), tuple(shape))
    out, got = None, 0
    for piece in pieces_of(name, entry, want):
        have = (tuple(piece["offset"]), tuple(piece["shape"]))
        common = intersect(want, have)
        if common is None:
            continue
        rows = relative(common, have)
        array = reader.rows(name, piece, rows[0].start, rows[0].stop)
        part = array[(slice(None),) + rows[1:]]
        if out is None:
            out = np.empty(shape, dtype=part.dtype)
        out[relative(common, want)] = part
        got += volume(common[1])
    if got != volume(shape):
        raise CheckpointError(f"{name}: the checkpoint holds {got} of the {volume(shape)} "
                              "elements needed")
    if out is None:  # a box of no elements: no piece overlaps it
        out = np.empty(shape, dtype=numpy_dtype(entry["dtype"]))
    return out


def pieces_of(name: str, entry: dict, want: Box | None = None) -> list[dict]:
    """The pieces of tensor ``name`` (those overlapping the box ``want``, if given):
    the listed ones, and those its rules place (checkpoint/rules.py)."""
    if want is None:
        want = ((0,) * len(dims(entry["shape"])), tuple(dims(entry["shape"])))
    return entry["pieces"] + [p for r in entry.get("ruled", ()) for p in pieces(r, name, want)]
