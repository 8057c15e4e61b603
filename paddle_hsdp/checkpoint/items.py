"""What this rank holds of a checkpoint: one item per tensor (or its block of rows),
model parameters and buffers by their structured names in the unsharded model, and
the optimizer's states of each as ``NAME/optim/STATE``.

A sharded parameter's item is its inner block (read from and written into the
buffer's flat shard, every outer sub-shard of it: a load needs no collective); its
optimizer states' items are the rows the optimizer holds, which with outer sub-shards
(``fsdp_outer_sharding="optim"``) are distinct on every rank, so every rank writes its
own."""

from __future__ import annotations

import numpy as np

import paddle

from ..engine.experts import names_and_aliases
from ..engine.optimizers import _ensure_accumulators, _params_of, _states_of, unwrap_optimizer
from ..engine.registry import managed_param, registry
from ..hints import expect_layer, expect_optimizer
from ..topology.mesh import model_parallel_degrees
from .format import _rank_world


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
    degrees = model_parallel_degrees()
    for what in ("mp_degree", "pp_degree"):
        if degrees[what] > 1:
            raise NotImplementedError(
                f"save/load_checkpoint with {what} > 1 is not supported yet: tensor "
                "slices and pipeline stages are not recorded in the format.")


def _writer(sp) -> bool:
    """Whether this rank writes ``sp``'s block: one outer replica per buffer, rotating
    with the buffer so the writing spreads over the replicas."""
    buf = registry.buffer_of(sp)
    return buf.outer.rank == (buf.unit_index + buf.index) % buf.outer.nranks


def _state_writer(sp) -> bool:
    """Whether this rank writes the optimizer states of ``sp``: the block's writer, or
    with outer sub-shards every rank (each holds different rows)."""
    return sp.parts > 1 or _writer(sp)


def _param_items(model) -> tuple[list[_Item], dict, dict]:
    canonical, aliases = names_and_aliases(model)
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
        start, count = sp.row_range(sub=False)
        buf = registry.buffer_of(sp)
        items.append(_Item(name, sp.shape, _dtype_name(sp.dtype), start, count, _writer(sp),
                           _block_getter(buf, sp, count), _block_putter(buf, sp, count)))
        by_shard[id(sp.shard)] = name
    return items, by_shard, aliases


def _block_getter(buf, sp, rows):
    """Read the first ``rows`` rows of ``sp``'s inner block."""
    return lambda: buf.read_block(sp).numpy()[:rows]


def _block_putter(buf, sp, rows):
    """Write ``rows`` rows into ``sp``'s inner block, padding rows zero."""
    @paddle.no_grad()
    def put(array):
        full = np.zeros([sp.rows_per_rank] + sp.rest, dtype=array.dtype)
        full[:rows] = array
        buf.write_block(sp, paddle.to_tensor(full, dtype=sp.dtype))
    return put


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
        sp = managed_param(p)
        row0, rows, writes = owner.row0, owner.rows, owner.writes
        if sp is not None:  # the rows the optimizer holds (the sub-block with parts)
            (row0, rows), writes = sp.row_range(sub=True), _state_writer(sp)
        for acc, t in sorted(_states_of(optimizer, p).items()):
            if list(t.shape) == list(p.shape):  # a block like its parameter
                items.append(_Item(f"{name}/optim/{acc}", owner.shape, _dtype_name(t.dtype),
                                   row0, rows, writes, _getter(t, rows), _putter(t, rows)))
            else:  # a scalar, the same on every rank holding the parameter
                items.append(_Item(f"{name}/optim/{acc}", t.shape, _dtype_name(t.dtype), 0,
                                   int(t.shape[0]), writes and row0 == 0,
                                   _getter(t, None), _putter(t, None)))
    return items


def _all_items(model, optimizer, call: str):
    expect_layer(model, f"{call}(path, model)")
    if optimizer is not None:
        expect_optimizer(optimizer, f"{call}(path, model, optimizer)")
    _check_supported(model)
    for unit in registry.units_under(model):  # every rank: owed outer rebuilds run here
        unit.ensure_rebuilt()
    items, by_shard, aliases = _param_items(model)
    if optimizer is not None:
        optimizer = unwrap_optimizer(optimizer)
        by_name = {it.name: it for it in items}
        items += _optimizer_items(optimizer, by_shard, by_name)
    return items, aliases, optimizer
