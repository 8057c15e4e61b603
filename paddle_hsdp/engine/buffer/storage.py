"""A buffer's storage: the flat shard every shard parameter is a view of, how it is cut
from the full parameters at the first sharding, and the reads and writes of one
parameter's rows (checkpoints). A shard parameter given new storage by user code is
copied back in and shared again (an edit: [Note: edits under outer sub-shards] in
:mod:`.outer_pieces`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle

from ...comm import collectives as comm
from ..param import ShardedParam
from ..registry import registry
from ..states import RebuildState

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


def _materialise(sp: ShardedParam) -> None:
    """A param built under ``paddle.LazyGuard()`` has no data yet: it gets it now, alone,
    and is freed once cut, so no rank ever holds more than one unit's full params."""
    if not sp.full._is_initialized() and sp.numel:
        sp.full.initialize()


class ShardStorage:
    """The flat shard of one :class:`~.shard_buffer.ShardBuffer`."""

    def __init__(self, buf: ShardBuffer):
        self.buf = buf
        self._flat: paddle.Tensor | None = None
        # the registry.storage_epoch at which the views were last checked
        self._views_epoch = -1

    @property
    def flat(self) -> paddle.Tensor:
        """The flat shard. Reading it first waits for a post-step outer all-gather in
        flight (one already issued on every rank: no new collective)."""
        if self.buf.pieces.rebuild_state is RebuildState.REBUILDING:
            self.buf.pieces.finish_rebuild()
        return self.raw

    @property
    def raw(self) -> paddle.Tensor:
        """The flat shard as it is (a rebuild in flight may still write it)."""
        if self._flat is None:
            raise RuntimeError(f"{self.buf.describe()}: read before it was sharded")
        return self._flat

    def new(self, dtype: paddle.dtype) -> paddle.Tensor:
        """A zeroed tensor of the shard's size where its storage lives (offloaded: the
        host)."""
        host = self.buf.host
        if host is not None:
            return host.zeros(self.buf.shard_numel, dtype)
        return paddle.zeros([self.buf.shard_numel], dtype)

    def adopt(self, flat: paddle.Tensor) -> None:
        """Make ``flat`` the storage and every shard param a view of its chunk."""
        self._flat = flat
        for sp in self.buf.params:
            sp.attach_shard(flat)
        self._views_epoch = registry.storage_epoch

    def repair_views(self) -> None:
        """Shard params are views of the flat shard; a call that gave one new storage
        (anything but Paddle's in-place ops) would leave the flat shard stale: copy its
        value back in and share again (an edit). One pointer comparison per param, once
        per ``registry.storage_epoch`` (not on every all-gather of a forward and
        backward)."""
        if self._views_epoch == registry.storage_epoch:
            return
        self._views_epoch = registry.storage_epoch
        flat = self.raw
        for sp in self.buf.params:
            if not sp.shard_is_view_of(flat):
                paddle.assign(sp.shard.detach().reshape([-1]), output=sp.piece_of(flat))
                sp.attach_shard(flat)
                self.buf.pieces.note_edit()

    def shard_from_full(self, src_outer_rank: int, sync: bool = True) -> None:
        """Cut this rank's rows into one flat shard, make outer replicas identical
        (broadcast from outer rank ``src_outer_rank``), and make the shard params views
        of it. ``sync``: the rows come from the inner group's first rank (one scatter:
        [Note: agreement at sharding] in :mod:`..agreement`), else from this rank's own
        full params (known to agree); parameters built under ``paddle.LazyGuard`` are
        scattered either way."""
        buf = self.buf
        flat = paddle.zeros([buf.shard_numel], buf.dtype)  # gaps and padding stay zero
        lazy = any(not sp.full._is_initialized() and sp.numel for sp in buf.params)
        if (sync or lazy) and buf.inner.nranks > 1:
            self._scatter_from_first(flat)
        else:
            self._cut_own_rows(flat)
        comm.broadcast(flat, src=buf.outer.ranks[src_outer_rank], group=buf.outer,
                       what=buf.describe)
        for sp in buf.params:
            sp.make_shard_param()
            if buf.outer.rank != 0 and buf.parts == 1:
                # a replica: global-norm clip skips it (with outer sub-shards every
                # rank's sub-block is distinct, and every rank counts its own)
                sp.shard.is_firstly_shared = False
        self.adopt(buf.host.keep(flat) if buf.host is not None else flat)
        # every replica holds every piece now: a rebuild is owed only after an edit
        buf.pieces.note_rebuilt()

    def _cut_own_rows(self, flat: paddle.Tensor) -> None:
        """This rank's rows of its own full params into ``flat``, each full param freed
        as soon as it is cut."""
        for sp in self.buf.params:
            _materialise(sp)
            sp.cut_into(sp.full.detach(), flat, sub=False)
            sp.free_full_data()

    def _scatter_from_first(self, flat: paddle.Tensor) -> None:
        """The inner group's first rank lays its full params out as the full flat
        buffer (rank ``i``'s flat shard is its ``i``-th chunk) and scatters it; the
        others only free theirs. Every rank materialises a lazy param as before (each
        generator advances alike, whichever rank is the source)."""
        buf = self.buf
        source = buf.inner.rank == 0
        full_flat = paddle.zeros([buf.padded_numel], buf.dtype) if source else None
        for sp in buf.params:
            _materialise(sp)
            if full_flat is not None and sp.numel:
                paddle.assign(sp.full.detach().reshape([-1]).astype(buf.dtype),
                              output=full_flat[sp.slot.full_offset:
                                               sp.slot.full_offset + sp.numel])
            sp.free_full_data()
        comm.scatter(flat, full_flat, src=buf.inner.ranks[0], group=buf.inner,
                     tag="agreement", what=buf.describe)

    def read_block(self, sp: ShardedParam) -> paddle.Tensor:
        """``sp``'s inner block ``[rows held, ...]`` of the flat shard (a view)."""
        self.buf.pieces.ensure_rebuilt()
        self.repair_views()
        first, count = sp.row_range(sub=False)
        if count == 0:
            return paddle.zeros([0] + sp.rest, dtype=self.buf.dtype)
        with self.buf.on_host():
            return sp.inner_block_of(self.raw).reshape([count] + sp.rest)

    def write_block(self, sp: ShardedParam, block: paddle.Tensor) -> None:
        """Write ``sp``'s inner block (its rows held) into the flat shard, every outer
        piece of it: a full load needs no outer collective."""
        buf = self.buf
        buf.pieces.finish_rebuild()  # a late all-gather would overwrite what is written
        self.repair_views()
        if sp.inner_numel == 0:
            return
        if buf.host is not None:
            block = buf.host.keep(block)  # host storage: CPU kernels only
        with buf.on_host():
            block = block.reshape([-1]).astype(buf.dtype)
            paddle.assign(block, output=sp.inner_block_of(self.raw))
