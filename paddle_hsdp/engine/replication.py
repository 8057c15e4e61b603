"""The engine as paddle_hsdp.ft sees it: the one module ft imports of the engine (issue
52), so what a fault-tolerant replica group may read and change of a sharded model is
named here, and ft holds no registry, unit or buffer.

* :func:`refusal_to_replicate`: why a model cannot train as a replica group (a buffer
  not sharded over the live outer group, outer sub-shards of its own, DiLoCo's outer
  sync with a compressed reduce), or None;
* :func:`keep_outer_state_on_every_replica`, :func:`run_owed_outer_syncs`,
  :func:`settle_outer_syncs`: DiLoCo on replica groups (engine/diloco.py): the outer
  momentum whole on every group, and a step's sync run by the next attempt, undone if
  that attempt fails;
* :func:`parameter_table`, :func:`outer_sync_table`: the sharded parameters and the
  DiLoCo policies, for the groups' configuration check;
* :func:`state_tensors`: the tensors a replica's model state is made of (each buffer's
  flat shard, unsharded parameters, buffers, DiLoCo's outer state), in one order on
  every replica;
* :func:`state_replaced`: after a transfer wrote into them, the engine's views and
  gathered copies are refreshed (and DiLoCo's receiver takes the last synced params);
* :func:`order_outer_syncs_again`, :func:`owe_rebuild`: a round changed who trains;
* :func:`finish_grad_sync`: the deferred outer all-reduce, now;
* :func:`withhold_grads`: a replica sitting the step out adds zeros to it;
* :class:`PieceOptimizers`, :func:`why_no_second_piece`: HFSDP's re-cut, the
  optimizers of the pieces a replica holds besides its own (engine/piece_optimizer.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import paddle

from .hooks import record_outer_sync_again
from .optimizers import finish_grad_sync
from .piece_optimizer import PieceOptimizers, why_no_second_piece
from .registry import registry
from .states import GradState, expect

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

__all__ = ["refusal_to_replicate", "parameter_table", "outer_sync_table", "state_tensors",
           "state_replaced",
           "order_outer_syncs_again", "owe_rebuild", "finish_grad_sync", "PieceOptimizers",
           "why_no_second_piece", "keep_outer_state_on_every_replica",
           "run_owed_outer_syncs", "settle_outer_syncs", "withhold_grads"]


def refusal_to_replicate(model: paddle.nn.Layer, outer: Group) -> str | None:
    """Why ``model``'s buffers cannot train across live replica groups over ``outer``
    (the group's outer group), or None."""
    for unit in registry.units_under(model):
        if unit.outer_sync is not None and any(b.pieces.compress is not None
                                               for b in unit.buffers):
            return (f"{unit.label} syncs its replicas every {unit.outer_sync.policy.every} "
                    "steps with a compressed reduce (fsdp_outer_compress): its error "
                    "feedback is each replica's own and would not survive a group's death "
                    "or follow a rejoiner. Use fsdp_outer_compress: null with "
                    "fsdp_outer_sync_every in a fault-tolerant job.")
        for buf in unit.buffers:
            if buf.outer is not outer:
                return (f"{buf.describe()} is not sharded over the inner group (a "
                        "replicated placement, or sharded before paddle_hsdp.ft.init): its "
                        "grads would not cross replicas. Call ft.init() before fully_shard "
                        "and shard every parameter.")
            if buf.parts != 1 and not buf.shared_pieces:
                return (f"{buf.describe()} has outer sub-shards of its own (one per "
                        "replica): a dead replica would take its piece of the optimizer "
                        "state along. Shard after paddle_hsdp.ft.init(), which cuts them by "
                        "its redundancy.")
    return None


def parameter_table(model: paddle.nn.Layer) -> list[tuple[str, list, object]]:
    """``(parameter's path in the model, shape, dtype)`` of every sharded parameter,
    unit by unit."""
    paths = {id(sub): name  # one walk, not one per parameter (registry.param_path)
             for name, sub in model.named_sublayers(include_self=True)}
    return [(".".join(x for x in (paths.get(id(unit.module), "?"), sp.fqn) if x),
             sp.shape, sp.dtype)
            for unit in registry.units_under(model) for sp in unit.params]


def outer_sync_table(model: paddle.nn.Layer) -> list[list]:
    """``[unit index, its DiLoCo policy's fields]`` of every unit that syncs over the
    outer group every H steps (``OuterSyncPolicy(every >= 2)``), for the groups'
    configuration check: groups with other intervals or outer optimizers would pair a
    pseudo-gradient's all-reduce with another's grads'."""
    return [[unit.index, dataclasses.asdict(unit.outer_sync.policy)]
            for unit in registry.units_under(model) if unit.outer_sync is not None]


def state_tensors(model: paddle.nn.Layer) -> list[tuple[str, paddle.Tensor]]:
    """The tensors a replica's model state is made of, in one order on every replica:
    each buffer's flat shard (shared HFSDP pieces included), then the parameters
    fully_shard left whole, then the model's buffers."""
    out = []
    for unit in registry.units_under(model):
        for buf in unit.buffers:
            out.append((f"unit{unit.index}.buffer{buf.index}", buf.storage.flat))
    for name, param in model.named_parameters():
        if not hasattr(param, "_hsdp_sharded_param"):  # ignored params: kept whole
            out.append((f"param.{name}", param))
    for name, buffer in model.named_buffers():
        out.append((f"buffer.{name}", buffer))
    for unit in registry.units_under(model):
        if unit.outer_sync is not None:
            out += unit.outer_sync.carried(unit)
    return out


def state_replaced(model: paddle.nn.Layer) -> None:
    """The model's state tensors were written in place: views are re-pointed, and
    parameters kept gathered are resharded (they hold the old values). DiLoCo: the
    receiver's params are the last synced ones (the donor's anchor)."""
    registry.storage_may_have_changed()
    for unit in registry.units_under(model):
        if unit.outer_sync is not None:
            unit.outer_sync.took_carried(unit)
        unit.reshard(force=True)


def keep_outer_state_on_every_replica(model: paddle.nn.Layer) -> bool:
    """DiLoCo on replica groups: every group holds the outer momentum whole (not 1/O:
    the live groups' count changes, and a dead group would take its piece along), and
    a step's sync is run by the next attempt (:func:`run_owed_outer_syncs`). Whether
    any unit syncs every H steps (else a step need not call the two below)."""
    apart = [unit.outer_sync for unit in registry.units_under(model)
             if unit.outer_sync is not None]
    for sync in apart:
        sync.replicated = True
    return bool(apart)


def run_owed_outer_syncs(model: paddle.nn.Layer) -> None:
    """Before an attempt's forward: the DiLoCo syncs the last committed step owes, over
    the round's live groups (in unit order on every rank; a collective)."""
    for unit in registry.units_under(model):
        if unit.outer_sync is not None:
            unit.outer_sync.run_owed(unit)


def settle_outer_syncs(model: paddle.nn.Layer, committed: bool) -> None:
    """The attempt committed (its syncs are done) or failed (undone, still owed)."""
    for unit in registry.units_under(model):
        if unit.outer_sync is not None:
            unit.outer_sync.settle(unit, committed)


def order_outer_syncs_again(model: paddle.nn.Layer) -> None:
    """The round's members changed: the outer syncs' order is recorded and agreed anew
    at the next backward (which syncs at the step)."""
    record_outer_sync_again(registry.units_under(model))


def owe_rebuild(model: paddle.nn.Layer) -> None:
    """Every unit rebuilds its shared pieces from the round's holders before its next
    forward."""
    for unit in registry.units_under(model):
        unit.owe_rebuild()


def withhold_grads(model: paddle.nn.Layer) -> None:
    """This replica sits the step out (its state is not the round's yet): every grad
    it would add to the outer all-reduce becomes zero, so the others' sum holds theirs
    alone (the divisor leaves it out: ``traits.contributing``). Before
    :func:`finish_grad_sync`, in a backward whose outer syncs wait for the step (the
    first after a round that changed who trains): one already issued is refused."""
    for unit in registry.units_under(model):
        unit.finish_reductions()
        for buf in unit.buffers:
            if buf.trainable:
                expect(buf.grads.state, (GradState.EMPTY, GradState.REDUCED),
                       "withhold_grads", buf.describe)
                buf.grads.acc_flat().zero_()
