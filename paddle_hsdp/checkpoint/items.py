"""What this rank holds of a checkpoint: one item per tensor (or its block), model
parameters and buffers under their checkpoint names (checkpoint/names.py), the
optimizer's states of each as ``NAME/optim/STATE``.

An item is a box of the full (logical) tensor (checkpoint/boxes.py): a sharded
parameter's inner block of rows (read from and written into the buffer's flat shard,
every outer sub-shard of it: a load needs no collective) of this rank's
tensor-parallel slice (checkpoint/placement.py); an unsharded tensor's whole slice.
Its optimizer states' items are the rows the optimizer holds, which with outer
sub-shards (``fsdp_outer_sharding="optim"``) are distinct on every rank; scalar states
(beta powers) are one element. Each item says which other ranks hold the same box
(its :class:`~paddle_hsdp.checkpoint.plan.Replicas`), from which checkpoint/plan.py
decides who writes it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

import paddle

from ..engine.experts import global_names
from ..engine.optimizers import ensure_accumulators, optimizer_params, states_of, unwrap_optimizer
from ..engine.registry import managed_param, registry
from ..hints import expect_layer, expect_optimizer
from ..topology.placement import ModelAxes, is_expert
from .boxes import dims
from .names import checkpoint_names
from .plan import Replicas
from .rules import Spot
from .tp_merge import check_merge_is_concat

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

    from ..engine.buffer import ShardBuffer
    from ..engine.param import ShardedParam
    from ..topology.placement import Placement

# how an item's box is read (as an array) and written back
Getter = Callable[[], np.ndarray]
Putter = Callable[[np.ndarray], None]


class Item:
    """One checkpoint tensor as this rank holds it: the box ``offset`` + ``size`` of a
    tensor of ``shape`` (the full one); ``get()`` reads it, ``put(array)`` writes it
    back. ``split``: how tensor parallelism cut it; ``tag``: what tells its data apart
    from a same-named box of another rank; ``stage``: its pipeline stage."""

    def __init__(self, name: str, shape: Sequence[int], dtype: str, offset: Sequence[int],
                 size: Sequence[int], get: Getter, put: Putter, split: dict | None = None,
                 tag: str = "", stage: int = 0, replicas: Replicas = Replicas()) -> None:
        self.name, self.shape, self.dtype = name, [int(d) for d in shape], dtype
        self.offset, self.size = [int(d) for d in offset], [int(d) for d in size]
        self.get, self.put = get, put
        self.split, self.tag, self.stage = split, tag, stage
        self.replicas = replicas  # the other ranks holding this box (checkpoint/plan.py)
        # the process group over the "outer" replica axis, when there is one: a load
        # splits the reading of the box over it (checkpoint/load.py)
        self.outer_group: Group | None = None
        # HFSDP in a fault-tolerant job: which piece of the optimizer state the box is
        # (one replica group of its holders writes it); None: every group holds it
        self.piece: int | None = None
        # HFSDP's optimizer rows outside a fault-tolerant job: indexed by rule
        # (checkpoint/rules.py), where in its buffer's layout they sit
        self.spot: Spot | None = None

    @property
    def empty(self) -> bool:
        return any(d == 0 for d in self.size)



def dtype_name(dtype: paddle.dtype) -> str:
    # bfloat16 travels as its raw uint16 bits (numpy has no bfloat16); the metadata
    # keeps the real dtype, and _putter / consolidate turn the bits back into bfloat16
    return str(dtype).replace("paddle.", "")


def original_and_local(value: paddle.Tensor) -> tuple[paddle.Tensor, list[int]]:
    """``(the parameter Paddle's marks are on, its shape on this rank before sharding)``
    of a model tensor: for an HSDP shard its original parameter, else itself."""
    sp = managed_param(value)
    return (value, list(value.shape)) if sp is None else (sp.full, list(sp.shape))


def _param_items(model: paddle.nn.Layer, axes: ModelAxes,
                 trainable_only: bool = False) -> tuple[list[Item], dict, dict]:
    canonical, aliases = checkpoint_names(model)
    if trainable_only:
        canonical, aliases = trainable_names(canonical, aliases)
    renamed_experts = tuple(global_names(model).values())
    items, by_shard, split = [], {}, {}
    for name, value in canonical.items():
        sp = managed_param(value)
        original, local = original_and_local(value)
        place = axes.place(original, local, name.startswith(renamed_experts))
        if place.split is not None:
            split[name] = (original, local)
        mp = _mp_axis(axes) if place.split is None else ()
        if sp is None:  # not sharded: the whole slice (a replica on every sharding rank)
            start, count = 0, (local or [1])[0]
            get, put = _getter(value, None), _putter(value, None)
            replicas = Replicas(_fsdp_axis(axes.hcg, is_expert(original)) + mp)
        else:
            start, count = sp.row_range(sub=False)
            buf = registry.buffer_of(sp)
            get, put = _block_getter(buf, sp, count), _block_putter(buf, sp, count)
            replicas = Replicas(_axis("outer", buf.outer) + mp)
        items.append(_placed(name, place, dtype_name(value.dtype), start, count, get, put,
                             axes.stage, replicas))
        items[-1].outer_group = None if sp is None else buf.outer
        by_shard[id(value if sp is None else sp.shard)] = name
    if split:
        check_merge_is_concat(model, split, axes.mp_degree)
    return items, by_shard, aliases


def _placed(name: str, place: Placement, dtype: str, start: int, count: int, get: Getter,
            put: Putter, stage: int, replicas: Replicas) -> Item:
    """The item of rows ``[start, start + count)`` of a tensor's slice at ``place``."""
    offset, size = place.rows(start, count)
    return Item(name, place.full_shape, dtype, offset, size, get, put, place.split,
                 place.tag, stage, replicas)


def _axis(name: str, group: Group | None) -> tuple:
    """``group`` as a replica axis (none for a group of one)."""
    if group is None or group.nranks <= 1:
        return ()
    return ((name, group.nranks, group.rank),)


def _mp_axis(axes: ModelAxes) -> tuple:
    """The mp ranks, which hold the same box of a tensor they do not split."""
    return (("mp", axes.mp_degree, axes.mp_rank),) if axes.mp_degree > 1 else ()


def _fsdp_axis(hcg: HybridCommunicateGroup | None, expert: bool) -> tuple:
    """The ranks holding the same unsharded tensor: its FSDP group (outer x inner;
    the expert one for experts), named apart so no plan mixes the two."""
    getter = getattr(hcg, "get_fsdp_group", None)
    if getter is None:
        return ()
    return _axis("expert_fsdp" if expert else "fsdp", getter(expert))


def _block_getter(buf: ShardBuffer, sp: ShardedParam, rows: int) -> Getter:
    """Read the first ``rows`` rows of ``sp``'s inner block."""
    return lambda: buf.storage.read_block(sp).numpy()[:rows]


def _block_putter(buf: ShardBuffer, sp: ShardedParam, rows: int) -> Putter:
    """Write ``rows`` rows into ``sp``'s inner block (every row it holds)."""
    @paddle.no_grad()
    def put(array: np.ndarray) -> None:
        buf.storage.write_block(sp, paddle.to_tensor(array.reshape([rows] + sp.rest), dtype=sp.dtype))
    return put


def _getter(tensor: paddle.Tensor, rows: int | None) -> Getter:
    """Read the first ``rows`` rows of ``tensor`` (None: all of it; a scalar as [1])."""
    def get() -> np.ndarray:
        array = tensor.numpy()
        if array.ndim == 0:
            array = array.reshape([1])
        return array if rows is None else array[:rows]
    return get


def _putter(tensor: paddle.Tensor, rows: int | None) -> Putter:
    """Write ``rows`` (None: the whole tensor) into ``tensor`` in place, keeping any
    padding rows of a shard as zeros."""
    @paddle.no_grad()
    def put(array: np.ndarray) -> None:
        if rows is None:
            value = paddle.to_tensor(array.reshape(tensor.shape), dtype=tensor.dtype)
        else:
            full = np.zeros(tensor.shape, dtype=array.dtype)
            full[:rows] = array
            value = paddle.to_tensor(full, dtype=tensor.dtype)
        paddle.assign(value, output=tensor)
    return put


def _optimizer_items(optimizer: paddle.optimizer.Optimizer, by_shard: dict, param_items: dict,
                     axes: ModelAxes) -> list[Item]:
    """AdamW-style accumulators and master weights, as boxes like their parameter's
    (``moment1``; with outer sub-shards the rows this rank's optimizer holds) or one
    element (``beta1_pow_acc``, shape [1], the same wherever it is held)."""
    ensure_accumulators(optimizer)
    items: list[Item] = []
    positions: dict[int, dict[int, int]] = {}  # _index_in's cache
    for p in optimizer_params(optimizer):
        name = by_shard.get(id(p))
        if name is None:
            continue
        owner = param_items[name]
        sp = managed_param(p)
        offset, size = list(owner.offset), list(owner.size)
        mp = _mp_axis(axes)
        # a scalar is the same on every rank holding the parameter, every mp rank too
        block = owner.replicas
        scalar = Replicas(tuple(a for a in owner.replicas.axes if a[0] != "mp") + mp)
        if sp is not None:  # the rows the optimizer holds (the sub-block with parts)
            sub_start, rows = sp.row_range(sub=True)
            offset[0] += sub_start - sp.row_range(sub=False)[0]
            size[0] = rows
            buf = registry.buffer_of(sp)
            inner = "expert_inner" if buf.is_expert else "inner"
            # outer sub-shards (HFSDP): each outer rank's rows are its own
            if sp.parts > 1:
                block = Replicas(tuple(a for a in owner.replicas.axes if a[0] == "mp"))
            scalar = Replicas(_axis(inner, buf.inner) + _axis("outer", buf.outer) + mp)
        for acc, t in sorted(states_of(optimizer, p).items()):
            key = f"{name}/optim/{acc}"
            # a block like its parameter (a one-row block has a beta power's shape)
            if list(t.shape) == list(p.shape) and not acc.endswith("_pow_acc"):
                items.append(Item(key, owner.shape, dtype_name(t.dtype), offset, size,
                                   _getter(t, size[0]), _putter(t, size[0]), owner.split,
                                   owner.tag, owner.stage, block))
                items[-1].outer_group = owner.outer_group
                if sp is not None and sp.parts > 1:
                    items[-1].piece = sp.part
                    if not buf.shared_pieces:
                        base = [owner.offset[0] - sp.row_range(sub=False)[0]] + offset[1:]
                        items[-1].spot = Spot(buf, _index_in(buf, sp, positions), tuple(base))
            else:  # a scalar, the same on every rank holding the parameter (every mp rank)
                items.append(Item(key, t.shape, dtype_name(t.dtype), [0], dims(t.shape),
                                   _getter(t, None), _putter(t, None), None, owner.tag,
                                   owner.stage, scalar))
    return items


def _outer_sync_items(model: paddle.nn.Layer, by_shard: dict, param_items: dict,
                      axes: ModelAxes) -> list[Item]:
    """The outer sync's state of every trainable sharded parameter of a unit that syncs
    every H >= 2 steps: ``NAME/optim/outer_anchor`` and ``outer_momentum`` (boxes like
    the parameter's, the same on every outer replica; the momentum's pieces gathered
    here, on every rank: a collective) and ``outer_steps`` (the position in the
    interval, one element)."""
    items: list[Item] = []
    for unit in registry.units_under(model):
        state = unit.outer_sync
        if state is None:
            continue
        momentum = state.gather_momentum(unit)
        for buf in unit.buffers:
            if not buf.trainable:
                continue
            for sp in buf.params:
                name = by_shard.get(id(sp.shard))
                if name is None:
                    continue
                owner = param_items[name]
                for acc, flat, write in (
                        ("outer_anchor", state.anchors[buf.index], state.write_anchor_block),
                        ("outer_momentum", momentum[buf.index], state.write_momentum_block)):
                    items.append(Item(f"{name}/optim/{acc}", owner.shape, owner.dtype,
                                      owner.offset, owner.size,
                                      _outer_getter(state, flat, sp),
                                      _outer_putter(write, buf, sp), owner.split, owner.tag,
                                      owner.stage, owner.replicas))
                    items[-1].outer_group = owner.outer_group
                scalar = Replicas(_axis("inner", buf.inner) + _axis("outer", buf.outer)
                                  + _mp_axis(axes))
                items.append(Item(f"{name}/optim/outer_steps", [1], "int64", [0], [1],
                                  functools.partial(_get_steps, state),
                                  functools.partial(_put_steps, state), None, owner.tag,
                                  owner.stage, scalar))
    return items


def _outer_getter(state, flat: paddle.Tensor, sp: ShardedParam) -> Getter:
    return lambda: state.read_block(flat, sp).numpy()


def _outer_putter(write: Callable, buf: ShardBuffer, sp: ShardedParam) -> Putter:
    @paddle.no_grad()
    def put(array: np.ndarray) -> None:
        write(buf, sp, paddle.to_tensor(array, dtype=buf.dtype))
    return put


def _get_steps(state) -> np.ndarray:
    return np.array([state.steps], dtype="int64")


def _put_steps(state, array: np.ndarray) -> None:
    state.steps = int(array.reshape([-1])[0])


def _index_in(buf: ShardBuffer, sp: ShardedParam, positions: dict[int, dict[int, int]],
              ) -> int:
    """``sp``'s index in its buffer's layout (``positions``: a cache per call)."""
    if id(buf) not in positions:
        positions[id(buf)] = {id(p): k for k, p in enumerate(buf.params)}
    return positions[id(buf)][id(sp)]


def trainable_names(canonical: dict, aliases: dict) -> tuple[dict, dict]:
    """``(canonical, aliases)`` without the frozen tensors (``stop_gradient``): what a
    checkpoint of a model whose frozen part is read from elsewhere (LoRA adapters over a
    base model) holds. Alike on every rank: the marks are set before sharding."""
    kept = {name: value for name, value in canonical.items()
            if not original_and_local(value)[0].stop_gradient}
    return kept, {alias: name for alias, name in aliases.items() if name in kept}


def all_items(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer | None, call: str,
              trainable_only: bool = False,
               ) -> tuple[list[Item], dict, paddle.optimizer.Optimizer | None, ModelAxes]:
    """``(items, aliases, optimizer, axes)`` of this rank, after the checks every rank
    makes alike (before any collective); ``trainable_only``: the frozen parameters
    (``stop_gradient``) left out."""
    expect_layer(model, f"{call}(path, model)")
    if optimizer is not None:
        expect_optimizer(optimizer, f"{call}(path, model, optimizer)")
    axes = ModelAxes()
    items, by_shard, aliases = _param_items(model, axes, trainable_only)
    for unit in registry.units_under(model):  # every rank: owed outer rebuilds run here
        unit.ensure_rebuilt()
    if optimizer is not None:
        optimizer = unwrap_optimizer(optimizer)
        by_name = {it.name: it for it in items}
        items += _optimizer_items(optimizer, by_shard, by_name, axes)
        items += _outer_sync_items(model, by_shard, by_name, axes)
    return items, aliases, optimizer, axes
