"""What this rank holds of a checkpoint: one item per tensor (or its block), read from
the engine's one statement of it (:func:`paddle_hsdp.engine.holdings.layout_of`):
model parameters and buffers under their saved names, the optimizer's states of each as
``NAME/optim/STATE``.

An item is a box of the full (logical) tensor (checkpoint/boxes.py): a sharded
parameter's inner block of rows of this rank's tensor-parallel slice, an unsharded
tensor's whole slice, the rows of its optimizer states the optimizer holds (with outer
sub-shards, ``fsdp_outer_sharding="optim"``, distinct on every rank), a scalar state
(a beta power) one element. Each item says which other ranks hold the same box (its
:class:`~paddle_hsdp.checkpoint.plan.Replicas`), from which checkpoint/plan.py decides
who writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..engine.holdings import Holdings, layout_of, tensor_parallel_slices
from ..hints import expect_layer, expect_optimizer
from .plan import Replicas
from .rules import Spot
from .tp_merge import check_merge_is_concat

if TYPE_CHECKING:
    import paddle
    from paddle.distributed.communication.group import Group

    from ..engine.holdings import HeldTensor

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


def item_of(held: HeldTensor) -> Item:
    """The checkpoint's item of one tensor the engine holds: an optimizer state under
    ``NAME/optim/STATE``; HFSDP's own optimizer rows outside a fault-tolerant job
    (a buffer whose parts no replica group shares) indexed by rule (a spot)."""
    name = held.name if held.state is None else f"{held.name}/optim/{held.state}"
    split = None if held.split is None else {"axis": held.split[0], "degree": held.split[1]}
    item = Item(name, held.full_shape, held.dtype, held.offset, held.size, held.read,
                held.write, split, held.tag, held.stage, Replicas(held.replicas))
    buf = held.buffer
    item.outer_group = None if buf is None else buf.outer_group
    item.piece = held.piece
    if buf is not None and held.piece is not None and held.layout_index is not None \
            and not buf.shared_pieces:
        item.spot = Spot(buf, held.layout_index, held.slice_offset)
    return item


def all_items(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer | None, call: str,
              trainable_only: bool = False) -> tuple[list[Item], Holdings]:
    """``(items, what the engine holds)`` of this rank, after the checks every rank
    makes alike (before any collective); ``trainable_only``: the frozen parameters
    (``stop_gradient``) left out."""
    expect_layer(model, f"{call}(path, model)")
    if optimizer is not None:
        expect_optimizer(optimizer, f"{call}(path, model, optimizer)")
    holdings = layout_of(model, optimizer, trainable_only)
    split = tensor_parallel_slices(holdings)
    if split:
        check_merge_is_concat(model, split, holdings.mp_degree)
    return [item_of(t) for t in holdings.tensors], holdings
