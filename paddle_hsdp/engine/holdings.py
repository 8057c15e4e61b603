"""What the engine holds of a model and its optimizer, stated once: :func:`layout_of`.

For every tensor this rank holds, each parameter and persistable buffer under the name a
checkpoint saves it by (local experts under their global index, a PaddleFormers pipeline
stage under its one-process names: engine/saved_names.py) and each optimizer state of
each, a :class:`HeldTensor` says its full (logical) shape and dtype, the box of it this
rank holds (offset and size in the full tensor), which other ranks hold the same box
(its replica axes), its tensor-parallel split, pipeline stage and expert tag, the buffer
whose layout cuts its rows (a :class:`HeldBuffer`: unit, index, segment layout, inner
and outer coordinates, HFSDP parts), and how to read and write its values.

The checkpoint (save, load, a fault-tolerant job's resume) and tools/sim_checkpoint.py
read this and nothing else of the engine (.importlinter's checkpoint-seam contract), so
where a tensor sits is worked out here, in one pass, not by the checkpoint reaching
into the registry, the experts' renames and the placements in turn.

* A sharded parameter's box is its inner block of rows (every outer sub-shard of it: a
  load needs no outer collective) of this rank's tensor-parallel slice; its replicas
  are the outer group (and the mp ranks when tensor parallelism does not split it).
* An unsharded tensor's box is its whole slice, held by every rank of its FSDP group
  (the expert one for experts).
* An optimizer state shaped like its parameter holds the rows the optimizer holds: with
  outer sub-shards (HFSDP) its own part's rows (``piece``), which no other rank of the
  FSDP group holds; a state one outer replica keeps alone (the optimizer's
  ``holds_state_alone``: Muon's momentum of a matrix shared over the replicas) has no
  outer replicas (the others hold none of it); a scalar (a beta power) is one element, the same on every rank
  holding the parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np
import paddle

from ..topology.placement import ModelAxes, is_expert
from .experts import global_names
from .optimizers import ensure_accumulators, optimizer_params, states_of, unwrap_optimizer
from .registry import managed_param, registry
from .saved_names import saved_names

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup

    from .buffer import ShardBuffer
    from .diloco import OuterSyncState
    from .layout import SegmentLayout
    from .param import ShardedParam
    from .unit import FSDPUnit

# ((axis name, its size, this rank's index on it), ...): the ranks holding the same box
ReplicaAxes = tuple[tuple[str, int, int], ...]
Reader = Callable[[], np.ndarray]
Writer = Callable[[np.ndarray], None]


@dataclass(frozen=True, eq=False)
class HeldBuffer:
    """A buffer of flat shards: its unit's and its own index, whether it holds experts,
    its segment layout (engine/layout.py), this rank's place in it (inner rank, outer
    part of ``parts``), whether its parts are shared by several replica groups (a
    fault-tolerant job's pieces), and its FSDP and outer process groups."""

    unit: int
    index: int
    expert: bool
    layout: SegmentLayout
    inner_size: int
    inner_rank: int
    parts: int
    part: int
    shared_pieces: bool
    fsdp_group: Group | None
    outer_group: Group | None


@dataclass(frozen=True, eq=False)
class HeldTensor:
    """One tensor (or optimizer state: ``state`` names it) as this rank holds it: the box
    ``offset`` + ``size`` of the full tensor of ``full_shape``; ``read()`` gives the box
    as an array, ``write(array)`` puts it back. ``split``: ``(axis, mp degree)`` where
    tensor parallelism cut it; ``slice_offset``: where this rank's slice starts in the
    full tensor; ``buffer`` and ``layout_index``: the buffer whose layout cuts its rows
    and its index there (None for a tensor kept whole, and for a scalar state);
    ``piece``: the HFSDP part whose optimizer rows it is (None: every part's)."""

    name: str
    state: str | None
    full_shape: tuple[int, ...]
    dtype: str
    offset: tuple[int, ...]
    size: tuple[int, ...]
    replicas: ReplicaAxes
    read: Reader = field(repr=False)
    write: Writer = field(repr=False)
    split: tuple[int, int] | None = None
    tag: str = ""
    stage: int = 0
    slice_offset: tuple[int, ...] = (0,)
    buffer: HeldBuffer | None = None
    layout_index: int | None = None
    piece: int | None = None


@dataclass(frozen=True, eq=False)
class Holdings:
    """Everything :func:`layout_of` states: the tensors (parameters and buffers, then
    optimizer states), the tied aliases (``{alias: canonical name}``), every buffer of
    the model's units, this rank's pipeline stage, the pipeline and tensor-parallel
    degrees, the job's degrees (what a checkpoint's metadata records as its layout),
    and the optimizer under fleet's wrappers."""

    tensors: tuple[HeldTensor, ...]
    aliases: Mapping[str, str]
    buffers: tuple[HeldBuffer, ...]
    stage: int
    pp_degree: int
    mp_degree: int
    job_layout: Mapping[str, object]
    optimizer: paddle.optimizer.Optimizer | None
    units: tuple[FSDPUnit, ...] = field(repr=False)

    def drop_gathered_copies(self) -> None:
        """Before writing into the tensors: parameters kept gathered would go stale."""
        for unit in self.units:
            unit.reshard(force=True)


def dtype_name(dtype: paddle.dtype) -> str:
    # bfloat16 travels as its raw uint16 bits (numpy has no bfloat16); the metadata
    # keeps the real dtype, and _writer / consolidate turn the bits back into bfloat16
    return str(dtype).replace("paddle.", "")


def original_and_local(value: paddle.Tensor) -> tuple[paddle.Tensor, list[int]]:
    """``(the parameter Paddle's marks are on, its shape on this rank before sharding)``
    of a model tensor: for an HSDP shard its original parameter, else itself."""
    sp = managed_param(value)
    return (value, list(value.shape)) if sp is None else (sp.full, list(sp.shape))


def trainable_names(canonical: dict, aliases: dict) -> tuple[dict, dict]:
    """``(canonical, aliases)`` without the frozen tensors (``stop_gradient``): what a
    checkpoint of a model whose frozen part is read from elsewhere (LoRA adapters over a
    base model) holds. Alike on every rank: the marks are set before sharding."""
    kept = {name: value for name, value in canonical.items()
            if not original_and_local(value)[0].stop_gradient}
    return kept, {alias: name for alias, name in aliases.items() if name in kept}


def layout_of(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer | None = None,
              trainable_only: bool = False) -> Holdings:
    """What this rank holds of ``model`` and ``optimizer`` (see the module docstring);
    ``trainable_only``: the frozen parameters (``stop_gradient``) left out. A collective
    where a unit owes an outer rebuild (a fault-tolerant round changed its pieces' holders):
    call it on every rank."""
    axes = ModelAxes()
    units = tuple(registry.units_under(model))
    held = {id(buf): _held_buffer(buf) for unit in units for buf in unit.buffers}
    tensors, by_shard, aliases = _model_tensors(model, axes, trainable_only, held)
    for unit in units:  # every rank: owed outer rebuilds run here
        unit.ensure_rebuilt()
    if optimizer is not None:
        optimizer = unwrap_optimizer(optimizer)
        tensors += _optimizer_tensors(optimizer, by_shard, axes)
        tensors += _outer_sync_tensors(units, by_shard, axes)
    return Holdings(tuple(tensors), MappingProxyType(aliases), tuple(held.values()),
                    axes.stage, axes.pp_degree, axes.mp_degree,
                    MappingProxyType(axes.layout()), optimizer, units)


def _held_buffer(buf: ShardBuffer) -> HeldBuffer:
    return HeldBuffer(buf.unit_index, buf.index, buf.is_expert, buf.layout, buf.inner.nranks,
                      buf.inner.rank, buf.parts, buf.part, buf.shared_pieces,
                      buf.params[0].mesh.fsdp_group(buf.is_expert), buf.outer)


# ``{id(tensor the optimizer sees): (its HeldTensor, its ShardedParam or None, its
# buffer's HeldBuffer or None)}``: what the optimizer states are laid out after
ByShard = dict[int, tuple[HeldTensor, "ShardedParam | None", "HeldBuffer | None"]]


def _model_tensors(model: paddle.nn.Layer, axes: ModelAxes, trainable_only: bool,
                   held_buffers: dict[int, HeldBuffer],
                   ) -> tuple[list[HeldTensor], ByShard, dict[str, str]]:
    """The parameters and buffers, and the tied aliases of those kept (``held_buffers``:
    ``{id(buffer): its HeldBuffer}``, completed with any buffer of a unit outside
    ``model`` that holds one of them)."""
    canonical, aliases = saved_names(model)
    if trainable_only:
        canonical, aliases = trainable_names(canonical, aliases)
    renamed_experts = tuple(global_names(model).values())
    mp = _mp_axis(axes)
    tensors, by_shard = [], {}
    positions: dict[int, dict[int, int]] = {}  # id(buffer) -> {id(param): its index}
    for name, value in canonical.items():
        sp = managed_param(value)
        original, local = original_and_local(value)
        place = axes.place(original, local, name.startswith(renamed_experts))
        split = None if place.split is None else (place.split["axis"], place.split["degree"])
        unsplit_mp = mp if split is None else ()
        held = None
        if sp is None:  # not sharded: the whole slice (a replica on every sharding rank)
            start, count = 0, (local or [1])[0]
            read, write, index = _reader(value, None), _writer(value, None), None
            replicas = _fsdp_axis(axes.hcg, is_expert(original)) + unsplit_mp
        else:
            start, count = sp.row_range(sub=False)
            buf = registry.buffer_of(sp)
            if id(buf) not in held_buffers:
                held_buffers[id(buf)] = _held_buffer(buf)
            held = held_buffers[id(buf)]
            read, write = _block_reader(buf, sp, count), _block_writer(buf, sp, count)
            if id(buf) not in positions:  # (once per buffer: not a scan per parameter)
                positions[id(buf)] = {id(p): k for k, p in enumerate(buf.params)}
            index = positions[id(buf)][id(sp)]
            replicas = _axis("outer", buf.outer) + unsplit_mp
        offset, size = place.rows(start, count)
        tensors.append(HeldTensor(
            name, None, tuple(place.full_shape), dtype_name(value.dtype), tuple(offset),
            tuple(size), replicas, read, write, split, place.tag, axes.stage,
            tuple(place.rows(0, 0)[0]), held, index))
        by_shard[id(value if sp is None else sp.shard)] = (tensors[-1], sp, held)
    return tensors, by_shard, aliases


def _optimizer_tensors(optimizer: paddle.optimizer.Optimizer, by_shard: ByShard,
                       axes: ModelAxes) -> list[HeldTensor]:
    """AdamW-style accumulators and master weights, as boxes like their parameter's
    (``moment1``; with outer sub-shards the rows this rank's optimizer holds) or one
    element (``beta1_pow_acc``, shape [1], the same wherever it is held)."""
    ensure_accumulators(optimizer)
    tensors: list[HeldTensor] = []
    mp = _mp_axis(axes)
    # Muon (issue 65): a state only one outer replica keeps (the others hold none)
    alone = getattr(optimizer, "holds_state_alone", None) or (lambda p, state: False)
    for p in optimizer_params(optimizer):
        if id(p) not in by_shard:
            continue
        owner, sp, buf = by_shard[id(p)]
        offset, size = list(owner.offset), list(owner.size)
        block = owner.replicas
        # a scalar is the same on every rank holding the parameter, every mp rank too
        scalar = tuple(a for a in owner.replicas if a[0] != "mp") + mp
        piece = None
        if sp is not None and buf is not None:  # the rows the optimizer holds
            sub_start, rows = sp.row_range(sub=True)
            offset[0] += sub_start - sp.row_range(sub=False)[0]
            size[0] = rows
            inner = "expert_inner" if buf.expert else "inner"
            # outer sub-shards (HFSDP): each outer rank's rows are its own
            if sp.parts > 1:
                block = tuple(a for a in owner.replicas if a[0] == "mp")
                piece = sp.part
            scalar = ((_sized(inner, buf.inner_size, buf.inner_rank)
                       + _axis("outer", buf.outer_group)) + mp)
        for state, t in sorted(states_of(optimizer, p).items()):
            # a block like its parameter (a one-row block has a beta power's shape)
            if list(t.shape) == list(p.shape) and not state.endswith("_pow_acc"):
                lone = alone(p, state) and piece is None
                tensors.append(HeldTensor(
                    owner.name, state, owner.full_shape, dtype_name(t.dtype), tuple(offset),
                    tuple(size), tuple(a for a in block if a[0] != "outer") if lone else block,
                    _reader(t, size[0]), _writer(t, size[0]), owner.split,
                    owner.tag, owner.stage, owner.slice_offset, owner.buffer,
                    owner.layout_index, piece))
            else:  # a scalar, the same on every rank holding the parameter (every mp rank)
                shape = tuple(int(d) for d in t.shape)
                tensors.append(HeldTensor(
                    owner.name, state, shape, dtype_name(t.dtype), (0,), shape or (1,), scalar,
                    _reader(t, None), _writer(t, None), None, owner.tag, owner.stage))
    return tensors


def _outer_sync_tensors(units: tuple[FSDPUnit, ...], by_shard: ByShard,
                        axes: ModelAxes) -> list[HeldTensor]:
    """The outer sync's state (DiLoCo, engine/diloco.py) of every trainable sharded
    parameter of a unit that syncs every H >= 2 steps: ``outer_anchor`` and
    ``outer_momentum`` as boxes like the parameter's (the same on every outer replica;
    the momentum's pieces gathered here, on every rank: a collective over the outer
    group) and ``outer_steps``, the position in the interval (one element)."""
    tensors: list[HeldTensor] = []
    mp = _mp_axis(axes)
    for unit in units:
        sync = unit.outer_sync
        if sync is None:
            continue
        momentum = sync.gather_momentum(unit)
        for buf in (b for b in unit.buffers if b.trainable):
            for sp in buf.params:
                if id(sp.shard) not in by_shard:
                    continue
                owner = by_shard[id(sp.shard)][0]
                for state, flat, write in (
                        ("outer_anchor", sync.anchors[buf.index], sync.write_anchor_block),
                        ("outer_momentum", momentum[buf.index], sync.write_momentum_block)):
                    tensors.append(dataclasses.replace(
                        owner, state=state, read=_outer_reader(sync, flat, sp),
                        write=_outer_writer(write, buf, sp)))
                scalar = _axis("inner", buf.inner) + _axis("outer", buf.outer) + mp
                tensors.append(HeldTensor(
                    owner.name, "outer_steps", (1,), "int64", (0,), (1,), scalar,
                    functools.partial(_read_steps, sync), functools.partial(_write_steps, sync),
                    None, owner.tag, owner.stage))
    return tensors


def _outer_reader(sync: OuterSyncState, flat: paddle.Tensor, sp: ShardedParam) -> Reader:
    return lambda: sync.read_block(flat, sp).numpy()


def _outer_writer(write: Callable, buf: ShardBuffer, sp: ShardedParam) -> Writer:
    @paddle.no_grad()
    def put(array: np.ndarray) -> None:
        write(buf, sp, paddle.to_tensor(array, dtype=buf.dtype))
    return put


def _read_steps(sync: OuterSyncState) -> np.ndarray:
    return np.array([sync.steps], dtype="int64")


def _write_steps(sync: OuterSyncState, array: np.ndarray) -> None:
    sync.steps = int(array.reshape([-1])[0])


def _sized(name: str, size: int, rank: int) -> ReplicaAxes:
    """An axis of ``size`` ranks (none for one rank)."""
    return ((name, size, rank),) if size > 1 else ()


def _axis(name: str, group: Group | None) -> ReplicaAxes:
    """``group`` as a replica axis (none for a group of one)."""
    return () if group is None else _sized(name, group.nranks, group.rank)


def _mp_axis(axes: ModelAxes) -> ReplicaAxes:
    """The mp ranks, which hold the same box of a tensor they do not split."""
    return _sized("mp", axes.mp_degree, axes.mp_rank)


def _fsdp_axis(hcg: HybridCommunicateGroup | None, expert: bool) -> ReplicaAxes:
    """The ranks holding the same unsharded tensor: its FSDP group (outer x inner;
    the expert one for experts), named apart so no plan mixes the two."""
    getter = getattr(hcg, "get_fsdp_group", None)
    if getter is None:
        return ()
    return _axis("expert_fsdp" if expert else "fsdp", getter(expert))


def _block_reader(buf: ShardBuffer, sp: ShardedParam, rows: int) -> Reader:
    """Read the first ``rows`` rows of ``sp``'s inner block."""
    return lambda: buf.storage.read_block(sp).numpy()[:rows]


def _block_writer(buf: ShardBuffer, sp: ShardedParam, rows: int) -> Writer:
    """Write ``rows`` rows into ``sp``'s inner block (every row it holds)."""
    @paddle.no_grad()
    def write(array: np.ndarray) -> None:
        buf.storage.write_block(sp, paddle.to_tensor(array.reshape([rows] + sp.rest),
                                                     dtype=sp.dtype))
    return write


def _reader(tensor: paddle.Tensor, rows: int | None) -> Reader:
    """Read the first ``rows`` rows of ``tensor`` (None: all of it; a scalar as [1])."""
    def read() -> np.ndarray:
        array = tensor.numpy()
        if array.ndim == 0:
            array = array.reshape([1])
        return array if rows is None else array[:rows]
    return read


def _writer(tensor: paddle.Tensor, rows: int | None) -> Writer:
    """Write ``rows`` (None: the whole tensor) into ``tensor`` in place, keeping any
    padding rows of a shard as zeros."""
    @paddle.no_grad()
    def write(array: np.ndarray) -> None:
        if rows is None:
            value = paddle.to_tensor(array.reshape(tensor.shape), dtype=tensor.dtype)
        else:
            full = np.zeros(tensor.shape, dtype=array.dtype)
            full[:rows] = array
            value = paddle.to_tensor(full, dtype=tensor.dtype)
        paddle.assign(value, output=tensor)
    return write


def tensor_parallel_slices(holdings: Holdings) -> dict[str, tuple[int, list[int]]]:
    """``{name: (split axis, this rank's local shape)}`` of the parameters and buffers
    tensor parallelism splits."""
    out = {}
    for t in holdings.tensors:
        if t.state is None and t.split is not None:
            axis, degree = t.split
            local = list(t.full_shape)
            local[axis] //= degree
            out[t.name] = (axis, local)
    return out


__all__ = ["HeldBuffer", "HeldTensor", "Holdings", "ReplicaAxes", "dtype_name", "layout_of",
           "original_and_local", "tensor_parallel_slices", "trainable_names"]
