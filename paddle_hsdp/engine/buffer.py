"""A fused buffer: the parameters of one unit that travel in one collective.

Parameters are grouped by what must agree inside one collective: dtype, trainable or
frozen, dense or expert (expert buffers use the expert groups).  Optimizer attributes
need not agree, because the optimizer sees per-parameter shards (see
:mod:`~paddle_hsdp.engine.param`).

This rank's shard of the buffer is the concatenation of its block of every parameter,
``S`` elements; the all-gather output is ``[I, S]`` row-major (rank ``i``'s shard in row
``i``), and the reduce-scatter input is built in the same layout.

With outer sub-shards (``fsdp_outer_sharding="optim"``, HFSDP; see [Note: outer
sub-shards] in :mod:`~paddle_hsdp.engine.param`) the shard is ``Q`` pieces of ``S / Q``
elements, piece ``q`` the concatenation of every parameter's sub-block ``q``; outer
rank ``q``'s optimizer sees piece ``q``. The step's outer all-reduce becomes an outer
reduce-scatter of the grad shard (this rank keeps its piece), and after the update an
outer all-gather of the pieces rebuilds the shard (:mod:`~paddle_hsdp.engine.outer_pieces`),
waited before anything reads the shard again.
"""

from __future__ import annotations

import contextlib

import paddle
from paddle import _C_ops

from ..comm import collectives as comm
from ..comm import gather_tags
from ..topology.cost import BufferShape
from . import master_grad, offload, staging, trace
from .dtypes import as_dtype, dtypes_of, element_size
from .outer_pieces import OuterPieces
from .shard_grads import ShardGrads
from .param import ShardedParam
from .pending import PendingGather, PendingRebuild, PendingReduce, give_back, release_staging
from .registry import registry
from .states import GradState, RebuildState, expect

# A mismatched all-gather's message names the peer's buffer and the units that ran
# through the registry.
gather_tags.set_buffer_describer(registry.describe_buffer)
gather_tags.set_unit_describer(registry.describe_unit)


class ShardBuffer(ShardGrads, OuterPieces):
    """``mp_policy`` (a ``MixedPrecisionPolicy`` or None): the all-gather and compute run
    in ``param_dtype`` and grads are reduced in ``reduce_dtype``; shards, their grads and
    the optimizer stay in the parameters' own dtype (the float32 master copy).
    ``offload_policy`` (``CPUOffloadPolicy``): shards and grads in host memory.
    Under Paddle's ``MixPrecisionLayer`` reduced grads accumulate in the shards' float32
    ``main_grad`` instead of ``.grad`` (see :mod:`~paddle_hsdp.engine.master_grad`)."""

    def __init__(self, params: list[ShardedParam], inner_group, outer_group, is_expert: bool,
                 mp_policy=None, offload_policy=None, reduce_group=None):
        self.params = params
        self.inner = inner_group
        # the inner group's ranks; on NCCL a twin group with its own stream, so a
        # reduce-scatter does not queue the next all-gather behind it
        self.reduce_group = reduce_group if reduce_group is not None else inner_group
        self.outer = outer_group
        self.is_expert = is_expert
        self.dtype = params[0].dtype
        self.trainable = params[0].trainable
        self.gather_dtype, self.reduce_dtype, self.compute_dtype = dtypes_of(self.dtype,
                                                                             mp_policy)
        self.policy_reduce_dtype = as_dtype(getattr(mp_policy, "reduce_dtype", None))
        # CPUOffloadPolicy on a device build: shards, their grads (and so the optimizer
        # state) live in host storage; collectives and compute run on the device.
        self.host = (offload.HostStorage(getattr(offload_policy, "pin_memory", False))
                     if offload.enabled(offload_policy) else None)
        # outer sub-shards: every param of a buffer is cut into the same parts
        self.parts, self.part = params[0].parts, params[0].part
        if any((sp.parts, sp.part) != (self.parts, self.part) for sp in params) or \
                self.parts not in (1, outer_group.nranks):
            raise AssertionError(f"{params[0].fqn}: parameters of one buffer disagree on "
                                 "their outer sub-shards")
        offset = 0
        for sp in params:
            sp.offset = offset
            sp.buffer = self
            offset += sp.sub_numel
        self.piece_numel = offset
        for sp in params:
            sp.piece_numel = offset
        self.shard_numel = offset * self.parts
        self.inner_size = inner_group.nranks
        # Fixed per buffer; every unshard/reshard reads them for the memory report.
        self.element_size = element_size(self.dtype)
        self.compute_element_size = element_size(self.compute_dtype)
        self.compute_nbytes = sum(sp.numel for sp in params) * self.compute_element_size
        # Set by the unit: which unit this buffer belongs to, for tags and messages.
        self.unit_index, self.index, self.owner = 0, 0, None
        # Storage: the flat shard (plus the tag's slots; shard params are views of it)
        # and, once grads arrive, the flat grad (shard grads are views of it).
        self._flat = None
        self.flat_grad = None
        self.flat_main_grad = None  # MixPrecisionLayer's float32 main grads (views of it)
        # the registry.storage_epoch at which views / grads / main grads were checked
        self._views_epoch = self._grads_epoch = self._main_grads_epoch = -1
        # id(ShardedParam) of shard grads to make views again, their value kept in the
        # flat storage (add_to_grad)
        self._repoint: set[int] = set()
        # Early reduction (a unit whose post-backward does not fire, e.g. the root):
        # the params whose grad this backward is complete, by id, and whether the
        # buffer was reduced before the end of backward (reset there).
        self.grads_ready: set[int] = set()
        self.reduced_early = False
        # the grad shard within the step (engine/states.py); what it was before the
        # reduce-scatter in flight, for a backward that abandons it
        self.grad_state = GradState.EMPTY
        self._before_reduce = GradState.EMPTY
        # Outer sub-shards: the post-step all-gather in flight, a rebuild owed before
        # the next read (sharded_state_dict handed out views a load may write), and
        # whether the grad shard holds only this rank's reduced piece (others zero).
        self._rebuild: PendingRebuild | None = None
        self.rebuild_state = RebuildState.CURRENT
        self.grads_scattered = False
        # [Note: edits under outer sub-shards]: the shards' inplace versions when the
        # last rebuild was issued, an edit seen by set_value / copy_, and the
        # registry.storage_epoch at which the versions were last compared.
        self._versions: list[int] = []
        self.edited = False
        self._edits_epoch = -1

    @property
    def flat(self):
        """The flat shard (plus the tag's slots). Reading it first waits for a post-step
        outer all-gather in flight (one already issued on every rank: no new collective)."""
        if self.rebuild_state is RebuildState.REBUILDING:
            self.finish_rebuild()
        return self._flat

    @flat.setter
    def flat(self, value) -> None:
        self._flat = value

    # -------------------------------------------------------------- placement
    @property
    def offload(self) -> bool:
        return self.host is not None

    def on_host(self):
        """Ops on this buffer's storage: on the host when it is offloaded."""
        return offload.on_host() if self.host is not None else contextlib.nullcontext()

    def _new_storage(self, dtype) -> paddle.Tensor:
        if self.host is not None:
            return self.host.zeros(self.shard_numel, dtype)
        return paddle.zeros([self.shard_numel], dtype)

    # -------------------------------------------------------------- sizes
    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer, padding included (``I * S``)."""
        return self.inner_size * self.shard_numel

    @property
    def logical_numel(self) -> int:
        return sum(sp.numel for sp in self.params)

    def shape(self):
        """This buffer's sizes for :mod:`paddle_hsdp.topology.cost`."""
        return BufferShape(
            shard_numel=self.shard_numel, logical_numel=self.logical_numel,
            inner=self.inner.nranks, outer=self.outer.nranks,
            master_bytes=self.element_size, gather_bytes=element_size(self.gather_dtype),
            reduce_bytes=element_size(self.grad_reduce_dtype()),
            compute_bytes=self.compute_element_size, trainable=self.trainable,
            inner_label=comm.group_label(self.inner), outer_label=comm.group_label(self.outer),
            outer_parts=self.parts)

    # -------------------------------------------------------------- storage
    def _views_of(self, flat) -> None:
        """Make every shard param a view of its chunk of ``flat`` (the buffer's storage)."""
        self.flat = flat
        for sp in self.params:
            sp.attach_shard(flat)
        self._views_epoch = registry.storage_epoch

    def _repair_views(self) -> None:
        """Shard params are views of ``self.flat``; a call that gave one new storage
        (anything but Paddle's in-place ops) would leave ``flat`` stale: copy its value
        back in and share again (an edit: [Note: edits under outer sub-shards]). One
        pointer comparison per param, once per ``registry.storage_epoch`` (not on every
        all-gather of a forward and backward)."""
        if self._views_epoch == registry.storage_epoch:
            return
        self._views_epoch = registry.storage_epoch
        for sp in self.params:
            if not sp.shard_is_view_of(self.flat):
                paddle.assign(sp.shard.detach().reshape([-1]), output=sp.piece_of(self.flat))
                sp.attach_shard(self.flat)
                self.edited = True

    # -------------------------------------------------------------- sharding
    def shard_from_full(self, src_outer_rank: int) -> None:
        """Cut this rank's blocks out of the local full params into one flat shard
        (plus the all-gather tag's slots), make outer replicas identical (broadcast from
        outer rank ``src_outer_rank``), and make the shard params views of it."""
        rank = self.inner.rank
        blocks = []
        for sp in self.params:
            # A param built under paddle.LazyGuard() has no data yet: materialise it
            # alone, keep this rank's block, free it; no rank ever holds the full model.
            if not sp.full._is_initialized():
                sp.full.initialize()
            blocks.append(sp.rank_block(sp.full.detach(), rank).clone())
            sp.free_full_data()
        if self.parts > 1:  # piece-major: every param's sub-block q makes piece q
            blocks = [paddle.concat([b.reshape([self.parts, sp.sub_numel]) for b, sp in
                                     zip(blocks, self.params)], axis=1).reshape([-1])]
        blocks.append(paddle.zeros([gather_tags.TAG_NUMEL], self.dtype))
        flat = paddle.concat(blocks)
        comm.broadcast(flat, src=self.outer.ranks[src_outer_rank], group=self.outer,
                       what=self.describe)
        for sp in self.params:
            sp.make_shard_param()
            if self.outer.rank != 0 and self.parts == 1:
                # a replica: global-norm clip skips it (with outer sub-shards every
                # rank's sub-block is distinct, and every rank counts its own)
                sp.shard.is_firstly_shared = False
        self._views_of(self.host.keep(flat) if self.host is not None else flat)
        # every replica holds every piece now: a rebuild is owed only after an edit
        self._versions = [sp.shard._inplace_version() for sp in self.params]

    def describe(self) -> str:
        """Which unit and buffer this is, for error messages."""
        first = self.params[0].fqn + (", ..." if len(self.params) > 1 else "")
        owner = self.owner.label if self.owner is not None else f"unit {self.unit_index}"
        return f"{owner}, buffer {self.index} ({first})"

    def gather_full(self, grads: bool = False, compute: bool = False) -> list[paddle.Tensor]:
        """All-gather in the inner group and wait; return each parameter's full tensor
        (see :meth:`start_gather`)."""
        registry.storage_may_have_changed()  # off the hot path: user code ran before
        return self.finish_gather(self.start_gather(grads, compute))

    def start_gather(self, grads: bool = False, compute: bool = False,
                     async_op: bool = False) -> "PendingGather":
        """Issue the all-gather of this rank's shard (or, with ``grads=True``, of its
        grad shard as it is now). ``compute=True``: gather in the policy's
        ``param_dtype``. With ``async_op`` it returns at once on NCCL (the collective runs
        on the communication stream); :meth:`finish_gather` waits.

        The flat shard is sent as it is (cast once when the gather dtype differs), with
        a few tag elements in its trailing slots (see :mod:`paddle_hsdp.comm.gather_tags`):
        ranks that pair up different all-gathers raise instead of computing on each other's rows."""
        purpose = "grads" if grads else ("compute" if compute else "params")
        staged = []  # tensors from the staging pool, given back after the wait
        if grads:
            acc = self.acc_flat()  # float32 main grads travel as they are
            if self.grads_scattered:  # each outer rank holds its reduced piece only
                acc = self._outer_gather(acc, what="the synced grad pieces")
            base = acc.dtype
            with self.on_host():
                send = paddle.concat([acc, paddle.zeros([gather_tags.TAG_NUMEL], base)])
        else:
            self.ensure_rebuilt()
            self._repair_views()
            send, base = self.flat, self.dtype
        dtype = self.gather_dtype if compute else base
        try:
            if send.dtype != dtype:
                send = self._cast_for_sending(send, dtype, staged)
            if self.host is not None:
                send = self.host.upload(send)  # a device copy; the host shard stays as is
            tag = None
            if gather_tags.can_tag(base) and gather_tags.can_tag(dtype):
                # written last, where the collective reads it: a view of a table
                # already in this dtype on this place, so no copy from the host per call
                tag = gather_tags.make_tag(self.inner, self.unit_index, self.index,
                                            purpose, self.describe, dtype, send.place)
                tail = send[self.shard_numel:self.shard_numel + gather_tags.TAG_NUMEL]
                paddle.assign(tag, output=tail)
            row = self.shard_numel + gather_tags.TAG_NUMEL
            out = staging.pool.take(self.inner_size * row, dtype)
            staged.append(out)
            trace.record("issue", "all_gather", self.unit_index)
            handle = comm.all_gather_into(out, send, self.inner, async_op=True,
                                          what=self.describe)
        except BaseException:
            give_back(staged)  # nothing was issued (or the issue failed): not in flight
            raise
        if not async_op:
            handle.wait()
        # send and out stay referenced until the wait: an async collective reads and
        # writes them on the communication stream.
        return PendingGather(handle, send, out, tag, compute, tuple(staged))

    def _cast_for_sending(self, send, dtype, staged: list) -> paddle.Tensor:
        """``send`` in ``dtype``: cast into a staging tensor (Paddle 3.3's public cast
        has no output argument; ``_C_ops.cast`` does). Offloaded: cast on the host (fewer
        bytes to copy), into a new tensor the upload reads on its own terms."""
        if self.host is not None:
            with self.on_host():
                return send.astype(dtype)
        into = staging.pool.take(comm.numel_of(send), dtype)
        staged.append(into)
        _C_ops.cast(send, dtype, out=into)
        return into

    def finish_gather(self, pending: "PendingGather") -> list[paddle.Tensor]:
        """Wait for :meth:`start_gather`, check the tags, and copy each parameter's
        full tensor out of the gathered grid (the one copy per parameter)."""
        pending.handle.wait()
        trace.record("wait", "all_gather", self.unit_index)
        out = pending.out
        row = self.shard_numel + gather_tags.TAG_NUMEL
        grid = out.reshape([self.inner_size, row])
        sizes = [sp.sub_numel for _ in range(self.parts) for sp in self.params]
        parts = paddle.split(grid, sizes + [gather_tags.TAG_NUMEL], axis=1)
        tags = parts.pop()
        if self.parts > 1:  # each param's sub-blocks of every piece, side by side
            n = len(self.params)
            parts = [paddle.concat(parts[j::n], axis=1) for j in range(n)]
        if pending.tag is not None:
            gather_tags.check(tags, pending.tag, self.inner)  # same dtype and place
        if pending.compute and self.compute_dtype != out.dtype:
            parts = [p.astype(self.compute_dtype) for p in parts]
        # the copy-out and the tag check are issued: the grid (and the send copy) can
        # serve the next collective (engine/staging.py says why that is safe on NCCL)
        release_staging(pending)
        return [sp.from_rank_blocks(part) for sp, part in zip(self.params, parts)]

    # -------------------------------------------------------------- gradients
    def start_reduce_scatter(self, async_op: bool = False) -> "PendingReduce":
        """Issue the inner reduce-scatter of the full grads and release them.

        The reduce-scatter input is written once: one concatenation of every grad seen
        as ``[I, chunk]`` rank blocks (a view of the grad, except for parameters whose
        rows need padding), so the full grads can be freed as soon as it is issued. A parameter with no grad on
        this rank (unused) contributes zeros: every rank joins the collective whatever
        its data did. :meth:`finish_reduce_scatter` waits and accumulates.
        """
        expect(self.grad_state, (GradState.EMPTY, GradState.REDUCED), "start_reduce_scatter",
               self.describe)  # synced grads go back to summed form first (the unit)
        trace.record("ready", "reduce_scatter", self.unit_index)  # full grads complete
        blocks = []
        dtype = self.grad_reduce_dtype()
        # with parts, [I, parts, sub-block]: concatenated on the last axis, every inner
        # rank's row is its flat shard, piece-major
        grid_of = ((lambda b, sp: b) if self.parts == 1 else
                   (lambda b, sp: b.reshape([sp.inner_size, self.parts, sp.sub_numel])))
        present = []  # per param: a grad on this rank (untouched params: optimizers.py)
        for sp in self.params:
            g = master_grad.full_grad(sp)  # .grad, or the hook's main_grad (see there)
            present.append(g is not None)
            if g is None:  # unused on this rank: zeros, so every rank joins the call
                blocks.append(grid_of(paddle.zeros([sp.inner_size, sp.chunk_numel], dtype),
                                      sp))
                continue
            if g.dtype != dtype:
                g = g.astype(dtype)
            blocks.append(grid_of(sp.as_rank_blocks(g), sp))  # a view unless padded
            master_grad.release_full_grad(sp)
        staged = []
        try:
            # one param: its own grad storage is the input (released above, kept alive
            # here); more: one concatenation into a staging grid
            grid = self._reduce_input(blocks, dtype, staged) if len(blocks) > 1 else blocks[0]
            del blocks  # the full grads' storage goes now, before the collective runs
            out = staging.pool.take(self.shard_numel, dtype) if self.host is None else \
                paddle.empty([self.shard_numel], dtype=dtype)
            if self.host is None:
                staged.append(out)
            trace.record("issue", "reduce_scatter", self.unit_index)
            handle = comm.reduce_scatter(out, grid.reshape([-1]), self.reduce_group,
                                         async_op=True, what=self.describe)
        except BaseException:
            give_back(staged)  # nothing was issued (or the issue failed)
            raise
        self._before_reduce, self.grad_state = self.grad_state, GradState.REDUCING
        if not async_op:
            handle.wait()
        return PendingReduce(handle, grid, out, tuple(staged), tuple(present))

    def abandon_reduce(self) -> None:
        """The reduce-scatter in flight was waited for without using it (a failed
        backward): the grad shard is as before it."""
        if self.grad_state is GradState.REDUCING:
            self.grad_state = self._before_reduce

    def _reduce_input(self, blocks, dtype, staged: list) -> paddle.Tensor:
        """The ``[I, S]`` reduce-scatter input (``[I, parts, S / parts]`` with outer
        sub-shards): ``blocks`` concatenated on their last axis into a staging grid of
        the all-gather grid's size (so the two share the pool's tensors)."""
        if self.host is not None:
            return paddle.concat(blocks, axis=-1)
        row = self.shard_numel + gather_tags.TAG_NUMEL
        base = staging.pool.take(self.inner_size * row, dtype)
        staged.append(base)
        shape = [self.inner_size, self.shard_numel] if self.parts == 1 else \
            [self.inner_size, self.parts, self.piece_numel]
        grid = base[0:self.inner_size * self.shard_numel].reshape(shape)
        return paddle.concat(blocks, axis=-1, out=grid)

    def finish_reduce_scatter(self, pending: "PendingReduce") -> None:
        """Wait for :meth:`start_reduce_scatter`; add the result to the grad shard
        (one op, in the master dtype), or to the main grads under MixPrecisionLayer."""
        expect(self.grad_state, (GradState.REDUCING,), "finish_reduce_scatter", self.describe)
        pending.handle.wait()
        trace.record("wait", "reduce_scatter", self.unit_index)
        acc = self.acc_flat()  # (a released grad's flags reset here, before the new ones)
        for sp, had in zip(self.params, pending.present):
            sp.grad_here = sp.grad_here or had
        out = pending.out
        self.grads_scattered = False  # (after a sync: the unit rescaled it, see there)
        self.grad_state = GradState.REDUCED
        if self.host is not None:  # added on the host once the copy is in
            self.host.download(out, into=acc, add=True)
            release_staging(pending)  # the grid (the download reads out, not pooled)
            return
        if out.dtype != acc.dtype:
            out = out.astype(acc.dtype)
        acc.add_(out)
        release_staging(pending)  # the add is issued: grid and out serve the next call

    def read_block(self, sp: ShardedParam) -> paddle.Tensor:
        """``sp``'s inner block ``[rows_per_rank, ...]`` from the flat shard (its pieces
        joined; a view with one part)."""
        self.ensure_rebuilt()
        self._repair_views()
        pieces = sp.pieces_of(self._flat)
        with self.on_host():
            block = pieces[0] if len(pieces) == 1 else paddle.concat(pieces)
            return block.reshape([sp.rows_per_rank] + sp.rest)

    def write_block(self, sp: ShardedParam, block) -> None:
        """Write ``sp``'s inner block (``[chunk_numel]`` elements, padding rows zero)
        into every piece of the flat shard: a full load needs no outer collective."""
        self.finish_rebuild()  # a late all-gather would overwrite what is written here
        self._repair_views()
        if self.host is not None:
            block = self.host.keep(block)  # host storage: CPU kernels only
        with self.on_host():
            block = block.reshape([sp.parts, sp.sub_numel]).astype(self.dtype)
            for q, piece in enumerate(sp.pieces_of(self._flat)):
                paddle.assign(block[q], output=piece)
