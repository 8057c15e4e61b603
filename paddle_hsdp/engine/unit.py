"""One communication unit: what one ``fully_shard`` call wraps.

States: ``SHARDED`` (modules hold shard params, full storage freed) and ``UNSHARDED``
(modules hold the full params, whose storage is a fresh all-gather).  Every transition
is a collective on the unit's inner groups, so callers must make it on every rank in
the same order: forward and backward hooks do, because every rank runs the same model.

Gradient flow of one optimizer step (k micro-steps):

* when a unit's backward is done (its post-backward; else at the end of the whole
  backward): reduce-scatter its full grads into the shard grads
  (``requires_gradient_sync``), or keep accumulating full-size grads locally;
* step boundary (:func:`~paddle_hsdp.engine.reductions.sync_grads`): reduce-scatter
  whatever full grads are still pending, then one outer all-reduce per buffer
  (``requires_all_reduce``);
  with outer sub-shards (``fsdp_outer_sharding="optim"``) one outer reduce-scatter per
  buffer instead, and after the optimizer's update one outer all-gather, owed and
  issued at the next root forward (:meth:`FSDPUnit.start_owed_rebuilds`).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import paddle
import paddle.distributed as dist

from ..comm import arrival
from ..comm.traits import contributing, traits_of
from ..topology.cost import UnitShape
from ..topology.fleet import single_rank_group
from ..topology.placement import is_expert
from . import agreement, master_grad
from .agreement import Held
from .outer_sync import schedule_of
from .buffer import ShardBuffer
from .controls import UnitControls, UnitPolicies
from .diloco import OuterSyncState
from .pending import PendingGather, settle
from . import memory
from .param import ShardedParam
from .reductions import track, wait_pending_reduces
from .registry import registry
from .states import GradState, ParamState, expect, move

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from ..topology.mesh import Mesh
    from .hooks import RootState


def expect_everyone_in(units, what: str) -> None:
    """Every rank of these units' data-parallel (dense FSDP) groups must make this
    call before its first collective; else the callers raise, naming it
    (:mod:`paddle_hsdp.comm.arrival`). For calls off the hot path only."""
    groups: dict[int, Group] = {}
    for unit in units:
        group = unit.mesh.fsdp_group(False)
        groups.setdefault(group.id, group)
    for group in groups.values():
        arrival.expect_everyone(group, what)


class FSDPUnit:
    """The parameters of one ``fully_shard`` call, their buffers, and where the unit is
    in its forward and backward (its fields are state; its settings are ``policies``
    and ``controls``: :mod:`~.controls`)."""

    def __init__(self, module: paddle.nn.Layer, index: int, mesh: Mesh,
                 policies: UnitPolicies, controls: UnitControls):
        self.module = module
        self.index = index  # registration order: the global order of collectives
        self.mesh = mesh
        self.policies = policies
        self.controls = controls
        self.params: list[ShardedParam] = []
        self.buffers: list[ShardBuffer] = []
        self.borrowed: list[FSDPUnit] = []  # owners of tied params this unit's modules use
        self.borrowed_by: list[FSDPUnit] = []
        self.state = ParamState.UNSHARDED
        self.pins = 0  # a borrower's forward is using our params: do not reshard
        self.is_root = False
        self.root_state: RootState | None = None  # when this unit ran as a root
        self._in_root: RootState | None = None  # the root this unit ran under
        # its forward hooks' handles and its params' grad hooks (paddle_hsdp.forget
        # removes and disarms them)
        self.hooks = UnitHookHandles()
        self.reduced_in_backward = False  # this backward's post-backward reduced us
        # A token per forward call whose post-backward has not fired yet, held by that
        # call's graph: a graph dropped without a backward drops out (hooks._GraphToken).
        self.pending_calls: weakref.WeakSet = weakref.WeakSet()
        self.full_grads_pending = False  # full-size grads not reduce-scattered yet
        self._pending_gather: list[PendingGather | None] | None = None  # a prefetch's
        # DiLoCo (OuterSyncPolicy(every >= 2)): the replicas step apart between syncs
        outer_policy = policies.outer_sync
        self.outer_sync = (OuterSyncState(outer_policy) if outer_policy is not None
                           and outer_policy.trains_apart else None)

    @functools.cached_property
    def subtree_ids(self) -> frozenset[int]:
        """``id`` of every module under this unit's (its tree is fixed once sharded)."""
        return frozenset(id(m) for m in self.module.sublayers())

    # -------------------------------------------------------------- roots
    def root(self) -> RootState | None:
        """The root this unit runs under (its own state when it is a root)."""
        return self.root_state or self._in_root

    def enter_root(self, state: RootState) -> None:
        self._in_root = state

    def leave_roots(self) -> None:
        """Hold no root state (paddle_hsdp.forget: they reference every unit)."""
        self.root_state = self._in_root = None

    # -------------------------------------------------------------- pins
    def pin(self) -> None:
        """A borrower's forward uses this unit's parameters: no reshard until unpinned."""
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1

    def clear_pins(self) -> None:
        """What a failed forward (or the end of backward) leaves pinned goes."""
        self.pins = 0

    def post_backward_hook(self) -> None:
        """Its post-backward fired in this backward (its inputs' grads exist): reduce
        now (or keep the full grads), and the end of backward knows it was done."""
        self.post_backward()
        self.reduced_in_backward = True

    def end_backward(self, failed: bool = False) -> None:
        """Forget one backward's progress (its end, or a backward that failed): see
        :func:`~.hooks._reset_backward`."""
        self.reduced_in_backward = False
        if failed:
            self.pending_calls.clear()
        for buf in self.buffers:
            buf.full_grads.end_backward()

    # -------------------------------------------------------------- construction
    def build_buffers(self, placements: dict | None = None) -> None:
        """Group params into buffers; ``placements`` maps id(param) to "replicate" for
        params kept whole on every rank (their own buffers, inner size 1, reduced over
        the whole FSDP group)."""
        placements = placements or {}
        for (_, _, _, expert, whole), params in buffer_groups(self.params, placements).items():
            if whole:  # (one segment in every group: no layout degree)
                inner, outer = _own_rank_group(), self.mesh.fsdp_group(expert)
                reduce_group, degree = inner, None
            else:
                inner, outer = self.mesh.inner(expert), self.mesh.outer(expert)
                reduce_group, degree = (self.mesh.reduce_scatter_group(expert),
                                        self.mesh.layout_degree(expert))
            for sp in params:
                sp.mesh = self.mesh
            owned = [placements.get(id(sp.full)) == "owned" for sp in params]
            self.buffers.append(ShardBuffer(params, inner, outer, expert, self.policies.mp,
                                            self.policies.offload, reduce_group,
                                            owned=owned, rotation=self.index,
                                            layout_degree=degree))
        for i, buf in enumerate(self.buffers):
            buf.owner, buf.index = self, i

    def outer_parts(self, is_expert: bool, trainable: bool) -> tuple[int, int]:
        """``(parts, part)`` a parameter of this unit is cut into across its outer group:
        the outer degree and this rank's outer index with ``outer_sharding="optim"`` for
        trainable params, else ``(1, 0)``. Read from the outer group each time a unit is
        built, so a later change of the outer degree only needs the buffers rebuilt."""
        if self.policies.outer_sharding != "optim" or not trainable:
            return 1, 0
        outer = self.mesh.outer(is_expert)
        pieces = traits_of(outer).pieces  # shared pieces (ft/pieces.py)
        if pieces is not None:
            return (pieces.parts, pieces.part) if pieces.parts > 1 else (1, 0)
        return (outer.nranks, outer.rank) if outer.nranks > 1 else (1, 0)

    def shape(self):
        """This unit's sizes for :mod:`paddle_hsdp.topology.cost`."""
        return UnitShape(self.path(), tuple(b.shape() for b in self.buffers),
                         self.should_reshard_after_forward(),
                         sum(sp.numel for sp in self.params))

    @property
    def label(self) -> str:
        """``unit 3 (blocks.2: Block)``: for error messages (the path is resolved on use,
        from the outermost sharded module that contains this one)."""
        return f"unit {self.index} ({self.path()}: {type(self.module).__name__})"

    def path(self) -> str:
        return registry.module_path(self.module) or "<root>"

    def shard_initial(self, sync: bool = True, module_buffers: list[Held] | None = None,
                      ) -> None:
        """First sharding: cut blocks, broadcast over outer, free the full params.
        ``sync``: every tensor (``module_buffers`` too) taken from the FSDP group's
        first rank ([Note: agreement at sharding] in :mod:`.agreement`)."""
        if sync and module_buffers:
            agreement.sync_buffers(module_buffers, self.mesh)
        for buf in self.buffers:
            buf.storage.shard_from_full(src_outer_rank=0, sync=sync)
        for sp in self.params:
            sp.free_full_data()
            sp.point_users_to(sp.shard)
        move(self, "state", ParamState.SHARDED, "shard_initial")

    # -------------------------------------------------------------- transitions
    def check_params(self) -> None:
        """Run before every forward gathers anything, so a refusal comes on every rank
        before any collective. Freezing or unfreezing a parameter must happen before
        fully_shard: buffers are grouped by trainability, and autograd sees the original
        parameter, not the shard the user would flip. A shard cast in place (amp.decorate
        after fully_shard) or a MixPrecisionLayer over part of a buffer is refused."""
        for sp in self.params:
            if sp.shard.stop_gradient == sp.trainable:
                raise RuntimeError(
                    f"{registry.param_path(sp)}: stop_gradient was changed after fully_shard (it is now "
                    f"{sp.shard.stop_gradient}). Set stop_gradient before fully_shard.")
        for sp in self.params:
            sp.check_dtype()
        for buf in self.buffers:
            if buf.trainable:  # a MixPrecisionLayer over part of a buffer raises
                master_grad.uses_main_grad(buf.params, buf.describe)

    def prefetch(self) -> None:
        """Issue this unit's all-gathers without waiting (asynchronous with overlap on:
        on NCCL they run on the communication stream while the caller computes);
        :meth:`unshard` waits for them."""
        if self.state is ParamState.SHARDED:
            pending: list[PendingGather | None] = []
            overlap = self.controls.overlap
            try:
                for buf in self.buffers:
                    pending.append(buf.start_gather(compute=True, async_op=overlap))
            except BaseException:  # e.g. out of memory for the next output: the ones
                settle(pending)  # in flight land first
                raise
            self._pending_gather = pending
            move(self, "state", ParamState.GATHERING, "prefetch")
            # the gathered storage exists from the issue on: count it from there
            memory.add_gathered(self.gathered_nbytes(), 1)

    def unshard(self) -> None:
        if self.state is ParamState.UNSHARDED:
            return
        self.prefetch()
        expect(self.state, (ParamState.GATHERING,), "unshard", self.label)
        pending = self._take_prefetched()
        try:
            for i, buf in enumerate(self.buffers):
                issued = pending[i]
                if issued is None:
                    raise AssertionError(f"{self.label}: buffer {i} was not gathered")
                fulls = buf.finish_gather(issued)
                pending[i] = None  # waited for: the parameters are views of its output
                for sp, full in zip(buf.params, fulls, strict=True):
                    sp.set_full_data(full)
        except BaseException:
            # the all-gathers not finished yet are waited for before their buffers go
            settle(pending)
            for sp in self.params:  # half gathered: free what arrived, stay sharded
                sp.free_full_data()
            memory.add_gathered(-self.gathered_nbytes(), -1)
            move(self, "state", ParamState.SHARDED, "unshard")
            raise
        for sp in self.params:
            sp.point_users_to(sp.full)
        move(self, "state", ParamState.UNSHARDED, "unshard")

    def _take_prefetched(self) -> list[PendingGather | None]:
        """The all-gathers :meth:`prefetch` issued (the unit is ``GATHERING``)."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is None:
            raise AssertionError(f"{self.label}: gathering with nothing issued")
        return pending

    def reshard(self, force: bool = False) -> None:
        if self.pins > 0 and not force:
            return
        if self.state is ParamState.GATHERING:  # prefetched, never used: let it land
            pending = self._take_prefetched()
            memory.add_gathered(-self.gathered_nbytes(), -1)
            move(self, "state", ParamState.SHARDED, "reshard")
            failures = settle(pending)
            if failures:
                raise failures[0]
        if self.state is ParamState.SHARDED:
            return
        for sp in self.params:
            sp.free_full_data()
            sp.point_users_to(sp.shard)
        move(self, "state", ParamState.SHARDED, "reshard")
        memory.add_gathered(-self.gathered_nbytes(), -1)

    @property
    def backward_calls(self) -> int:
        """Forward calls whose post-backward has not fired yet (graphs alive)."""
        return len(self.pending_calls)

    def should_reshard_after_forward(self) -> bool:
        if self.controls.reshard_after_forward is None:
            return not self.is_root
        return bool(self.controls.reshard_after_forward)

    # -------------------------------------------------------------- gradients
    def post_backward(self) -> None:
        """End of a backward: reduce-scatter now, or keep accumulating full grads."""
        if self.controls.requires_gradient_sync:
            self.reduce_scatter_grads()
        elif any(b.trainable for b in self.buffers):
            self.full_grads_pending = True
            # Optimizers collect (param, grad) pairs for params whose grad exists
            # *before* _apply_optimize runs the deferred reduce-scatter, so the shard
            # grads must exist now; the reduction then fills them in place.
            for buf in self.buffers:
                if buf.trainable:
                    buf.grads.acc_flat()

    def reduce_scatter_grads(self, buffers: list[ShardBuffer] | None = None) -> None:
        """Wait for the reduce-scatters issued before (another unit's), then issue this
        unit's (asynchronous with overlap on): one unit's reduction is in flight while
        the next unit's backward computes, and its staging grid is back in the pool
        before this unit's is taken, so two grids are never held for it (on NCCL the
        earlier one had the whole of this unit's backward to finish).
        :func:`wait_pending_reduces` waits for the rest. ``buffers``: only these (an
        early reduction; the caller sees to the others)."""
        every = [b for b in self.buffers if b.trainable]
        trainable = every if buffers is None else [b for b in buffers if b.trainable]
        self.expect_more_grads(trainable)
        wait_pending_reduces()
        for buf in trainable:  # in the list as soon as issued: an error cannot drop it
            track(buf, buf.start_reduce_scatter(async_op=self.controls.overlap))
        if buffers is None:
            self.full_grads_pending = False

    def expect_more_grads(self, buffers: list[ShardBuffer]) -> None:
        """More grads are about to reach ``buffers``' shard grads: an outer sync
        issued earlier in this backward ends first (engine/outer_sync.py), and if
        the unit's grads are synced already this step (``finish_grad_sync`` ran, e.g.
        to log grads) the synced part is brought back to "summed, replicated" form
        (x N / O), so the next sync's outer sum and 1 / N leave it unchanged (every
        buffer: the flag is the unit's). With outer sub-shards only this rank's piece
        holds it (the others are zero): x N."""
        schedule = schedule_of(self)
        if schedule is not None:
            for buf in buffers:
                schedule.reopen(buf)
        for buf in self.buffers:  # the unit was synced whole: every trainable buffer
            if buf.trainable and buf.grads.state is GradState.SYNCED:
                buf.pieces.unsync(self.summed_scale(buf))

    def summed_scale(self, buf: ShardBuffer) -> float:
        """What a synced grad of ``buf`` is multiplied by to be in summed form again
        (N / O, or N with outer sub-shards reduce-scattered; ``gradient_divide_factor`` in
        place of N)."""
        return self.divisor(buf) * (buf.parts if buf.scatters_outer else 1) / \
            contributing(buf.outer)

    def add_direct_grad(self, sp: ShardedParam, grad) -> None:
        """``grad`` reached shard param ``sp`` directly (a loss term on
        ``model.parameters()`` while sharded: a penalty): added to its buffer's grad
        storage like a reduce-scatter's result, and owed an outer sync. Every replica
        that holds the shard computes the same term, and the outer sync sums it over
        them and divides by N: scaled by N / (those replicas) it arrives as plain data
        parallel gives it (the term on every rank, grads averaged)."""
        buf = sp.buffer
        self.expect_more_grads([buf])
        # shared pieces: only the replicas holding this piece compute it
        plan = traits_of(buf.outer).pieces if buf.shared_pieces else None
        scale = (self.divisor(buf) / plan.holders if plan is not None
                 else self.summed_scale(buf))
        buf.grads.add_to_grad(sp, grad * scale)
        sp.grad_here = True

    def reduce_buffer_early(self, buf: ShardBuffer) -> None:
        """Reduce-scatter one buffer whose parameters all have this backward's grads
        (:func:`paddle_hsdp.engine.grad_hooks._on_grad_accumulated`), before the end of
        backward; :meth:`reduce_rest` takes the others there."""
        self.reduce_scatter_grads([buf])
        buf.full_grads.mark_reduced_early()

    def reduce_rest(self) -> None:
        """End of a backward in which some buffers were reduced early: the trainable
        buffers that were not, and early ones whose grads grew again since (a grad that
        arrived after its buffer's reduction, e.g. from a recomputed segment)."""
        rest = [b for b in self.buffers if b.trainable
                and (not b.full_grads.reduced_early or b.full_grads.present())]
        if rest:
            self.reduce_scatter_grads(rest)
        self.full_grads_pending = False

    def drop_full_grads(self) -> None:
        """Forget the full-size grads not reduced yet (a failed backward, clear_grad):
        the grad grids go back to the pool, the parameters' grads are released."""
        for buf in self.buffers:
            buf.full_grads.drop_grid()
        for sp in self.params:
            master_grad.release_full_grad(sp)
        self.full_grads_pending = False

    def drop_pending_grads(self) -> None:
        """Forget unreduced full-size grads and the step's sync state (clear_grad)."""
        registry.storage_may_have_changed()  # grads released or replaced
        if self.full_grads_pending:
            self.drop_full_grads()
        for buf in self.buffers:
            if buf.host is not None:
                buf.host.drop()  # offloaded grads still on their way: not added now
        self.full_grads_pending = False
        for buf in self.buffers:
            buf.pieces.drop_grad_pieces()
            buf.grads.reset(GradState.EMPTY)
        schedule = schedule_of(self)
        if schedule is not None:
            schedule.restart_count()

    @property
    def grads_pending_outer_sync(self) -> bool:
        """A trainable buffer holds (or is receiving) inner-reduced grads not synced
        across the replicas yet."""
        return any(b.trainable and b.grads.state in (GradState.REDUCING, GradState.REDUCED)
                   for b in self.buffers)

    @property
    def grads_synced(self) -> bool:
        """The shard grads hold (or are receiving) this step's synced, scaled values."""
        return any(b.trainable and b.grads.state in (GradState.SYNCING, GradState.SYNCED)
                   for b in self.buffers)

    def divisor(self, buf) -> float:
        """What the step's summed grads of ``buf`` are divided by: the data-parallel
        degree, or ``gradient_divide_factor``."""
        return self.controls.gradient_divide_factor or self.mesh.fsdp_size(buf.is_expert)

    def finish_reductions(self) -> None:
        """Run a deferred reduce-scatter and wait for every one in flight."""
        if self.full_grads_pending:
            self.reduce_scatter_grads()
        wait_pending_reduces()

    def start_grad_sync(self, work: list) -> None:
        """Pending reduce-scatter, then issue the one outer all-reduce per buffer;
        appends ``(buffer, pending, scale)`` to ``work`` (as each is issued) for
        :func:`~paddle_hsdp.engine.reductions.sync_grads` to wait on.

        Grads end up as the gradient of the mean loss over all data-parallel ranks
        (``1 / N``, or ``1 / gradient_divide_factor`` when set). With
        ``requires_all_reduce`` False the outer all-reduce is skipped and each replica
        keeps the mean over its own inner group (it steps on its own data).
        """
        self.finish_reductions()
        if not self.grads_pending_outer_sync:
            return
        for buf in self.buffers:
            if not buf.trainable:
                continue
            if self.syncs_grads_over_outer:
                work.append((buf, buf.pieces.start_outer_sync(async_op=self.controls.overlap),
                             1.0 / self.divisor(buf)))
            else:
                buf.pieces.sync_locally(buf.outer.nranks / self.divisor(buf))

    @property
    def syncs_grads_over_outer(self) -> bool:
        """Whether this step's grads are averaged over the outer replicas: not with
        ``set_requires_all_reduce(False)``, nor between DiLoCo's outer syncs (every
        step: the replicas sync params instead, engine/diloco.py)."""
        return self.controls.requires_all_reduce and self.outer_sync is None

    def check_outer_sync(self) -> None:
        """With outer sub-shards each replica's optimizer holds only its piece of the
        state, so replicas cannot step apart on their own grads: the step's outer sync
        cannot be skipped (``set_requires_all_reduce(False)`` on a non-last micro-step
        is fine: the sync runs at the step only)."""
        if self.controls.requires_all_reduce or not any(b.parts > 1 for b in self.buffers):
            return
        raise NotImplementedError(
            f"{self.label}: set_requires_all_reduce(False) at the optimizer step with "
            "fsdp_outer_sharding='optim': each outer replica's optimizer holds only its "
            "1/O of the state, so replicas cannot step on their own grads. Set it True "
            "before the step (torch's pattern: False on non-last micro-steps, True on "
            "the last), or shard with fsdp_outer_sharding='none'. Nothing was synced.")

    # -------------------------------------------------------------- outer sub-shards
    def owe_rebuild(self) -> None:
        """After the optimizer's update: every buffer's outer all-gather of its pieces
        is owed, issued at the next root forward or read ([Note: edits under outer
        sub-shards] in engine/buffer/outer_pieces.py)."""
        for buf in self.buffers:
            buf.pieces.owe_rebuild()

    def start_owed_rebuilds(self) -> None:
        """A root forward begins: issue the owed rebuilds (asynchronous with overlap on;
        the unit's first all-gather waits for them), edits detected since included."""
        for buf in self.buffers:
            if buf.rebuilds:
                buf.pieces.start_owed_rebuild(async_op=self.controls.overlap)

    def finish_rebuild(self) -> None:
        """Wait for the outer all-gathers in flight (before the optimizer writes the
        pieces again)."""
        for buf in self.buffers:
            buf.pieces.finish_rebuild()

    def ensure_rebuilt(self) -> None:
        """Finish or run every owed rebuild (a collective: every rank alike)."""
        for buf in self.buffers:
            buf.pieces.ensure_rebuilt()

    def has_full_grads(self) -> bool:
        return any(master_grad.has_full_grad(sp) for sp in self.params)

    # -------------------------------------------------------------- memory report
    def full_grad_nbytes(self) -> int:
        return sum(buf.full_grads.nbytes() for buf in self.buffers)

    def gathered_nbytes(self) -> int:
        return sum(buf.compute_nbytes for buf in self.buffers)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes this unit holds now, from shapes and Python-side state (no device read):
        ``shard`` params, ``shard_grad`` (their grads and main grads), ``full_grad``
        (full-size grads not reduced yet), ``gathered`` full params."""
        shard = shard_grad = gathered = 0
        for buf in self.buffers:
            esize = buf.dtypes.master_size
            shard += buf.shard_numel * esize
            if any(sp.full_is_materialized() for sp in buf.params):
                gathered += buf.compute_nbytes  # the full buffer the params are views of
            for sp in buf.params:
                if sp.shard.grad is not None:
                    shard_grad += sp.inner_numel * esize
                if getattr(sp.shard, "main_grad", None) is not None:
                    shard_grad += sp.inner_numel * sp.shard.main_grad.element_size()
        return {"shard": shard, "shard_grad": shard_grad,
                "full_grad": self.full_grad_nbytes(), "gathered": gathered}

    def held_bytes(self) -> dict[str, int]:
        """:meth:`bytes_by_kind` as :func:`paddle_hsdp.memory_report` gives it (``grad``:
        shard grads plus full-size grads)."""
        held = self.bytes_by_kind()
        return {"shard": held["shard"], "grad": held["shard_grad"] + held["full_grad"],
                "gathered": held["gathered"]}


class UnitHookHandles:
    """What the engine hooked on a unit's module and parameters, so that
    ``paddle_hsdp.forget`` can take it all off."""

    def __init__(self) -> None:
        self.forward: list = []  # the module's forward pre- and post-hook handles
        # its params' grad hooks (Paddle 3.3 returns no handle for a backward hook:
        # they are disarmed instead, engine/grad_hooks.py)
        self.grads: list = []

    def remove(self) -> None:
        for handle in self.forward:
            handle.remove()
        self.forward.clear()
        for hook in self.grads:
            hook.disarm()
        self.grads.clear()


def _own_rank_group():
    return single_rank_group(dist.get_rank())


def buffer_groups(params: list[ShardedParam], placements: dict) -> "OrderedDict":
    """Params that travel in one collective, in first-seen order, keyed by
    ``(segment, dtype, trainable, expert, kept whole)``: what must agree inside one
    collective, and the stretch of the unit's module tree between sharded sub-modules
    (``ShardedParam.segment``). A unit without sharded sub-modules has one stretch; a
    root's embedding (before the layers) and its final norm and head (after them) get
    buffers of their own, so the head's grads can be reduced as soon as the head's
    backward is done (grad_hooks._on_grad_accumulated) instead of waiting for the
    embedding's at the end of backward."""
    groups: "OrderedDict[tuple, list[ShardedParam]]" = OrderedDict()
    for sp in params:
        whole = placements.get(id(sp.full)) == "replicate"
        key = (sp.segment, str(sp.dtype), sp.trainable, is_expert(sp.full), whole)
        groups.setdefault(key, []).append(sp)
    return groups


