"""Sharded checkpoints that load into another layout: ``save_checkpoint`` / ``load_checkpoint``.

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

Not yet (see the README): tensor or pipeline parallelism next to HSDP.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib

import numpy as np

import paddle

from .api import managed_param, owning_unit
from .optim import _params_of, unwrap_optimizer

FORMAT = "paddle_hsdp-checkpoint/1"
META = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (missing, corrupted, another model)."""


# ---------------------------------------------------------------- job helpers
def _rank_world():
    import paddle.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _errors_everywhere(error: str | None) -> list[str]:
    """Every rank's error message (None: fine), on every rank: all ranks learn why."""
    return [e for e in _gather_json(error) if e]


def _gather_json(obj) -> list:
    """Every rank's JSON-serialisable ``obj``, in rank order (no pickling)."""
    import paddle.distributed as dist

    rank, world = _rank_world()
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    if world == 1:
        return [obj]
    sizes = []
    dist.all_gather(sizes, paddle.to_tensor([len(data)], dtype="int64"))
    longest = max(int(s.item()) for s in sizes)
    padded = np.zeros(longest, dtype=np.uint8)
    padded[:len(data)] = data
    parts = []
    dist.all_gather(parts, paddle.to_tensor(padded))
    return [json.loads(p.numpy()[:int(n.item())].tobytes().decode())
            for p, n in zip(parts, sizes)]


def _token() -> str:
    """The same fresh token on every rank (rank 0's clock, broadcast)."""
    import paddle.distributed as dist

    rank, world = _rank_world()
    t = paddle.to_tensor([int(time.time() * 1e6) % (2 ** 62)], dtype="int64")
    if world > 1:
        dist.broadcast(t, src=0)
    return f"{int(t.item()):x}"


# ---------------------------------------------------------------- what this rank holds
class _Item:
    """One checkpoint tensor as this rank holds it: rows ``[row0, row0 + rows)`` of a
    tensor of ``shape``; ``get()`` reads them, ``put(array)`` writes them back."""

    def __init__(self, name, shape, dtype, row0, rows, writes, get, put):
        self.name, self.shape, self.dtype = name, [int(d) for d in shape], dtype
        self.row0, self.rows, self.writes = row0, rows, writes
        self.get, self.put = get, put


def _dtype_name(dtype) -> str:
    # bfloat16 travels as its raw uint16 bits (numpy has no bfloat16); the metadata
    # keeps the real dtype, and _putter / consolidate turn the bits back into bfloat16
    return str(dtype).replace("paddle.", "")


def _check_supported(model) -> None:
    from paddle.distributed.fleet.base import topology as fleet_topology

    hcg = fleet_topology._HYBRID_PARALLEL_GROUP
    if hcg is not None:
        for getter, what in (("get_model_parallel_world_size", "mp_degree"),
                             ("get_pipe_parallel_world_size", "pp_degree")):
            if getattr(hcg, getter)() > 1:
                raise NotImplementedError(
                    f"save/load_checkpoint with {what} > 1 is not supported yet: tensor "
                    "slices and pipeline stages are not recorded in the format.")


def _names_and_aliases(model):
    """``(canonical, aliases)``: ``{name: tensor}`` for every distinct parameter and
    persistable buffer (first name wins), ``{alias: canonical}`` for tied names. Local
    experts marked with global indices are named by their global index."""
    from .experts import global_names, rename

    renames = global_names(model)
    canonical, aliases, first = {}, {}, {}
    for name, value in model._state_dict_impl(use_hook=False).items():
        name = rename(name, renames)
        sp = managed_param(value)
        key = id(sp) if sp is not None else id(value)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        canonical[name] = value
    return canonical, aliases


def _writer(sp) -> bool:
    """Whether this rank writes ``sp``'s block: one outer replica per buffer, rotating
    with the buffer so the writing spreads over the replicas."""
    buf = _buffer_of(sp)
    return buf.outer.rank == (buf.unit_index + buf.index) % buf.outer.nranks


def _param_items(model) -> tuple[list[_Item], dict, dict]:
    canonical, aliases = _names_and_aliases(model)
    rank, _ = _rank_world()
    items, by_shard = [], {}
    for name, value in canonical.items():
        sp = managed_param(value)
        if sp is None:  # not sharded: the same on every rank; rank 0 writes it
            items.append(_Item(name, value.shape, _dtype_name(value.dtype), 0,
                               int(value.shape[0]) if value.shape else 1, rank == 0,
                               _getter(value, None), _putter(value, None)))
            by_shard[id(value)] = name
            continue
        start = min(sp.inner_rank * sp.rows_per_rank, sp.rows)
        count = min(start + sp.rows_per_rank, sp.rows) - start
        items.append(_Item(name, sp.shape, _dtype_name(sp.dtype), start, count, _writer(sp),
                           _getter(sp.shard, count), _putter(sp.shard, count)))
        by_shard[id(sp.shard)] = name
    return items, by_shard, aliases


def _getter(tensor, rows):
    """Read the first ``rows`` rows of ``tensor`` (None: all of it; a scalar as [1])."""
    def get():
        array = tensor.numpy()
        if array.ndim == 0:
            array = array.reshape([1])
        return array if rows is None else array[:rows]
    return get


def _putter(tensor, rows):
    """Write ``rows`` (None: the whole tensor) into ``tensor`` in place, keeping any
    padding rows of a shard as zeros."""
    @paddle.no_grad()
    def put(array):
        if rows is None:
            value = paddle.to_tensor(array.reshape(tensor.shape), dtype=tensor.dtype)
        else:
            full = np.zeros(tensor.shape, dtype=array.dtype)
            full[:rows] = array
            value = paddle.to_tensor(full, dtype=tensor.dtype)
        paddle.assign(value, output=tensor)
    return put


def _optimizer_items(optimizer, by_shard: dict, param_items: dict) -> list[_Item]:
    """AdamW-style accumulators and master weights, as blocks of their parameter's rows
    (``moment1``) or whole (``beta1_pow_acc``, shape [1])."""
    _ensure_accumulators(optimizer)
    items = []
    for p in _params_of(optimizer):
        name = by_shard.get(id(p))
        if name is None:
            continue
        owner = param_items[name]
        for acc, t in sorted(_states_of(optimizer, p).items()):
            if list(t.shape) == list(p.shape):  # a block like its parameter
                items.append(_Item(f"{name}/optim/{acc}", owner.shape, _dtype_name(t.dtype),
                                   owner.row0, owner.rows, owner.writes,
                                   _getter(t, owner.rows), _putter(t, owner.rows)))
            else:  # a scalar, the same on every rank holding the parameter
                items.append(_Item(f"{name}/optim/{acc}", t.shape, _dtype_name(t.dtype), 0,
                                   int(t.shape[0]), owner.writes and owner.row0 == 0,
                                   _getter(t, None), _putter(t, None)))
    return items


def _states_of(optimizer, p) -> dict:
    """``{state name: tensor}`` the optimizer keeps for ``p``: its accumulators under
    Paddle's names (``moment1``, ``beta1_pow_acc``, ...) and ``master_weight``."""
    states = {acc: table[p.name] for acc, table in optimizer._accumulators.items()
              if p.name in table}
    master = (getattr(optimizer, "_master_weights", None) or {}).get(p.name)
    if master is not None:
        states["master_weight"] = master
    return states


def _ensure_accumulators(optimizer) -> None:
    """Create the optimizer's state now if no step has run yet, so it can be loaded."""
    from paddle.base import framework

    params = [p for p in _params_of(optimizer) if not p.stop_gradient]
    if params and not getattr(optimizer, "_accumulators", None):
        block = framework.default_main_program().global_block()
        optimizer._create_accumulators(block, params)


def _all_items(model, optimizer):
    _check_supported(model)
    items, by_shard, aliases = _param_items(model)
    if optimizer is not None:
        optimizer = unwrap_optimizer(optimizer)
        by_name = {it.name: it for it in items}
        items += _optimizer_items(optimizer, by_shard, by_name)
    return items, aliases, optimizer


# ---------------------------------------------------------------- save
def _write_rank_file(path: str, tensors: dict) -> None:
    from safetensors.numpy import save_file

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
    items, aliases, optimizer = _all_items(model, optimizer)
    token = _token()
    tmp = f"{path}.tmp-{token}"
    pieces, error = {}, None
    try:
        os.makedirs(tmp, exist_ok=True)
        fname = f"rank-{rank:05d}.safetensors"
        tensors = {}
        for it in items:
            if not it.writes or it.rows == 0:
                continue
            array = np.ascontiguousarray(it.get())
            key = it.name
            tensors[key] = array
            chunk = _chunk_rows(array)
            pieces[it.name] = {"file": fname, "key": key, "row0": it.row0,
                               "shape": it.shape, "dtype": it.dtype,
                               "rows": int(array.shape[0]), "chunk_rows": chunk,
                               "crc32": [zlib.crc32(array[i:i + chunk].tobytes())
                                         for i in range(0, int(array.shape[0]), chunk)]}
        if tensors:
            _write_rank_file(os.path.join(tmp, fname), tensors)
    except Exception as e:  # every rank must learn of it: agree below
        error = f"rank {rank}: {type(e).__name__}: {e}"
    everyone = _gather_json({"pieces": pieces, "error": error})
    errors = [r["error"] for r in everyone if r["error"]]
    if rank == 0:
        if not errors:
            try:
                _publish(path, tmp, items, everyone, aliases, optimizer, extra, world)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        if errors:  # before the others learn the outcome: they return to a clean dir
            shutil.rmtree(tmp, ignore_errors=True)
    outcome = _gather_json("; ".join(errors) if rank == 0 else None)[0]  # rank 0 decides
    if outcome:
        raise CheckpointError(f"save_checkpoint({path!r}) failed; the previous checkpoint "
                              f"(if any) is unchanged. {outcome}")


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
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.path.basename(tmp).rsplit('-', 1)[-1]}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- load
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
        from safetensors import safe_open

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


def load_checkpoint(path, model, optimizer=None, strict=True):
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``), whatever layout either was in; return the saved ``extra``. A
    collective on a sharded model: call it on every rank. Nothing changes unless every
    rank read everything it needs."""
    from .api import _units_under

    path = os.path.abspath(os.fspath(path))
    items, aliases, optimizer = _all_items(model, optimizer)
    loaded, error, meta, unexpected = [], None, None, []
    try:
        meta = read_metadata(path)
        params_saved = {n for n in meta["tensors"] if "/optim/" not in n}
        unexpected = sorted(params_saved - {it.name for it in items} - set(aliases))
    except Exception as e:
        error = e
    # unexpected only if no rank wants it: an EP rank holds only its own experts
    for other in _gather_json(unexpected if strict and error is None else None):
        if other is not None:
            unexpected = sorted(set(unexpected) & set(other))
    if error is None:
        try:
            loaded = _read_items(path, meta, items, optimizer, unexpected if strict else [])
        except Exception as e:
            error = e
    errors = _errors_everywhere(None if error is None else f"rank {_rank_world()[0]}: {error}")
    if errors:
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"load_checkpoint({path!r}): {error}") from error
        raise CheckpointError(f"load_checkpoint({path!r}) failed on another rank, nothing "
                              f"was changed: {'; '.join(errors)[:2000]}")
    for unit in _units_under(model):
        unit.reshard(force=True)  # gathered copies would be stale
    for it, array in loaded:
        it.put(array)
    lr = getattr(optimizer, "_learning_rate", None)
    if meta.get("lr_scheduler") and hasattr(lr, "set_state_dict"):
        lr.set_state_dict(meta["lr_scheduler"])
    return meta.get("extra")


def _read_items(path, meta, items, optimizer, unexpected) -> list:
    """``[(item, rows read)]`` for every item, after checking names, shapes, CRCs."""
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
                f"{it.name}: checkpoint has shape {entry['shape']} {entry['dtype']}, "
                f"the model {it.shape} {it.dtype}")
        if it.rows:
            loaded.append((it, _read_rows(reader, it.name, entry, it.row0, it.rows)))
    return loaded


# ---------------------------------------------------------------- flex_checkpoint
def sharded_state_dict(model, structured_name_prefix: str = "") -> dict:
    """``{name: ShardedWeight}`` for Paddle's ``flex_checkpoint.dcp`` save/load: each
    managed parameter as this rank's unpadded rows (a view of the shard storage, so a
    dcp load writes straight into it) at its global row offset; everything else whole.
    Outer replicas describe the same pieces; dcp keeps one. Tied aliases are left out
    (their one tensor is saved under the first name)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    canonical, _ = _names_and_aliases(model)
    out = {}
    for name, value in canonical.items():
        key = structured_name_prefix + name
        sp = managed_param(value)
        if sp is None:
            shape = tuple(int(d) for d in value.shape)
            out[key] = ShardedWeight(key, value, shape, shape, (0,) * len(shape))
            continue
        start = min(sp.inner_rank * sp.rows_per_rank, sp.rows)
        count = min(start + sp.rows_per_rank, sp.rows) - start
        if count == 0:
            continue  # this rank's block is all padding
        buf = _buffer_of(sp)
        local = buf.flat._slice(sp.offset, sp.offset + count * sp.row_numel)
        local = local.reshape([count] + sp.rest)
        local.name = sp.shard.name
        out[key] = ShardedWeight(key, local, (count, *sp.rest), tuple(sp.shape),
                                 (start,) + (0,) * len(sp.rest))
    return out


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict: dict) -> dict:
    """The optimizer's state as ``ShardedWeight``s, in the form Paddle's own
    ``AdamW.sharded_state_dict`` gives (``{param key}.moment1_0``, ``.beta1_pow_acc_0``,
    ..., ``.w_0`` for a master weight), each row-shaped state a view of its unpadded
    rows at the parameter's global offset, so a dcp load writes straight into it. Keys
    follow ``model_sharded_state_dict`` (from ``model.sharded_state_dict()``); states of
    a parameter whose block is all padding on this rank are left out, like the block."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    optimizer = unwrap_optimizer(optimizer)
    _ensure_accumulators(optimizer)
    key_of = {}
    for key, weight in sorted(model_sharded_state_dict.items()):
        key_of.setdefault(weight.local_tensor.name, key)  # tied: the first key owns it
    out = {}
    for p in _params_of(optimizer):
        key = key_of.get(p.name)
        if key is None:
            continue
        ref = model_sharded_state_dict[key]
        for acc, t in sorted(_states_of(optimizer, p).items()):
            name = f"{key}.{'w' if acc == 'master_weight' else acc}_0"  # Paddle's names
            if list(t.shape) == list(p.shape):  # rows like its parameter's
                rows = int(ref.local_shape[0]) if ref.local_shape else 1
                local = t if rows == int(t.shape[0]) else t._slice(0, rows)
                out[name] = ShardedWeight(name, local, tuple(ref.local_shape),
                                          tuple(ref.global_shape), tuple(ref.global_offset))
            else:  # a scalar state (beta powers): whole, the same wherever it is held
                shape = tuple(int(d) for d in t.shape)
                out[name] = ShardedWeight(name, t, shape, shape, (0,) * len(shape))
    return out


def install() -> None:
    """``optimizer.sharded_state_dict(model_sd)`` (what PaddleFormers' trainer calls)
    gives :func:`optimizer_sharded_state_dict` for an optimizer over HSDP shards; other
    optimizers keep Paddle's own."""
    original = paddle.optimizer.AdamW.sharded_state_dict
    if getattr(original, "_hsdp", False):
        return

    def sharded_state_dict(self, model_sharded_state_dict):
        if any(managed_param(p) is not None for p in _params_of(self)):
            return optimizer_sharded_state_dict(self, model_sharded_state_dict)
        return original(self, model_sharded_state_dict)

    sharded_state_dict._hsdp = True
    sharded_state_dict.__doc__ = original.__doc__
    paddle.optimizer.AdamW.sharded_state_dict = sharded_state_dict


def _buffer_of(sp):
    unit = owning_unit(sp)
    return next(buf for buf in unit.buffers if any(p is sp for p in buf.params))


# ---------------------------------------------------------------- CLI
def consolidate(path, out) -> list[str]:
    """Write the checkpoint's model tensors as one safetensors file with the unsharded
    model's ``state_dict()`` keys (tied aliases included); return the keys written.
    Plain Paddle loads it with ``safetensors.paddle.load_file`` + ``set_state_dict``."""
    from safetensors.paddle import save_file

    meta = read_metadata(path)
    reader = _Reader(os.fspath(path))
    full = {}
    for name, entry in meta["tensors"].items():
        if "/optim/" in name:
            continue
        rows = entry["shape"][0] if entry["shape"] else 1
        full[name] = _read_rows(reader, name, entry, 0, rows).reshape(entry["shape"])
    for alias, name in meta["aliases"].items():
        full[alias] = full[name]
    # safetensors.paddle writes bfloat16 as BF16 (numpy has no bfloat16)
    save_file({k: paddle.to_tensor(np.ascontiguousarray(v), dtype=_dtype_of(meta, k))
               for k, v in full.items()}, os.fspath(out))
    return list(full)


def _dtype_of(meta, name) -> str:
    return meta["tensors"][meta["aliases"].get(name, name)]["dtype"]


def describe(path) -> str:
    """What a checkpoint holds, as text (the ``inspect`` command)."""
    meta = read_metadata(path)
    lines = [f"{path}: {FORMAT}, saved {meta.get('saved_at')} by {meta['world_size']} "
             f"rank(s); extra: {json.dumps(meta.get('extra'))}"]
    total = 0
    for name, t in sorted(meta["tensors"].items()):
        numel = int(np.prod(t["shape"])) if t["shape"] else 1
        total += numel * np.dtype(t["dtype"]).itemsize
        lines.append(f"  {name:50s} {str(t['shape']):>18s} {t['dtype']:8s} "
                     f"{len(t['pieces'])} piece(s)")
    for alias, name in sorted(meta["aliases"].items()):
        lines.append(f"  {alias:50s} = {name} (tied)")
    files = sorted({p["file"] for t in meta["tensors"].values() for p in t["pieces"]})
    lines.append(f"{len(meta['tensors'])} tensors, {total / 2**20:.1f} MiB in {len(files)} "
                 f"file(s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

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
    except CheckpointError as e:
        print(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
