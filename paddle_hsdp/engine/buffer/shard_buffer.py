"""The buffer itself: what it is (its parameters, groups, layout, dtypes, where its
storage lives) and its parts, each of which owns one piece of its state (see the
package's docstring). The two collectives every step runs through a unit, the inner
all-gather and reduce-scatter, are its verbs (:mod:`.gather`, :mod:`.inner_reduce`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import paddle

from ...comm import collectives as comm
from ...comm.traits import traits_of
from ...topology.cost import BufferShape
from .. import offload
from ..dtypes import BufferDtypes, element_size
from ..layout import ALIGN, SegmentLayout, buffer_layout
from ..param import ShardedParam
from ..pending import PendingGather, PendingReduce
from ..registry import param_path
from . import gather, inner_reduce
from .full_grads import FullGrads
from .outer_pieces import OuterPieces
from .shard_grads import ShardGrads
from .storage import ShardStorage

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from ..unit import FSDPUnit


class ShardBuffer:
    """``mp_policy`` (a ``MixedPrecisionPolicy`` or None): the all-gather and compute run
    in ``param_dtype`` and grads are reduced in ``reduce_dtype``; shards, their grads and
    the optimizer stay in the parameters' own dtype (the float32 master copy).
    ``offload_policy`` (``CPUOffloadPolicy``): shards and grads in host memory.
    Under Paddle's ``MixPrecisionLayer`` reduced grads accumulate in the shards' float32
    ``main_grad`` instead of ``.grad`` (see :mod:`~paddle_hsdp.engine.master_grad`)."""

    def __init__(self, params: list[ShardedParam], inner_group: Group, outer_group: Group,
                 is_expert: bool, mp_policy: object | None = None,
                 offload_policy: object | None = None, reduce_group: Group | None = None,
                 owned: list[bool] | None = None, rotation: int = 0,
                 layout_degree: int | None = None):
        self.params = params
        self.inner = inner_group
        # the inner group's ranks; on NCCL a twin group with its own stream, so a
        # reduce-scatter does not queue the next all-gather behind it
        self.reduce_group = reduce_group if reduce_group is not None else inner_group
        self.outer = outer_group
        self.is_expert = is_expert
        self.trainable = params[0].trainable
        self.dtypes = BufferDtypes.of(params[0].dtype, mp_policy)
        # CPUOffloadPolicy on a device build: shards, their grads (and so the optimizer
        # state) live in host storage; collectives and compute run on the device.
        self.host = (offload.HostStorage(getattr(offload_policy, "pin_memory", False))
                     if offload.enabled(offload_policy) else None)
        # outer sub-shards: every param of a buffer is cut into the same parts, one per
        # outer rank, or shared by several replicas (the outer group's ``pieces``: a
        # fault-tolerant job's redundancy, ft/pieces.py)
        self.parts, self.part = params[0].parts, params[0].part
        self.shared_pieces = self.parts > 1 and traits_of(outer_group).pieces is not None
        if any((sp.parts, sp.part) != (self.parts, self.part) for sp in params) or \
                (self.parts not in (1, outer_group.nranks) and not self.shared_pieces):
            raise AssertionError(f"{param_path(params[0])}: parameters of one buffer disagree on "
                                 "their outer sub-shards")
        # owned: params kept inside one segment (paddle_hsdp.Owned); rotation turns which
        # segment a tie goes to, so identical units spread their heaviest segment
        self.rotation = rotation
        # laid out as a group of layout_degree ranks would (None: this group's size), so
        # groups of different sizes hold identical flat buffers ([Note: the layout degree])
        self.layout_degree = layout_degree
        self.layout = buffer_layout([sp.shape for sp in params], self.inner_size, self.parts,
                                    owned, rotation, layout_degree)
        if self.parts > 1 and owned is not None and any(owned):
            _refuse_owners_beyond_replication(params, self.layout, self.inner_size, self.parts,
                                              NOTHING_ALLOCATED)
        for index, sp in enumerate(params):
            sp.place(self.layout, index)
            sp.buffer = self
        # Set by the unit: which unit this buffer belongs to, for tags and messages.
        self.owner: FSDPUnit | None = None
        self.index = 0
        # its parts, each the owner of one piece of its state
        self.storage = ShardStorage(self)
        self.grads = ShardGrads(self)
        self.full_grads = FullGrads(self)
        self.pieces = OuterPieces(self, mp_policy)

    # -------------------------------------------------------------- a new layout
    def layout_with_owners(self, owned: list[bool], parts: int | None = None,
                           rotation: int | None = None) -> SegmentLayout:
        """This buffer's layout with ``owned[k]`` keeping parameter ``k`` in one segment,
        over ``parts`` outer sub-shards (default: its own), ties turned by ``rotation``
        (default: its own); ``ValueError`` where HFSDP's pieces would hold more than
        twice the buffer (asked at a whole-matrix optimizer's first step, before it
        updates anything)."""
        parts = self.parts if parts is None else parts
        layout = buffer_layout([sp.shape for sp in self.params], self.inner_size, parts, owned,
                               self.rotation if rotation is None else rotation,
                               self.layout_degree)
        if parts > 1 and any(owned):
            _refuse_owners_beyond_replication(self.params, layout, self.inner_size, parts,
                                              "Nothing was updated.")
        return layout

    def relayout(self, layout: SegmentLayout, fulls: list[paddle.Tensor],
                 grads: list[paddle.Tensor] | None, parts: int | None = None,
                 part: int = 0) -> None:
        """Lay the buffer out as ``layout`` (:meth:`layout_with_owners`) from every
        parameter's full value and (trainable) its full synced grad, which the caller
        gathered under the old layout (a whole-matrix optimizer's first step moves its
        matrices onto owners: engine/optimizers.py). Local: every rank cuts its own
        rows. ``parts``: cut the shard into that many outer sub-shards from now on
        (this rank's ``part``), as ``fsdp_outer_sharding="optim"`` would have: every
        outer rank then updates (and counts in the clip) its own piece. The shard
        parameters stay the same objects (the optimizer holds them), views of the new
        storage in their new shapes."""
        if parts is not None and parts != self.parts:
            self.parts, self.part = parts, part
            for sp in self.params:
                sp.parts, sp.part = parts, part
                if self.trainable:  # each outer rank's piece is distinct now
                    sp.shard.is_firstly_shared = True
        self.layout = layout
        for index, sp in enumerate(self.params):
            sp.place(layout, index)
        flat = paddle.zeros([self.shard_numel], self.dtype)  # gaps and padding stay zero
        for sp, full in zip(self.params, fulls, strict=True):
            sp.cut_into(full, flat, sub=False)
        self.storage.adopt(flat)
        self.pieces.note_rebuilt()  # every rank holds its whole inner block
        # the int8 outer sync's residual is laid out as the old shard: dropped (one
        # step's rounding, as on a checkpoint load; outer_compress.py)
        self.pieces.residual = None
        if grads is not None:
            self.grads.relay(grads)

    # -------------------------------------------------------------- identity
    @property
    def unit_index(self) -> int:
        """The owning unit's index (the global order of collectives; tags carry it)."""
        return self.owner.index if self.owner is not None else 0

    def describe(self) -> str:
        """Which unit and buffer this is, for error messages."""
        first = param_path(self.params[0]) + (", ..." if len(self.params) > 1 else "")
        owner = self.owner.label if self.owner is not None else f"unit {self.unit_index}"
        return f"{owner}, buffer {self.index} ({first})"

    # -------------------------------------------------------------- sizes
    @property
    def inner_size(self) -> int:
        return self.inner.nranks

    @property
    def piece_numel(self) -> int:
        """Elements of one outer part of the shard (a segment of the layout)."""
        return self.layout.segment_numel

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's flat shard (``S``: its pieces together)."""
        return self.layout.segment_numel * self.parts

    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer, padding included (``I * S``)."""
        return self.inner.nranks * self.shard_numel

    @property
    def logical_numel(self) -> int:
        return sum(sp.numel for sp in self.params)

    @property
    def compute_nbytes(self) -> int:
        """Bytes of the gathered buffer in the compute dtype (the memory report's)."""
        return self.padded_numel * self.dtypes.compute_size

    def shape(self) -> BufferShape:
        """This buffer's sizes for :mod:`paddle_hsdp.topology.cost`."""
        return BufferShape(
            shard_numel=self.shard_numel, logical_numel=self.logical_numel,
            inner=self.inner.nranks, outer=self.outer.nranks,
            master_bytes=self.dtypes.master_size,
            gather_bytes=element_size(self.dtypes.gather),
            reduce_bytes=element_size(self.grads.reduce_dtype()),
            compute_bytes=self.dtypes.compute_size, trainable=self.trainable,
            inner_label=comm.group_label(self.inner), outer_label=comm.group_label(self.outer),
            outer_parts=self.parts,
            outer_compress_block=self.pieces.compress_block if self.pieces.compress else 0,
            outer_compress=self.pieces.compress or "int8")

    # -------------------------------------------------------------- dtypes
    @property
    def dtype(self) -> paddle.dtype:
        """The parameters' own dtype: the shards', their grads' and the optimizer's."""
        return self.dtypes.master

    # -------------------------------------------------------------- placement
    @property
    def offload(self) -> bool:
        return self.host is not None

    def on_host(self) -> contextlib.AbstractContextManager:
        """Ops on this buffer's storage: on the host when it is offloaded."""
        return offload.on_host() if self.host is not None else contextlib.nullcontext()

    @property
    def scatters_outer(self) -> bool:
        """Whether the outer sync is a reduce-scatter (one piece per outer rank), not an
        all-reduce (no pieces, or shared ones: [Note: shared pieces] in
        :mod:`.outer_pieces`)."""
        return self.parts > 1 and not self.shared_pieces

    @property
    def rebuilds(self) -> bool:
        """Whether this buffer has outer sub-shards to rebuild (trainable, parts > 1)."""
        return self.parts > 1 and self.trainable

    # -------------------------------------------------------------- the step's verbs
    def gather_full(self, grads: bool = False, compute: bool = False) -> list[paddle.Tensor]:
        """All-gather in the inner group and wait: each parameter's full tensor."""
        return gather.gather_full(self, grads, compute)

    def start_gather(self, grads: bool = False, compute: bool = False,
                     async_op: bool = False) -> PendingGather:
        return gather.start(self, grads, compute, async_op)

    def finish_gather(self, pending: PendingGather) -> list[paddle.Tensor]:
        return gather.finish(self, pending)

    def start_reduce_scatter(self, async_op: bool = False) -> PendingReduce:
        return inner_reduce.start(self, async_op)

    def finish_reduce_scatter(self, pending: PendingReduce) -> None:
        inner_reduce.finish(self, pending)


# what a refusal while a buffer is built leaves behind
NOTHING_ALLOCATED = ("Nothing of this buffer was allocated; units sharded before it were, so "
                     "build the model again.")


def _refuse_owners_beyond_replication(params: list[ShardedParam], layout: SegmentLayout,
                                      inner: int, parts: int, aftermath: str) -> None:
    """With HFSDP's outer parts an owned matrix lies in one of ``inner * parts`` equal
    pieces, so each piece holds at least the largest one, and a rank's shard (its
    ``parts`` pieces) grows with the outer degree. Up to twice the whole buffer is
    allowed (a unit holding one matrix at 2 outer parts); past it owners cost more than
    twice ``Replicate()`` (at 8 x 1024, a Llama block would need ~1,000x it): refused
    here, on every rank alike (the layout is the same everywhere), before anything is
    allocated or updated; ``aftermath`` closes the message (what the user has left)."""
    shard = layout.segment_numel * parts
    whole = sum(sp.numel for sp in params)
    if shard <= 2 * whole + 2 * parts * ALIGN:  # (each start's alignment: tiny buffers)
        return
    largest = max((sp for k, sp in enumerate(params) if layout.owned[k]), key=lambda sp: sp.numel)
    raise ValueError(
        f"owned placements (shard_placement_fn=owned_matrices()) with "
        f"fsdp_outer_sharding='optim': each of the {inner} x {parts} (inner x outer) "
        f"pieces of this buffer must hold a whole owned matrix (the largest: "
        f"'{param_path(largest)}' {list(largest.shape)}), so each rank's shard would be {shard} "
        f"elements, more than twice the whole buffer ({whole}): worse than replicating "
        "it. Keep the owners in the inner group (fsdp_outer_sharding='none') or use fewer "
        f"outer parts. {aftermath}")
