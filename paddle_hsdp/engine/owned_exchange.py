"""A whole-matrix optimizer's shared matrices across the outer replicas, packed over the
model (issue 65, Muon).

Under plain HSDP the owners of Muon's matrices stay in the inner group, so every outer
replica holds each of its matrices whole, and the optimizer gives each to one replica
(engine/optimizers.py, ``share_orthogonalisation_over_replicas``), which alone keeps its
momentum and so alone needs its reduced grad. An outer all-reduce would bring every
replica every one of them; instead a buffer's outer all-reduce stops at ``prefix``
(its free parameters and any owned one not shared, which the layout puts first in
each segment: engine/layout.py) and one reduce-scatter per outer group and reduce
dtype, whatever the number of matrices and buffers, brings each replica the sum of its
own matrices' grads, packed: each replica's matrices one after another over the whole
model, padded to the largest replica's. The optimizer's all-gather of the results is
the other half, so the bytes across machines are an all-reduce's of the real matrices,
where a layout that spread the owners over inner x outer per buffer paid each
buffer's heaviest segment (1.2x at the 140M benchmark's 2 x 2: docs/knobs.md).

After the exchange a matrix another replica orthogonalises has a zero grad here (as an
outer piece of HFSDP): the global-norm clip counts each matrix on its replica
(``is_firstly_shared``), the rest of the buffer on outer rank 0 as before. Decided by
the layout and the optimizer's shares alone, so every rank of an outer group takes the
same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import paddle

from ..comm import collectives as comm

if TYPE_CHECKING:
    from .param import ShardedParam

# a buffer/ShardBuffer (which imports this module: named, not imported, to keep the
# engine's modules acyclic)
ShardBuffer = Any


@dataclass
class PackedOwned:
    """A buffer's part in the packed exchange: ``prefix`` elements of its grad shard go
    through the buffer's own outer all-reduce, ``matrices`` (after it, in layout order,
    with the outer rank that orthogonalises each) through the exchange."""

    prefix: int
    matrices: list[tuple[ShardedParam, int]] = field(default_factory=list)
    owed: bool = False  # the prefix was all-reduced, the matrices not exchanged yet


def plan(buffers: list[ShardBuffer], replicas: dict[str, int]) -> None:
    """Mark ``buffers`` (unit order) for the packed exchange; ``replicas``: ``{shard
    name: outer rank}`` of the shared matrices (the optimizer's fixed choice). A buffer
    takes part where its grads stay on the device in their own storage and travel
    uncompressed, with one replica's copy of the whole shard (no outer sub-shards)."""
    for buf in buffers:
        if buf.pieces.packed is not None or buf.parts != 1 or buf.host is not None or \
                buf.grads.main_grads or buf.pieces.compresses or not buf.trainable:
            continue
        held = [sp for sp in buf.params if sp.inner_numel]
        shared = [sp for sp in held if sp.shard.name in replicas and sp.inner_numel == sp.numel]
        prefix = max((sp.slot.inner_offset + sp.inner_numel for sp in held
                      if all(sp is not s for s in shared)), default=0)
        packed = [(sp, replicas[sp.shard.name]) for sp in
                  sorted(shared, key=lambda sp: sp.slot.inner_offset)
                  if sp.slot.inner_offset >= prefix]
        if not packed:
            continue
        buf.pieces.packed = PackedOwned(prefix, packed)
        for sp, replica in packed:  # the clip counts each matrix on its replica only
            sp.shard.is_firstly_shared = replica == buf.outer.rank


def all_reduced_part(buf: ShardBuffer, flat: paddle.Tensor) -> paddle.Tensor:
    """What of ``flat`` (the grad shard) the buffer's outer all-reduce sends."""
    packed = buf.pieces.packed
    return flat if packed is None else flat[:packed.prefix]


def landed(buf: ShardBuffer, flat: paddle.Tensor, scale: float) -> None:
    """The all-reduce of :func:`all_reduced_part` landed: the matrices after it are
    scaled alike (the exchange sums them as they are) and owed the exchange."""
    packed = buf.pieces.packed
    if packed is not None:
        flat[packed.prefix:].scale_(scale)
        packed.owed = True


def summed_again(buf: ShardBuffer, packed: PackedOwned, flat: paddle.Tensor,
                 scale: float) -> None:
    """``unsync`` of a packed buffer: the all-reduced part times ``scale`` (N / O: every
    replica holds it), the matrices times N (exchanged: their replica holds the sum and
    the others zero; not yet: each holds its own grad / N)."""
    flat[:packed.prefix].scale_(scale)
    flat[packed.prefix:].scale_(scale * buf.outer.nranks)
    packed.owed = False


def exchange(buffers: list[ShardBuffer]) -> None:
    """The packed reduce-scatter of every buffer of ``buffers`` owed one: one per outer
    group and reduce dtype, in one order on every rank (buffers in unit order)."""
    groups: dict[tuple[int, str], list[tuple[ShardBuffer, PackedOwned]]] = {}
    for buf in sorted(buffers, key=lambda b: (b.unit_index, b.index)):
        packed = buf.pieces.packed
        if packed is not None and packed.owed:
            groups.setdefault(_key(buf), []).append((buf, packed))
    for key in sorted(groups):
        _exchange(groups[key])


def _key(buf: ShardBuffer) -> tuple[int, str]:
    return buf.outer.id, str(buf.grads.reduce_dtype())


def _exchange(buffers: list[tuple[ShardBuffer, PackedOwned]]) -> None:
    """One reduce-scatter over the buffers' outer group: replica r's slice is the
    packed grads of the matrices it orthogonalises (all its buffers'), summed; the
    other matrices' grads here become zero."""
    group, dtype = buffers[0][0].outer, buffers[0][0].grads.reduce_dtype()
    n, me = group.nranks, group.rank
    views = [(buf.grads.acc_flat(), sp, replica) for buf, packed in buffers
             for sp, replica in packed.matrices]
    # each replica's matrices in view order, found in one pass (not a pass per replica:
    # the outer degree times the matrices, every step)
    held: list[list[tuple[paddle.Tensor, Any]]] = [[] for _ in range(n)]
    for flat, sp, replica in views:
        held[replica].append((flat, sp))
    sizes = [sum(sp.inner_numel for _, sp in its) for its in held]
    width = max(sizes)
    parts = []
    for its, size in zip(held, sizes, strict=True):
        parts += [_view(flat, sp).astype(dtype) for flat, sp in its]
        parts.append(paddle.zeros([width - size], dtype=dtype))
    send = paddle.concat(parts)
    mine = paddle.empty([width], dtype=dtype)
    comm.reduce_scatter(mine, send, group, what=f"{len(views)} whole matrices' grads, "
                        "packed for the replicas that orthogonalise them")
    start = 0
    for flat, sp, replica in views:
        view = _view(flat, sp)
        if replica == me:
            paddle.assign(mine[start:start + sp.inner_numel].astype(view.dtype), output=view)
            start += sp.inner_numel
        else:
            paddle.assign(paddle.zeros_like(view), output=view)
    for _, packed in buffers:
        packed.owed = False


def _view(flat: paddle.Tensor, sp: ShardedParam) -> paddle.Tensor:
    return flat[sp.slot.inner_offset:sp.slot.inner_offset + sp.inner_numel]

