"""The outer half of a buffer's step: the outer sync of the grad shard, and with outer
sub-shards (``fsdp_outer_sharding="optim"``, HFSDP) the pieces each replica's optimizer
sees and the rebuild of the shard from them (:class:`~..states.RebuildState`, and
the edits that make a rebuild owed). The outer sync moves the grad shard's state,
which :class:`~.shard_grads.ShardGrads` owns.

[Note: edits under outer sub-shards] A shard parameter is this rank's piece only, so an
in-place change of ``model.parameters()`` outside the optimizer (weight clipping, a
re-initialisation, an EMA swap, ``set_value``) changes one piece of the flat shard;
the others are other replicas' pieces, which their own ranks changed. The rebuild is
therefore not issued at the step but owed (``RebuildState.OWED``) and issued at the next
root forward (or the next read of the shard), so edits made in between travel with
it; and an edit made after that (between two forwards of one step) is detected at the
next root forward or read (the shard's inplace version, new storage, or a
``set_value`` / ``copy_`` call: patches/shard_edits.py) and makes one owed again.
Every rank must make the same edits, as with any call that leads to a collective.

[Note: shared pieces] In a fault-tolerant job (ft/pieces.py) each piece is held by
several replicas, and the outer group's traits say who (``traits_of(outer).pieces``, a
:class:`~paddle_hsdp.ft.pieces.PiecePlan`). The grad shard is then all-reduced whole
(a reduce-scatter would give each piece to one rank only), every piece stays in it
until ``clear_grad`` (the clip counts the whole shard), and the rebuild broadcasts
each piece from one holder the plan names. It is synchronous and stays owed until
every piece arrived, so a failed attempt rebuilds again; a piece this rank holds
itself arrives in scratch (a broadcast cut short must not corrupt what its optimizer
updates).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import paddle

from ...comm import collectives as comm
from ...comm.traits import traits_of
from .. import trace
from .. import owned_exchange
from . import outer_compress
from .outer_compress import PendingCompressed
from ..pending import PendingOuterReduce, PendingRebuild, PendingReduce
from ..registry import registry
from ..states import GradState, RebuildState, expect, move

if TYPE_CHECKING:
    from .shard_buffer import ShardBuffer


class OuterPieces:
    """The outer sync and the outer sub-shards of one :class:`~.shard_buffer.ShardBuffer`."""

    def __init__(self, buf: ShardBuffer, mp_policy: object | None = None):
        self.buf = buf
        # the compressed outer sync (outer_compress.py): "int8" or None, values per scale
        floating = buf.dtypes.master in (paddle.float32, paddle.float64, paddle.float16,
                                         paddle.bfloat16)
        self.compress: str | None = (getattr(mp_policy, "outer_compress", None) if floating
                                     else None)
        self.compress_block: int = getattr(mp_policy, "outer_compress_block", 0)
        # the post-step all-gather in flight, and whether the flat shard holds every
        # replica's latest piece (a rebuild is owed before the next read once
        # sharded_state_dict handed out views a load may write)
        self._rebuild: PendingRebuild | None = None
        self.rebuild_state = RebuildState.CURRENT
        # [Note: edits under outer sub-shards]: the shards' inplace versions when the
        # last rebuild was issued, an edit seen by set_value / copy_ or new storage,
        # and the registry.storage_epoch at which the versions were last compared.
        self._versions: list[int] = []
        self.edited = False
        self._edits_epoch = -1
        # the compressed outer sync's error feedback (outer_compress.py): float32, the
        # padded grad shard's size; None until the first compressed sync lands
        self.residual: paddle.Tensor | None = None
        # a whole-matrix optimizer's shared matrices, exchanged packed over the model
        # after this buffer's outer all-reduce (engine/owned_exchange.py); None: none
        self.packed: owned_exchange.PackedOwned | None = None

    def describe(self) -> str:
        return self.buf.describe()

    @property
    def compresses(self) -> bool:
        """Whether the outer sync travels compressed (``outer_compress``; over one
        replica there is nothing to send)."""
        buf = self.buf
        return self.compress is not None and buf.trainable and buf.outer.nranks > 1

    # -------------------------------------------------------------- the outer sync
    def start_outer_sync(self, async_op: bool = False, on_thread: bool = False
                         ) -> PendingReduce | PendingOuterReduce | PendingCompressed:
        """The step's one outer collective of the grad shard: the all-reduce, or with
        outer sub-shards the reduce-scatter (:meth:`start_outer_reduce`). ``on_thread``:
        on gloo, on the communication thread (engine/outer_sync.py)."""
        grads = self.buf.grads
        expect(grads.state, (GradState.EMPTY, GradState.REDUCED), "start_outer_sync",
               self.describe)
        pending = (self.start_outer_reduce(async_op, on_thread) if self.buf.scatters_outer
                   else self.start_all_reduce(async_op, on_thread))
        grads.move(GradState.SYNCING, "start_outer_sync")
        return pending

    def start_all_reduce(self, async_op: bool = False, on_thread: bool = False
                         ) -> PendingReduce | PendingCompressed:
        """Issue the outer all-reduce of the grad shard, in place (offloaded: of a
        device copy). It travels in ``reduce_dtype``, like the reduce-scatter: these
        are the bytes that cross machines, the ones a bf16 ``reduce_dtype`` halves.
        Under MixPrecisionLayer it reduces the main grads. Compressed
        (``outer_compress``): an all-gather of int8 codes instead (outer_compress.py)."""
        buf = self.buf
        flat = owned_exchange.all_reduced_part(buf, buf.grads.acc_flat())
        if not comm.numel_of(flat):  # every element here is a packed matrix's
            return PendingReduce(comm.Handle.completed(), flat, flat)
        # offloaded: a device copy to reduce (none for one replica: nothing to reduce)
        target = buf.host.upload(flat) if buf.host is not None and buf.outer.nranks > 1 \
            else flat
        if self.compresses:
            trace.record("issue", "all_reduce", buf.unit_index)
            return outer_compress.start(buf, target, flat, False, async_op, on_thread)
        dtype = buf.grads.reduce_dtype()
        if dtype != flat.dtype and buf.outer.nranks > 1:
            target = target.astype(dtype)
        trace.record("issue", "all_reduce", buf.unit_index)
        handle = comm.all_reduce(target, buf.outer, async_op=True, what=buf.describe,
                                 on_thread=on_thread)
        if not async_op:
            handle.wait()
        return PendingReduce(handle, target, flat)

    def finish_all_reduce(self, pending: PendingReduce | PendingCompressed,
                          scale: float) -> None:
        buf = self.buf
        pending.handle.wait()
        trace.record("wait", "all_reduce", buf.unit_index)
        trace.record_span("all_reduce", buf.unit_index, pending.handle.span())
        flat = pending.out
        if isinstance(pending, PendingCompressed):
            reduced = outer_compress.finish(buf, pending)  # float32, every replica's
        elif pending.grid is flat:
            with buf.on_host():
                flat.scale_(scale)
            return
        else:
            reduced = pending.grid  # a reduce_dtype or offloaded copy comes back
        if reduced.dtype != flat.dtype:
            reduced = reduced.astype(flat.dtype)
        reduced.scale_(scale)  # in the grads' dtype, as on the grads themselves
        if buf.host is not None:
            buf.host.download(reduced, into=flat, add=False)
        else:
            paddle.assign(reduced, output=flat)

    def finish_outer_sync(self, pending: PendingReduce | PendingOuterReduce | PendingCompressed,
                          scale: float) -> None:
        grads = self.buf.grads
        expect(grads.state, (GradState.SYNCING,), "finish_outer_sync", self.describe)
        if isinstance(pending, PendingOuterReduce) or (
                isinstance(pending, PendingCompressed) and pending.scatter):
            self.finish_outer_reduce(pending, scale)
        else:
            self.finish_all_reduce(pending, scale)
            owned_exchange.landed(self.buf, grads.acc_flat(), scale)
        grads.move(GradState.SYNCED, "finish_outer_sync")

    def sync_locally(self, scale: float) -> None:
        """``set_requires_all_reduce(False)``: no outer collective; the grad shard,
        scaled, is this replica's step."""
        grads = self.buf.grads
        expect(grads.state, (GradState.EMPTY, GradState.REDUCED), "sync_locally",
               self.describe)
        grads.scale(scale)
        grads.move(GradState.SYNCED, "sync_locally")

    def unsync(self, scale: float) -> None:
        """More grads are coming after the sync: bring the synced grad shard back to
        its summed form (``scale``: :meth:`FSDPUnit.summed_scale`), so the next sync's
        outer sum and 1 / N leave it unchanged."""
        grads = self.buf.grads
        expect(grads.state, (GradState.SYNCED,), "unsync", self.describe)
        if self.packed is not None:  # its shared matrices: held on one replica
            owned_exchange.summed_again(self.buf, self.packed, grads.acc_flat(), scale)
        else:
            grads.scale(scale)
        grads.move(GradState.REDUCED, "unsync")

    def start_outer_reduce(self, async_op: bool = False, on_thread: bool = False
                           ) -> PendingOuterReduce | PendingCompressed:
        """Issue the outer reduce-scatter of the accumulated grad shard (or main grads)
        in ``reduce_dtype``: the first half of an all-reduce, the same bytes across
        machines; this rank receives the sum of its piece."""
        buf = self.buf
        acc = buf.grads.acc_flat()
        send = buf.host.upload(acc) if buf.host is not None else acc  # offloaded: a copy
        if self.compresses:
            trace.record("issue", "outer_reduce_scatter", buf.unit_index)
            return outer_compress.start(buf, send, acc, True, async_op, on_thread)
        dtype = buf.grads.reduce_dtype()
        if dtype != acc.dtype:
            send = send.astype(dtype)
        out = paddle.empty([buf.piece_numel], dtype=dtype)
        trace.record("issue", "outer_reduce_scatter", buf.unit_index)
        # send is scratch on gloo (its other pieces are overwritten): they are zeroed
        # when the result lands, as the piece model needs anyway
        handle = comm.reduce_scatter(out, send, buf.outer, async_op=True, what=buf.describe,
                                     on_thread=on_thread)
        if not async_op:
            handle.wait()
        return PendingOuterReduce(handle, send, out, acc)

    def finish_outer_reduce(self, pending: PendingOuterReduce | PendingCompressed,
                            scale: float) -> None:
        """Wait for :meth:`start_outer_reduce`; this rank's piece of the grad shard
        becomes the scaled sum, every other piece zero (what the optimizer does not see
        must not carry into the next step's accumulation)."""
        buf = self.buf
        pending.handle.wait()
        trace.record("wait", "outer_reduce_scatter", buf.unit_index)
        trace.record_span("outer_reduce_scatter", buf.unit_index, pending.handle.span())
        if isinstance(pending, PendingCompressed):
            lo = buf.part * buf.piece_numel
            acc = pending.out
            reduced = outer_compress.finish(buf, pending, lo, lo + buf.piece_numel)
        else:
            acc, reduced = pending.acc, pending.out
        if reduced.dtype != acc.dtype:
            reduced = reduced.astype(acc.dtype)
        reduced.scale_(scale)  # in the grads' dtype, as on the grads themselves
        if buf.host is not None:  # assigned on the host when the copy is in
            buf.host.download(reduced, into=self.piece(acc, buf.part), add=False)
        else:
            paddle.assign(reduced, output=self.piece(acc, buf.part))
        self.zero_other_pieces(acc)
        buf.grads.mark_scattered(True)

    # -------------------------------------------------------------- pieces
    def piece(self, flat: paddle.Tensor, q: int) -> paddle.Tensor:
        """Piece ``q`` of a flat shard-layout tensor (a view)."""
        numel = self.buf.piece_numel
        return flat[q * numel:(q + 1) * numel]

    def zero_other_pieces(self, flat: paddle.Tensor) -> None:
        buf = self.buf
        with buf.on_host():
            for q in range(buf.parts):
                if q != buf.part:
                    piece = self.piece(flat, q)
                    paddle.assign(paddle.zeros_like(piece), output=piece)

    def drop_grad_pieces(self) -> None:
        """After ``clear_grad`` (the unit dropped pending downloads first): zero the grad
        pieces the optimizer does not see (its own it zeroed or released), so a skipped
        batch leaves nothing behind."""
        buf = self.buf
        if buf.parts == 1:
            return
        for flat in buf.grads.flats():
            self.zero_other_pieces(flat)
        buf.grads.mark_scattered(False)

    def outer_gather(self, flat: paddle.Tensor, what: str) -> paddle.Tensor:
        """Every rank's piece of ``flat`` gathered over the outer group (synchronous):
        a new tensor in shard layout, where ``flat`` lives (offloaded: the host)."""
        buf = self.buf
        mine = self.piece(flat, buf.part)
        send = buf.host.upload(mine) if buf.host is not None else mine.clone()
        out = paddle.empty([buf.shard_numel], dtype=flat.dtype)
        comm.all_gather_into(out, send, buf.outer, what=lambda: f"{buf.describe()}: {what}")
        return buf.host.keep(out) if buf.host is not None else out

    # -------------------------------------------------------------- the rebuild
    def owe_rebuild(self) -> None:
        """The optimizer updated this rank's piece: the rebuild is owed, issued at the
        next root forward or read ([Note: edits under outer sub-shards])."""
        if self.buf.rebuilds:
            self._mark_owed()

    def _mark_owed(self) -> None:
        self.finish_rebuild()  # one in flight lands first: it must not overwrite what follows
        move(self, "rebuild_state", RebuildState.OWED, "_mark_owed")

    def note_edit(self) -> None:
        """A shard param was changed other than in place (new storage, ``set_value``,
        ``copy_``): the next check owes a rebuild."""
        self.edited = True

    def note_rebuilt(self) -> None:
        """Every replica holds every piece as the shards are now: later edits are
        measured from here."""
        self.edited = False
        self._versions = [sp.shard._inplace_version() for sp in self.buf.params]

    def check_edits(self) -> None:
        """Whether a shard param changed since the last rebuild was issued (its
        inplace version, new storage, ``set_value`` / ``copy_``): if so a rebuild is
        owed. Once per ``registry.storage_epoch``; local, no collective."""
        buf = self.buf
        if not buf.rebuilds or self._edits_epoch == registry.storage_epoch:
            return
        self._edits_epoch = registry.storage_epoch
        buf.storage.repair_views()  # new storage is copied into the flat shard here
        if self.edited or [sp.shard._inplace_version() for sp in buf.params] != self._versions:
            self._mark_owed()

    def start_owed_rebuild(self, async_op: bool = False) -> None:
        """Issue the rebuild if one is owed (the root forward's start: every rank
        alike)."""
        self.finish_rebuild()
        self.check_edits()
        if self.rebuild_state is RebuildState.OWED:
            self.start_rebuild(async_op)

    def start_rebuild(self, async_op: bool = False) -> None:
        """Issue the outer all-gather of every replica's piece into the flat shard (in
        the parameters' own dtype, so every replica holds the same exact values). The
        next read of the flat shard waits for it; the next forward's first all-gather
        of the unit reads it."""
        buf = self.buf
        if not buf.rebuilds:
            return
        self.finish_rebuild()  # one in flight per buffer
        expect(self.rebuild_state, (RebuildState.CURRENT, RebuildState.OWED), "start_rebuild",
               self.describe)
        buf.storage.repair_views()
        if buf.shared_pieces:
            self._copy_pieces_from_holders()
            return
        flat = buf.storage.raw
        mine = self.piece(flat, buf.part)
        # offloaded: a device copy out, the gathered pieces copied back in at the wait
        send = buf.host.upload(mine) if buf.host is not None else mine.clone()
        out = (paddle.empty([buf.shard_numel], dtype=buf.dtype) if buf.host is not None
               else flat[0:buf.shard_numel])
        trace.record("issue", "outer_all_gather", buf.unit_index)
        handle = comm.all_gather_into(out, send, buf.outer, async_op=True,
                                      what=buf.describe)
        self._rebuild = PendingRebuild(handle, send, out)
        move(self, "rebuild_state", RebuildState.REBUILDING, "start_rebuild")
        self.note_rebuilt()
        if not async_op:
            self.finish_rebuild()

    def _copy_pieces_from_holders(self) -> None:
        """[Note: shared pieces]: one broadcast per piece, in piece order on every rank,
        from the holder the outer group's plan names; current only once all arrived."""
        buf = self.buf
        plan, flat = traits_of(buf.outer).pieces, buf.storage.raw
        if plan is None:
            raise AssertionError(f"{buf.describe()}: shared pieces without a plan")
        me = buf.outer.ranks[buf.outer.rank]
        for q in range(buf.parts):
            piece = self.piece(flat, q)
            src = plan.src(q)
            scratch = src != me and plan.keeps(q)
            target = paddle.empty_like(piece) if scratch else piece
            # offloaded: a device copy travels, copied back into the host storage
            moved = buf.host.upload(target) if buf.host is not None else target
            trace.record("issue", "outer_broadcast", buf.unit_index)
            comm.broadcast(moved, src=src, group=buf.outer,
                           what=functools.partial(_piece_label, buf, q))
            trace.record("wait", "outer_broadcast", buf.unit_index)
            if buf.host is not None and not scratch and src != me:
                buf.host.download(moved, into=piece, add=False)
        move(self, "rebuild_state", RebuildState.CURRENT, "_copy_pieces_from_holders")
        self.note_rebuilt()

    def finish_rebuild(self) -> None:
        if self.rebuild_state is not RebuildState.REBUILDING:
            return
        pending, self._rebuild = self._rebuild, None
        # waited for, even if the wait raises
        move(self, "rebuild_state", RebuildState.CURRENT, "finish_rebuild")
        if pending is None:
            raise AssertionError(f"{self.buf.describe()}: rebuilding with nothing in flight")
        pending.handle.wait()
        buf = self.buf
        trace.record("wait", "outer_all_gather", buf.unit_index)
        if buf.host is not None:
            gathered = buf.host.keep(pending.out)
            with buf.on_host():
                paddle.assign(gathered, output=buf.storage.raw[0:buf.shard_numel])

    def ensure_rebuilt(self) -> None:
        """Finish a rebuild in flight, or run one that is owed (edits included: a
        collective, so only from calls every rank makes alike: gathers, checkpoints)."""
        self.start_owed_rebuild()
        self.finish_rebuild()


def _piece_label(buf: ShardBuffer, q: int) -> str:
    return f"{buf.describe()}: piece {q}"
