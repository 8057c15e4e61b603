"""One communication unit: what one ``fully_shard`` call wraps.

States: ``SHARDED`` (modules hold shard params, full storage freed) and ``UNSHARDED``
(modules hold the full params, whose storage is a fresh all-gather).  Every transition
is a collective on the unit's inner groups, so callers must make it on every rank in
the same order: forward and backward hooks do, because every rank runs the same model.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from .buffer import ShardBuffer
from .param import ShardedParam


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class FSDPUnit:
    def __init__(self, module, index: int, mesh, reshard_after_forward):
        self.module = module
        self.index = index  # registration order: the global order of collectives
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward  # None: decided at root time
        self.params: list[ShardedParam] = []
        self.buffers: list[ShardBuffer] = []
        self.borrowed: list[FSDPUnit] = []  # owners of tied params this unit's modules use
        self.state = UnitState.UNSHARDED
        self.pins = 0  # a borrower's forward is using our params: do not reshard
        self.is_root = False
        self.grads_pending_outer_sync = False

    # -------------------------------------------------------------- construction
    def build_buffers(self) -> None:
        groups: "OrderedDict[tuple, list[ShardedParam]]" = OrderedDict()
        for sp in self.params:
            expert = _is_expert(sp.full)
            groups.setdefault((str(sp.dtype), sp.trainable, expert), []).append(sp)
        for (_, _, expert), params in groups.items():
            inner, outer = self.mesh.inner(expert), self.mesh.outer(expert)
            for sp in params:
                sp.mesh = self.mesh
            self.buffers.append(ShardBuffer(params, inner, outer, expert))

    def shard_initial(self) -> None:
        """First sharding: cut blocks, broadcast over outer, free the full params."""
        for buf in self.buffers:
            buf.shard_from_full(src_outer_rank=0)
        for sp in self.params:
            sp.free_full_data()
            sp.point_users_to(sp.shard)
        self.state = UnitState.SHARDED

    # -------------------------------------------------------------- transitions
    def unshard(self) -> None:
        if self.state is UnitState.UNSHARDED:
            return
        for buf in self.buffers:
            for sp, full in zip(buf.params, buf.gather_full()):
                sp.set_full_data(full)
        for sp in self.params:
            sp.point_users_to(sp.full)
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        if self.state is UnitState.SHARDED or self.pins > 0:
            return
        for sp in self.params:
            sp.free_full_data()
            sp.point_users_to(sp.shard)
        self.state = UnitState.SHARDED

    def should_reshard_after_forward(self) -> bool:
        if self.reshard_after_forward is None:
            return not self.is_root
        return bool(self.reshard_after_forward)

    # -------------------------------------------------------------- gradients
    def reduce_scatter_grads(self) -> None:
        for buf in self.buffers:
            if buf.trainable:
                buf.reduce_scatter_grads()
        self.grads_pending_outer_sync = True

    def all_reduce_grads(self) -> None:
        if not self.grads_pending_outer_sync:
            return
        for buf in self.buffers:
            if buf.trainable:
                buf.all_reduce_grads(scale=1.0 / self.mesh.fsdp_size(buf.is_expert))
        self.grads_pending_outer_sync = False

    # -------------------------------------------------------------- memory report
    def held_bytes(self) -> dict[str, int]:
        shard = grad = gathered = 0
        for buf in self.buffers:
            esize = buf.element_size
            shard += buf.shard_numel * esize
            for sp in buf.params:
                if sp.shard.grad is not None:
                    grad += sp.chunk_numel * esize
                if sp.full_is_materialized():
                    gathered += sp.numel * esize
                if sp.full.grad is not None:
                    grad += sp.numel * esize
        return {"shard": shard, "grad": grad, "gathered": gathered}


def _is_expert(param) -> bool:
    return bool(getattr(param, "is_moe_param", False) or getattr(param, "expert", False))
