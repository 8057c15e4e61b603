"""A fused buffer: the parameters of one unit that travel in one collective.

Parameters are grouped by what must agree inside one collective: dtype, trainable or
frozen, dense or expert (expert buffers use the expert groups).  Optimizer attributes
need not agree, because the optimizer sees per-parameter shards (see
:mod:`~paddle_hsdp.engine.param`).

The parameters lie in one full flat buffer of ``I * S`` elements and this rank's shard
is its ``S`` of them ([Note: the segment layout] in :mod:`~paddle_hsdp.engine.layout`):
the all-gather's output is the full buffer, every full parameter a view of it, and the
reduce-scatter's input is the full grads in the same layout (autograd adds them
there in place: :mod:`~paddle_hsdp.engine.full_grads`).

With outer sub-shards (``fsdp_outer_sharding="optim"``, HFSDP) the shard is ``Q`` pieces
of ``S / Q`` elements (segments of the layout); outer rank ``q``'s optimizer sees the
rows in piece ``q``. The step's outer all-reduce becomes an outer reduce-scatter of the
grad shard (this rank keeps its piece), and after the update an outer all-gather of the
pieces rebuilds the shard (:mod:`~paddle_hsdp.engine.outer_pieces`), waited before
anything reads the shard again.
"""

from __future__ import annotations

import contextlib

import paddle
from paddle import _C_ops

from ..comm import collectives as comm
from ..comm import gather_tags
from ..comm.traits import traits_of
from ..topology.cost import BufferShape
from . import master_grad, offload, staging, trace
from .dtypes import as_dtype, dtypes_of, element_size
from .layout import segment_layout
from .full_grads import FullGrads
from .outer_pieces import OuterPieces
from .shard_grads import ShardGrads
from .param import ShardedParam
from .pending import PendingGather, PendingRebuild, PendingReduce, give_back, release_staging
from .registry import registry
from .states import GradState, RebuildState, expect, move

# A mismatched all-gather's message names the peer's buffer and the units that ran
# through the registry.
gather_tags.set_buffer_describer(registry.describe_buffer)
gather_tags.set_unit_describer(registry.describe_unit)


class ShardBuffer(ShardGrads, FullGrads, OuterPieces):
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
        # outer sub-shards: every param of a buffer is cut into the same parts, one per
        # outer rank, or shared by several replicas (the outer group's ``pieces``: a
        # fault-tolerant job's redundancy, ft/pieces.py)
        self.parts, self.part = params[0].parts, params[0].part
        self.shared_pieces = self.parts > 1 and traits_of(outer_group).pieces is not None
        if any((sp.parts, sp.part) != (self.parts, self.part) for sp in params) or \
                (self.parts not in (1, outer_group.nranks) and not self.shared_pieces):
            raise AssertionError(f"{params[0].fqn}: parameters of one buffer disagree on "
                                 "their outer sub-shards")
        self.inner_size = inner_group.nranks
        self.layout = segment_layout([sp.shape for sp in params], self.inner_size * self.parts)
        for index, sp in enumerate(params):
            sp.place(self.layout, index)
            sp.buffer = self
        self.piece_numel = self.layout.segment_numel  # one outer part of the shard
        self.shard_numel = self.piece_numel * self.parts
        # Fixed per buffer; every unshard/reshard reads them for the memory report.
        self.element_size = element_size(self.dtype)
        self.compute_element_size = element_size(self.compute_dtype)
        self.compute_nbytes = self.padded_numel * self.compute_element_size  # gathered
        # Set by the unit: which unit this buffer belongs to, for tags and messages.
        self.unit_index, self.index, self.owner = 0, 0, None
        # Storage: the flat shard (shard params are views of it)
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
        """The flat shard. Reading it first waits for a post-step
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
        """Cut this rank's rows out of the local full params into one flat shard, make
        outer replicas identical (broadcast from outer rank ``src_outer_rank``), and
        make the shard params views of it."""
        flat = paddle.zeros([self.shard_numel], self.dtype)  # gaps and padding stay zero
        for sp in self.params:
            # A param built under paddle.LazyGuard() has no data yet: materialise it
            # alone, keep this rank's rows, free it; no rank ever holds the full model.
            if not sp.full._is_initialized() and sp.numel:
                sp.full.initialize()
            if sp.inner_numel:
                rows = sp.rows_of(sp.full.detach(), sub=False)
                paddle.assign(rows.reshape([-1]), output=sp.inner_block_of(flat))
            sp.free_full_data()
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
        grad shard as it is now) into a new full flat buffer. ``compute=True``: gather in
        the policy's ``param_dtype``. With ``async_op`` it returns at once on NCCL (the
        collective runs on the communication stream); :meth:`finish_gather` waits.

        The flat shard is sent as it is (cast once when the gather dtype differs). A
        short tag travels beside it in a second, tiny all-gather (see
        :mod:`paddle_hsdp.comm.gather_tags`): ranks that pair up different all-gathers
        raise instead of computing on each other's rows. It cannot ride in the shard's
        own slots as it once did: a parameter that straddles two ranks' segments must
        be contiguous in the output.

        The output is not from the staging pool: the full parameters are views of it
        for as long as the unit is unsharded, and a view autograd saved may outlive the
        reshard, so the storage must not serve another unit's gather meanwhile."""
        purpose = "grads" if grads else ("compute" if compute else "params")
        staged = []  # tensors from the staging pool, given back after the wait
        if grads:
            send = self.acc_flat()  # float32 main grads travel as they are
            if self.grads_scattered:  # each outer rank holds its reduced piece only
                send = self._outer_gather(send, what="the synced grad pieces")
            base = send.dtype
        else:
            self.ensure_rebuilt()
            self._repair_views()
            send, base = self.flat, self.dtype
        dtype = self.gather_dtype if compute else base
        tag = tags = tag_handle = None
        try:
            if send.dtype != dtype:
                send = self._cast_for_sending(send, dtype, staged)
            if self.host is not None:
                send = self.host.upload(send)  # a device copy; the host shard stays as is
            if gather_tags.can_tag(base) and gather_tags.can_tag(dtype):
                # a view of a table already in this dtype on this place: no copy per call
                tag = gather_tags.make_tag(self.inner, self.unit_index, self.index,
                                            purpose, self.describe, dtype, send.place)
                tags = staging.pool.take(self.inner_size * gather_tags.TAG_NUMEL, dtype)
                staged.append(tags)
                tag_handle = comm.all_gather_into(tags, tag, self.inner, async_op=True,
                                                  what=self.describe,
                                                  counted_as="all_gather_tags")
            out = paddle.empty([self.padded_numel], dtype=dtype)
            trace.record("issue", "all_gather", self.unit_index)
            handle = comm.all_gather_into(out, send, self.inner, async_op=True,
                                          what=self.describe)
        except BaseException:
            if tag_handle is not None:
                comm.settle([tag_handle])
            give_back(staged)  # nothing was issued (or the issue failed): not in flight
            raise
        if not async_op:
            handle.wait()
        # send and out stay referenced until the wait: an async collective reads and
        # writes them on the communication stream.
        return PendingGather(handle, send, out, tag, compute, tuple(staged), tag_handle, tags)

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
        """Wait for :meth:`start_gather`, check the tags, and return each parameter's
        full tensor: a view of the gathered buffer (cast once when the compute dtype
        differs from the gather dtype)."""
        pending.handle.wait()
        trace.record("wait", "all_gather", self.unit_index)
        if pending.tag_handle is not None:
            pending.tag_handle.wait()
            tags = pending.tags.reshape([self.inner_size, gather_tags.TAG_NUMEL])
            gather_tags.check(tags, pending.tag, self.inner)  # same dtype and place
        out = pending.out
        if pending.compute and self.compute_dtype != out.dtype:
            out = out.astype(self.compute_dtype)
        # the tag check is issued: its tensors (and the send copy) can serve the next
        # collective (engine/staging.py says why that is safe on NCCL)
        release_staging(pending)
        return [sp.full_of(out) for sp in self.params]

    # -------------------------------------------------------------- gradients
    def start_reduce_scatter(self, async_op: bool = False) -> "PendingReduce":
        """Issue the inner reduce-scatter of the full grads and release them.

        The input is the full grads in the full buffer's layout, zeros in its gaps:
        the grad grid autograd accumulated them in (:mod:`~.full_grads`), else one
        concatenation of them, so the full grads can be freed as soon as it is issued.
        A parameter with no grad on this rank (unused) contributes zeros: every rank
        joins the collective whatever its data did. :meth:`finish_reduce_scatter`
        waits and accumulates.
        """
        expect(self.grad_state, (GradState.EMPTY, GradState.REDUCED), "start_reduce_scatter",
               self.describe)  # synced grads go back to summed form first (the unit)
        trace.record("ready", "reduce_scatter", self.unit_index)  # full grads complete
        dtype = self.grad_reduce_dtype()
        staged = []
        try:
            if self.grad_grid is not None:  # the grads are in the reduce input already
                grid, present = self.take_grad_grid()
                staged.append(grid)
            else:
                pieces, present = self._full_grad_pieces(dtype)
                # one param filling the buffer: its own grad storage is the input
                # (released, kept alive here); more: one concatenation into a staging
                # tensor
                grid = self._reduce_input(pieces, dtype, staged) if len(pieces) > 1 \
                    else pieces[0]
                del pieces  # the full grads' storage goes now, before the collective runs
            out = staging.pool.take(self.shard_numel, dtype) if self.host is None else \
                paddle.empty([self.shard_numel], dtype=dtype)
            if self.host is None:
                staged.append(out)
            trace.record("issue", "reduce_scatter", self.unit_index)
            handle = comm.reduce_scatter(out, grid, self.reduce_group, async_op=True,
                                         what=self.describe)
        except BaseException:
            give_back(staged)  # nothing was issued (or the issue failed)
            raise
        self._before_reduce = self.grad_state
        move(self, "grad_state", GradState.REDUCING, "start_reduce_scatter")
        if not async_op:
            handle.wait()
        return PendingReduce(handle, grid, out, tuple(staged), tuple(present))

    def _full_grad_pieces(self, dtype) -> tuple[list[paddle.Tensor], list[bool]]:
        """The full grads as autograd made them (no grad grid), 1-D in the full
        buffer's order with zeros for its gaps, released as they are taken (the pieces
        keep their storage); and per param, whether it had one on this rank."""
        pieces, present, pos = [], [], 0
        for sp in self.params:
            if sp.full_offset > pos:
                pieces.append(paddle.zeros([sp.full_offset - pos], dtype))
            g = master_grad.full_grad(sp)  # .grad, or the hook's main_grad (see there)
            present.append(g is not None)
            if g is None:  # unused on this rank: zeros, so every rank joins the call
                g = paddle.zeros([sp.numel], dtype)
            elif g.dtype != dtype:
                g = g.astype(dtype)
            if sp.numel:
                pieces.append(g.reshape([-1]))  # a view: the storage outlives the release
            if present[-1]:
                master_grad.release_full_grad(sp)
            pos = sp.full_offset + sp.numel
        if pos < self.padded_numel:
            pieces.append(paddle.zeros([self.padded_numel - pos], dtype))
        return pieces, present

    def abandon_reduce(self) -> None:
        """The reduce-scatter in flight was waited for without using it (a failed
        backward): the grad shard is as before it."""
        if self.grad_state is GradState.REDUCING:
            move(self, "grad_state", self._before_reduce, "abandon_reduce")

    def _reduce_input(self, pieces, dtype, staged: list) -> paddle.Tensor:
        """The ``[I * S]`` reduce-scatter input: ``pieces`` concatenated into a staging
        tensor (every buffer of one shape shares the pool's)."""
        if self.host is not None:
            return paddle.concat(pieces)
        grid = staging.pool.take(self.padded_numel, dtype)
        staged.append(grid)
        return paddle.concat(pieces, out=grid)

    def finish_reduce_scatter(self, pending: "PendingReduce") -> None:
        """Wait for :meth:`start_reduce_scatter`; add the result to the grad shard
        (one op, in the master dtype), or to the main grads under MixPrecisionLayer."""
        expect(self.grad_state, (GradState.REDUCING,), "finish_reduce_scatter", self.describe)
        pending.handle.wait()
        trace.record("wait", "reduce_scatter", self.unit_index)
        acc = self.acc_flat()  # (a released grad's flags reset here, before the new ones)
        for sp, had in zip(self.params, pending.present, strict=True):
            sp.grad_here = sp.grad_here or had
        out = pending.out
        self.grads_scattered = False  # (after a sync: the unit rescaled it, see there)
        move(self, "grad_state", GradState.REDUCED, "finish_reduce_scatter")
        if self.host is not None:  # added on the host once the copy is in
            self.host.download(out, into=acc, add=True)
            release_staging(pending)  # the grid (the download reads out, not pooled)
            return
        if out.dtype != acc.dtype:
            out = out.astype(acc.dtype)
        acc.add_(out)
        release_staging(pending)  # the add is issued: grid and out serve the next call

    def read_block(self, sp: ShardedParam) -> paddle.Tensor:
        """``sp``'s inner block ``[rows held, ...]`` of the flat shard (a view)."""
        self.ensure_rebuilt()
        self._repair_views()
        first, count = sp.row_range(sub=False)
        if count == 0:
            return paddle.zeros([0] + sp.rest, dtype=self.dtype)
        with self.on_host():
            return sp.inner_block_of(self._flat).reshape([count] + sp.rest)

    def write_block(self, sp: ShardedParam, block) -> None:
        """Write ``sp``'s inner block (its rows held) into the flat shard, every outer
        piece of it: a full load needs no outer collective."""
        self.finish_rebuild()  # a late all-gather would overwrite what is written here
        self._repair_views()
        if sp.inner_numel == 0:
            return
        if self.host is not None:
            block = self.host.keep(block)  # host storage: CPU kernels only
        with self.on_host():
            block = block.reshape([-1]).astype(self.dtype)
            paddle.assign(block, output=sp.inner_block_of(self._flat))
