"""What the engine reads of a Paddle optimizer, and the public ``finish_grad_sync``.

The optimizer under fleet's wrappers, the parameters and HSDP shards it holds, the
units that own them, the refusal of optimizers that cannot be right on shards, and its
per-parameter states (accumulators, master weights) as checkpoints and
``flex_checkpoint`` see them. Nothing here changes Paddle: the step boundary that calls
these is :mod:`paddle_hsdp.patches.optim`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.incubate.optimizer as incubate
import paddle.incubate.optimizer.lbfgs as incubate_lbfgs
from paddle.base import framework

from ..comm import collectives as comm
from ..comm import watchdog
from ..comm.traits import traits_of
from ..optim.muon import spread_matrices
from ..topology.placement import ModelAxes
from . import offload, owned_exchange
from .layout import balanced_rotations, orthogonalisation_work, owned_loads
from .registry import managed_param, owning_unit, param_path, units_under
from .reductions import sync_grads

if TYPE_CHECKING:
    from paddle.distributed.communication.group import Group

    from .buffer import ShardBuffer
    from .param import ShardedParam

_T = TypeVar("_T")
logger = logging.getLogger("paddle_hsdp")


class _HoldsParams(Protocol):
    """What :func:`optimizer_state_bytes` reads of a unit (an ``FSDPUnit``, which
    imports this module through engine/memory.py)."""

    @property
    def params(self) -> Sequence[ShardedParam]: ...


def optimizer_params(optimizer: paddle.optimizer.Optimizer) -> list:
    params = []
    for p in getattr(optimizer, "_parameter_list", None) or []:
        if isinstance(p, dict):
            params.extend(p["params"])
        else:
            params.append(p)
    return params


def sharded_params_of(optimizer: paddle.optimizer.Optimizer) -> list:
    return [p for p in optimizer_params(optimizer) if hasattr(p, "_hsdp_sharded_param")]


def not_elementwise_classes() -> tuple:
    """Optimizers whose update of an element reads other elements of the parameter
    (trust ratios, line searches): on a shard they would see only this rank's rows."""
    names = [(paddle.optimizer, "Lamb"), (paddle.optimizer, "LBFGS"),
             (incubate_lbfgs, "LBFGS"), (incubate, "LarsMomentumOptimizer"),
             (incubate, "DistributedFusedLamb")]
    found = (getattr(mod, name, None) for mod, name in names)
    return tuple(cls for cls in found if isinstance(cls, type))


def check_optimizer(optimizer: paddle.optimizer.Optimizer) -> list:
    """Refuse, before any collective or update, an optimizer that cannot be right on
    HSDP shards; return the shards it holds. Same answer on every rank: every rank
    builds the same optimizer over the same model."""
    params = optimizer_params(optimizer)
    for p in params:
        sp = managed_param(p)
        # adopt_shards swapped every sharded full param for its shard before this, so
        # what is left was claimed by a fully_shard that failed before cutting it
        if sp is not None and p is not getattr(sp, "shard", None):
            raise RuntimeError(
                f"The optimizer holds the parameter '{param_path(sp)}', which a fully_shard "
                "call that failed had taken and left unsharded: call fully_shard on the "
                "model again (once what it refused is fixed) before the optimizer steps. "
                "Nothing was updated.")
    shards = [p for p in params if hasattr(p, "_hsdp_sharded_param")]
    if shards and isinstance(optimizer, not_elementwise_classes()):
        raise NotImplementedError(
            f"{type(optimizer).__name__} is not element-wise (its update of an element "
            "depends on the whole parameter), so on HSDP shards each rank would compute a "
            "different update and outer replicas would drift apart. Use an element-wise "
            "optimizer (AdamW, Adam, SGD, Momentum, RMSProp, ...) with paddle_hsdp.")
    return shards


def units_of_shards(params: Iterable[paddle.Tensor]) -> list:  # of FSDPUnit
    units = {}
    for p in params:
        unit = owning_unit(p._hsdp_sharded_param)
        units[unit.index] = unit
    return [units[i] for i in sorted(units)]  # one global order on every rank


def finish_grad_sync(target: paddle.optimizer.Optimizer | paddle.nn.Layer
                     | Iterable[paddle.Tensor]) -> None:
    """Run the deferred outer all-reduce (and 1/N scaling) now, for the units of
    ``target``: an optimizer (the units whose shards it holds), a sharded model (every
    unit under it), or an iterable of parameters. A collective: call it on every rank.
    Idempotent within a step."""
    sync_grads(_units_for(target, "finish_grad_sync"))


def untouched_shards(shards: Iterable[paddle.Tensor]) -> set[int]:
    """``id`` of every shard in ``shards`` whose parameter no rank of its FSDP group
    gave a grad since its grad was last released: plain Paddle's optimizer skips such a
    parameter (its grad is None: no weight decay, no moment or step change), while the
    engine's shard grad is a zero view. A collective while undecided parameters remain:
    an all-reduce (max) of a flag each over the FSDP group's inner, then its outer group
    (:func:`_factors`), at the optimizer step; once
    every parameter has had a grad (the usual case after the first step) nothing is
    sent. The undecided set is the same on every rank of a group: ``grad_anywhere`` is
    agreed, and grads are released on every rank alike (``clear_grad``)."""
    undecided: dict[int, tuple] = {}  # group id -> (group, [ShardedParam])
    for p in shards:
        sp = p._hsdp_sharded_param
        if sp.trainable and not sp.grad_anywhere:
            group = sp.mesh.fsdp_group(sp.buffer.is_expert)
            undecided.setdefault(group.id, (group, []))[1].append(sp)
    untouched = set()
    for group_id in sorted(undecided):  # one order on every rank
        group, sps = undecided[group_id]
        flags = paddle.zeros([len(sps)], dtype="float32")  # (paddle.to_tensor leaks 2
        paddle.assign(np.array([sp.grad_here for sp in sps], "float32"), output=flags)  # blocks)
        for part in _factors(group, sps[0].buffer):
            comm.all_reduce(flags, part, tag="grads present", op="max")
        with watchdog.host_sync("the read of which parameters got grads"):
            present = flags.numpy()
        for sp, flag in zip(sps, present, strict=True):
            sp.grad_anywhere = bool(flag > 0)
            if not sp.grad_anywhere:
                untouched.add(id(sp.shard))
    return untouched


def _factors(fsdp_group: Group, buf: ShardBuffer) -> list[Group]:
    """The groups whose all-reduces in turn reach every rank of ``fsdp_group``: its
    inner and outer groups where it is their product (no communicator of the FSDP
    group's size is made for the flags: with NCCL, pure HSDP's would span the world),
    else the group itself (a fault-tolerant job's FSDP group is its replica's, the
    live outer group another job's). Groups of one rank are left out."""
    inner, outer = buf.inner, buf.outer
    if inner.nranks * outer.nranks == fsdp_group.nranks and outer.nranks > 1 and \
            set(inner.ranks) | set(outer.ranks) <= set(fsdp_group.ranks):
        parts = [inner, outer]
    else:
        parts = [fsdp_group]
    return [g for g in parts if g.nranks > 1]


def unwrap_optimizer(optimizer: _T) -> _T:
    """The optimizer under fleet.distributed_optimizer's wrappers (anything else as is).
    A wrapper (``HybridParallelOptimizer``, ``MixPrecisionOptimizer``) is no subclass of
    ``paddle.optimizer.Optimizer`` but hands every attribute read on to the optimizer it
    wraps: the package types it as one. Typed as returning what went in, which is right
    for what the package passes (an optimizer, a model, parameters); a wrapper comes out
    as the optimizer it wraps, so do not narrow a wrapper's type on the result."""
    while hasattr(optimizer, "_inner_opt"):
        optimizer = optimizer._inner_opt
    return optimizer


def _units_for(target: paddle.optimizer.Optimizer | paddle.nn.Layer | Iterable[paddle.Tensor],
               what: str) -> list:  # of FSDPUnit
    target = unwrap_optimizer(target)
    if hasattr(target, "_parameter_list"):
        return units_of_shards(sharded_params_of(target))
    if isinstance(target, paddle.nn.Layer):
        units = units_under(target)
        if not units:
            raise ValueError(f"{what}: no fully_shard unit in this "
                             f"{type(target).__name__}; call fully_shard on it first.")
        return units
    if isinstance(target, paddle.Tensor) or not hasattr(target, "__iter__"):
        raise TypeError(f"{what} takes an optimizer, a sharded model or an iterable of "
                        f"parameters, got {type(target).__name__}")
    return units_of_shards(managed_shards(target))


def managed_shards(params: Iterable[paddle.Tensor]) -> list:
    """The HSDP shard of every managed param in ``params`` (a gathered full param
    counts as its shard), deduplicated, in order."""
    out, seen = [], set()
    for p in params:
        sp = managed_param(p)
        if sp is None or not hasattr(sp, "shard"):  # (claimed by a fully_shard that failed)
            continue
        p = sp.shard
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def states_of(optimizer: paddle.optimizer.Optimizer, p: paddle.Tensor) -> dict:
    """``{state name: tensor}`` the optimizer keeps for ``p``: its accumulators under
    Paddle's names (``moment1``, ``beta1_pow_acc``, ...) and ``master_weight``. With
    master weights (``multi_precision`` over bfloat16 / float16 parameters) Paddle keys
    the accumulators by the master weight's name (``<name>_fp32_master_0``), not the
    parameter's."""
    master = (getattr(optimizer, "_master_weights", None) or {}).get(p.name)
    key = master.name if master is not None else p.name
    states = {acc: table[key] for acc, table in optimizer._accumulators.items()
              if key in table}
    if master is not None:
        states["master_weight"] = master
    return states


def optimizer_state_bytes(optimizer: paddle.optimizer.Optimizer,
                          units: Iterable[_HoldsParams] | None = None) -> int:
    """Bytes of ``optimizer``'s states (accumulators, master weights) of the HSDP shards
    it holds on this rank (only those of ``units``, if given), from shapes: for
    ``memory_report`` and the memory timeline (engine/trace.py)."""
    optimizer = unwrap_optimizer(optimizer)
    params = sharded_params_of(optimizer)
    if units is not None:
        mine = {id(sp.shard) for unit in units for sp in unit.params}
        params = [p for p in params if id(p) in mine]
    return sum(math.prod(t.shape) * t.element_size() for p in params
               for t in states_of(optimizer, p).values())


def ensure_accumulators(optimizer: paddle.optimizer.Optimizer) -> None:
    """Create the optimizer's state now if no step has run yet, so it can be loaded."""
    params = [p for p in optimizer_params(optimizer) if not p.stop_gradient]
    if params and not getattr(optimizer, "_accumulators", None):
        if callable(getattr(optimizer, "orthogonalise_over_replicas", None)):
            fix_momentum_owners(optimizer, sharded_params_of(optimizer))
        block = framework.default_main_program().global_block()
        # where the step will run: offloaded shards keep their state on the host
        offloaded = any(getattr(getattr(p, "_hsdp_sharded_param", None), "buffer", None)
                        is not None and p._hsdp_sharded_param.buffer.host is not None
                        for p in params)
        with offload.on_host() if offloaded else contextlib.nullcontext():
            optimizer._create_accumulators(block, params)


def needs_whole_matrices(optimizer: paddle.optimizer.Optimizer) -> bool:
    """Whether ``optimizer``'s update of a matrix reads the whole matrix (Muon's
    Newton-Schulz orthogonalisation): declared by a class attribute
    ``needs_whole_matrices = True``, else assumed for every class named ``*Muon*``."""
    declared = getattr(type(optimizer), "needs_whole_matrices", None)
    if declared is not None:
        return bool(declared)
    return any("muon" in klass.__name__.lower() for klass in type(optimizer).__mro__)


def _updates_as_matrix(optimizer: paddle.optimizer.Optimizer, p: paddle.Tensor) -> bool:
    """Whether a whole-matrix optimizer updates ``p`` as a matrix: its own answer
    (``updates_as_matrix``, paddle_hsdp's Muon), else every parameter of 2 dims or more."""
    ask = getattr(optimizer, "updates_as_matrix", None)
    return bool(ask(p)) if callable(ask) else len(p.shape) >= 2


def refuse_row_sharded_matrices(optimizer: paddle.optimizer.Optimizer,
                                shards: Iterable[paddle.Tensor]) -> list[ShardBuffer]:
    """Check a whole-matrix optimizer against the shards at its first step: a matrix
    cut across ranks (the default row shards of a 2-D parameter, or HFSDP's outer
    pieces) would be orthogonalised rows by rows, so its buffer is returned, to be laid
    out anew with its matrices on owners (:func:`move_matrices_to_owners`, once the
    grads are synced); one that cannot move (an explicit ``Shard(0)``, an offloaded
    buffer, MixPrecisionLayer's main grads, state the optimizer already made) is
    refused, naming it. A 3-D stack's rows are its matrices, which the row layout keeps
    whole. Decided by the layout alone, so every rank decides alike, before the update."""
    if not needs_whole_matrices(optimizer) or \
            getattr(optimizer, "_hsdp_matrices_agreed", False):  # the layout is fixed
        return []
    shards = list(shards)
    to_move: list[ShardBuffer] = []
    problem = _cut_matrix(optimizer, shards, to_move) or _unmovable_buffer(optimizer, to_move)
    for buf in _buffers_of(shards):  # issue 65: each matrix orthogonalised once per job
        if all(b is not buf for b in to_move) and _outer_parts(optimizer, buf) is not None:
            to_move.append(buf)
    # (a collective over the mp group: taken whatever this rank found, so that the
    # group's other ranks do not wait for it)
    problem = _unmatched_slice_owners(optimizer, shards) or problem
    # agreed over every rank: pipeline stages hold different parameters, and a stage
    # that went on alone would wait in its next collective for the refused ones
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = paddle.to_tensor([1 if problem else 0], dtype="int64")
        comm.all_reduce(flag, dist.collective._get_global_group(), op="max",
                        what=f"{type(optimizer).__name__}: whole matrices on every rank")
        with watchdog.host_sync("the whole-matrix check's agreement"):
            refused = int(flag) > 0
    else:
        refused = problem is not None
    if refused:
        raise NotImplementedError(problem or (
            f"{type(optimizer).__name__} updates each matrix as a whole, and another "
            "rank holds one cut into rows or split by tensor parallelism (its message "
            "says which). Nothing was updated."))
    optimizer._hsdp_matrices_agreed = True  # (our mark on the optimizer, read above)
    return to_move


def move_matrices_to_owners(optimizer: paddle.optimizer.Optimizer,
                            buffers: list[ShardBuffer]) -> None:
    """Lay ``buffers`` out anew with every matrix the optimizer updates whole kept in
    one segment (the layout ``owned_matrices()`` gives), from their full values and
    synced grads (one all-gather each, per buffer, unit order: alike on every rank),
    before the first update; said once. Exact: only where the rows live changes."""
    units = {id(b.owner): b.owner for b in buffers if b.owner is not None}
    for unit in units.values():
        unit.reshard(force=True)  # gathered copies go: the layout they view changes
    moved: list[str] = []
    spread = 0
    buffers = sorted(buffers, key=lambda b: (b.unit_index, b.index))
    plans = [(_owned_flags(optimizer, buf), _outer_parts(optimizer, buf) or (buf.parts, buf.part))
             for buf in buffers]
    rotations = _model_wide_rotations(buffers, plans)
    for buf, (owned, (parts, part)), rotation in zip(buffers, plans, rotations, strict=True):
        try:
            layout = buf.layout_with_owners(owned, parts, rotation)
            buf.rotation = rotation
        except ValueError:  # (a turn that needs a larger segment: the unit's own turn)
            layout = buf.layout_with_owners(owned, parts)  # (checked before: no refusal)
        cut = any(o and not sp.slot.in_one_segment
                  for sp, o in zip(buf.params, owned, strict=True))
        fulls = buf.gather_full()
        grads = buf.gather_full(grads=True) if buf.trainable else None
        spread += parts != buf.parts
        buf.relayout(layout, fulls, grads, parts, part)
        if cut:
            moved.extend(param_path(sp) for sp, o in zip(buf.params, owned, strict=True) if o)
    if moved:
        logger.warning(
            "paddle_hsdp: %s updates each matrix whole, and %d matrices (e.g. '%s') were "
            "cut into rows: they now lie whole on one rank each (the layout "
            "shard_placement_fn=paddle_hsdp.owned_matrices() gives; pass it to "
            "fully_shard to lay them out so from the start)", type(optimizer).__name__,
            len(moved), moved[0])
    if spread:
        logger.info(
            "paddle_hsdp: %s: the owners of %d buffers now span the outer replicas too "
            "(each matrix orthogonalised once per job; its grad reduce-scattered over the "
            "outer group and the updated matrices all-gathered, as with "
            "fsdp_outer_sharding='optim')", type(optimizer).__name__, spread)


def share_orthogonalisation_over_replicas(optimizer: paddle.optimizer.Optimizer,
                                          shards: list[paddle.Tensor]) -> None:
    """Issue 65: a buffer whose owners stay in the inner group (not spread over the
    outer replicas: padding past ``SPREAD_PADDING_MAX``, an offloaded buffer, main
    grads) holds each of its matrices whole on one rank per replica, identical after
    the outer all-reduce of the grads. Each such matrix is given to one replica
    (greedy by Newton-Schulz work over the matrices this rank holds, the same list on
    every rank of its outer group), which alone orthogonalises it; the optimizer
    all-gathers the results over the outer group at the step's end
    (``orthogonalise_over_replicas``) and keeps its momentum alone
    (:func:`fix_momentum_owners`). Chosen once (layouts fixed), told every step for the
    units whose grads this step are averaged over the replicas; a step without that
    average (``set_requires_all_reduce(False)``) is refused where a replica keeps a
    matrix's momentum alone; no collective here."""
    optimizer = unwrap_optimizer(optimizer)
    share = getattr(optimizer, "orthogonalise_over_replicas", None)
    if not callable(share):
        return
    chosen = fix_momentum_owners(optimizer, shards)
    alone = getattr(optimizer, "momentum_owners", {})
    apart = [unit for unit, name, _, _ in chosen
             if not unit.syncs_grads_over_outer and name in alone]
    if apart:  # alike on every rank (the controls are), before any update
        raise NotImplementedError(
            f"{apart[0].label}: set_requires_all_reduce(False) at the optimizer step, and "
            f"{type(optimizer).__name__} keeps each shared matrix's momentum on one outer "
            "replica (issue 65), so replicas cannot step on their own grads. Set it True "
            "before the step (False on non-last micro-steps only), or build the optimizer "
            "with share_over_replicas=False. Nothing was updated.")
    share({name: (group, owner) for unit, name, group, owner in chosen
           if unit.syncs_grads_over_outer})
    if getattr(optimizer, "shares_over_replicas", False) and \
            not getattr(optimizer, "_hsdp_exchange_planned", False):
        # from the next step on, each shared matrix's grad reaches its replica only
        owned_exchange.plan(_buffers_of(shards), {name: owner for _, name, _, owner in chosen})
        optimizer._hsdp_exchange_planned = True


def fix_momentum_owners(optimizer: paddle.optimizer.Optimizer,
                        shards: list[paddle.Tensor]) -> list[tuple]:
    """The replica shares (:func:`_replica_shares`), chosen once, and told to the
    optimizer (``keep_momentum_on_owners``) before it makes any state: the owning
    replica alone keeps a shared matrix's momentum. Called at the first step or before
    a checkpoint makes the state (ensure_accumulators), whichever comes first; the
    buffers keep their layout from then on (_outer_parts)."""
    chosen = getattr(optimizer, "_hsdp_replica_shares", None)
    if chosen is None:
        chosen = optimizer._hsdp_replica_shares = _replica_shares(optimizer, shards)
        keep = getattr(optimizer, "keep_momentum_on_owners", None)
        if callable(keep):
            keep({name: (group, owner) for _, name, group, owner in chosen})
    return chosen


def _replica_shares(optimizer: paddle.optimizer.Optimizer, shards: list[paddle.Tensor],
                    ) -> list[tuple]:
    """``(unit, matrix's name, outer group, replica that orthogonalises it)`` for
    :func:`share_orthogonalisation_over_replicas`, in unit and buffer order."""
    by_group: dict[int, list[ShardedParam]] = {}
    for buf in sorted(_buffers_of(shards), key=lambda b: (b.unit_index, b.index)):
        traits = traits_of(buf.outer)
        if not buf.trainable or buf.parts != 1 or buf.outer.nranks <= 1 or \
                buf.owner is None or buf.owner.outer_sync is not None or \
                traits.watchdog_exempt or traits.pieces is not None:
            continue  # one replica, outer pieces, DiLoCo or live replica groups
        by_group.setdefault(id(buf.outer), []).extend(
            sp for sp in buf.params
            if sp.trainable and len(sp.shape) == 2 and not getattr(sp.shard, "is_distributed", False)
            and comm.numel_of(sp.shard) == math.prod(sp.shape)
            and _updates_as_matrix(optimizer, sp.shard))
    chosen: list[tuple] = []
    for matrices in filter(None, by_group.values()):
        group = matrices[0].buffer.outer
        owners = spread_matrices([list(sp.shape) for sp in matrices], group.nranks)
        chosen.extend((sp.buffer.owner, sp.shard.name, group, owner)
                      for sp, owner in zip(matrices, owners, strict=True))
    return chosen


def _model_wide_rotations(buffers: list[ShardBuffer],
                          plans: list[tuple[list[bool], tuple[int, int]]]) -> list[int]:
    """Each buffer's rotation (which segment its owners' ties start at) chosen over the
    whole model, for the buffers whose owners now span the outer replicas: there the
    segments (inner x outer) may outnumber the units, and the unit index alone would
    leave some ranks twice the mean Newton-Schulz work (engine/layout.py,
    balanced_rotations). The others keep their own. Alike on every rank (shapes only)."""
    rotations = [buf.rotation for buf in buffers]
    spread = [k for k, (buf, (_, (parts, _))) in enumerate(zip(buffers, plans, strict=True))
              if parts != buf.parts]
    by_segments: dict[int, list[int]] = {}
    for k in spread:  # the outer degree may differ between dense and expert buffers
        by_segments.setdefault(buffers[k].inner_size * plans[k][1][0], []).append(k)
    for members in by_segments.values():
        loads = []
        for k in members:
            buf, (owned, (parts, _)) = buffers[k], plans[k]
            work = [orthogonalisation_work(sp.shape) for sp in buf.params]
            loads.append(owned_loads(buf.layout_with_owners(owned, parts, 0), work))
        chosen = balanced_rotations(loads)
        if chosen is not None:
            for k, rotation in zip(members, chosen, strict=True):
                rotations[k] = rotation
    return rotations


def _buffers_of(shards: list[paddle.Tensor]) -> list[ShardBuffer]:
    out: list[ShardBuffer] = []
    for p in shards:
        buf = p._hsdp_sharded_param.buffer
        if all(b is not buf for b in out):
            out.append(buf)
    return out


def _outer_parts(optimizer: paddle.optimizer.Optimizer, buf: ShardBuffer,
                 ) -> tuple[int, int] | None:
    """``(parts, part)`` that spread a buffer's owners over its outer replicas (issue
    65: under plain HSDP each replica's owners would orthogonalise the same matrices),
    or None where that does not apply: no matrix the optimizer updates whole, already
    cut into outer parts, one replica, an outer group another module manages (a
    fault-tolerant job's live replicas come and go), an offloaded buffer, main grads,
    state the optimizer already holds, pieces that would hold more than twice the
    buffer, or a layout more than ``SPREAD_PADDING_MAX`` the size of the inner owners'
    one (then each replica keeps orthogonalising its matrices, as before)."""
    outer = buf.outer
    if not buf.trainable or buf.parts != 1 or outer.nranks <= 1 or \
            not getattr(optimizer, "spreads_owners_over_replicas", True):
        return None
    traits = traits_of(outer)
    if traits.watchdog_exempt or traits.pieces is not None:
        return None
    matrices = [sp for sp in buf.params
                if len(sp.shape) == 2 and _updates_as_matrix(optimizer, sp.shard)]
    # (state made, or its replicas' owners fixed before a checkpoint made it: the
    # layout stays, on every rank alike)
    if not matrices or buf.host is not None or buf.grads.main_grads or \
            getattr(optimizer, "_hsdp_replica_shares", None) is not None or \
            any(states_of(optimizer, sp.shard) for sp in buf.params):
        return None
    owned = _owned_flags(optimizer, buf)
    try:
        spread = buf.layout_with_owners(owned, outer.nranks)
    except ValueError:
        return None
    # each of the inner x outer segments holds at least the largest matrix: with fewer
    # matrices than segments the padding would multiply the buffer's memory and
    # all-gather (a Llama-3-8B block a unit at 8 x 4: 4x the inner owners' layout); past it
    # each replica keeps orthogonalising its inner owners' matrices instead
    if spread.total_numel > SPREAD_PADDING_MAX * buf.layout_with_owners(owned, 1).total_numel:
        return None
    return outer.nranks, outer.rank


# how much larger than the inner owners' layout a buffer may grow when its owners
# span the outer replicas too (the bytes of every all-gather and of every shard)
SPREAD_PADDING_MAX = 1.25


def _owned_flags(optimizer: paddle.optimizer.Optimizer, buf: ShardBuffer) -> list[bool]:
    """Per parameter of ``buf``: kept in one segment, as ``owned_matrices()`` lays a
    buffer out for a whole-matrix optimizer (its owned parameters, and every trainable
    matrix the optimizer updates whole)."""
    owned = list(buf.layout.owned) or [False] * len(buf.params)
    return [bool(o) or (sp.trainable and len(sp.shape) == 2 and
                        _updates_as_matrix(optimizer, sp.shard))
            for o, sp in zip(owned, buf.params, strict=True)]


def _unmovable_buffer(optimizer: paddle.optimizer.Optimizer,
                      buffers: list[ShardBuffer]) -> str | None:
    """Why one of ``buffers`` cannot take its owners' layout (HFSDP pieces that would
    hold more than twice the buffer), or None."""
    for buf in buffers:
        try:
            buf.layout_with_owners(_owned_flags(optimizer, buf))
        except ValueError as e:
            return (f"{type(optimizer).__name__} updates each matrix as a whole; moving "
                    f"the matrices of {buf.describe()} onto owners at the first step "
                    f"cannot be done: {e}")
    return None


def _cannot_move(optimizer: paddle.optimizer.Optimizer, sp: ShardedParam) -> str | None:
    """Why a matrix cut into rows cannot be moved onto an owner, or None."""
    buf = sp.buffer
    if sp.placement == "shard":
        return "shard_placement_fn asked paddle.distributed.Shard(0) for it"
    if buf.host is not None:
        return "its buffer is offloaded to the host (CPUOffloadPolicy)"
    if buf.grads.main_grads:
        return "MixPrecisionLayer keeps its grads in main_grad"
    if states_of(optimizer, sp.shard):
        return "the optimizer already holds state for its rows"
    return None


def _unmatched_slice_owners(optimizer: paddle.optimizer.Optimizer,
                            shards: list[paddle.Tensor]) -> str | None:
    """An optimizer that joins a tensor-parallel matrix's slices (Muon's
    ``tp_mode="duplicated"``: ``joins_tensor_parallel_slices``) calls the mp group
    once per matrix on the ranks that hold its slice whole: they must be the whole mp
    group (the mp ranks' layouts match) or those calls would wait forever. Which of
    its split matrices each rank holds, compared over the mp group (their count, then
    the held-or-not mask); why not, or None. Every rank of the mp group takes the
    same calls and reaches the same answer."""
    axes = ModelAxes()
    if not getattr(optimizer, "joins_tensor_parallel_slices", False) or axes.mp_degree == 1:
        return None
    group = axes.hcg.get_model_parallel_group()
    name = type(optimizer).__name__
    split = [p for p in shards if getattr(p, "is_distributed", False) and
             len(p._hsdp_sharded_param.shape) >= 2 and _updates_as_matrix(optimizer, p)]
    held = [1 if comm.numel_of(p) > 0 else 0 for p in split]
    for values, what in (([len(held)], "count"), (held, "held")):
        if not values:
            return None  # no split matrix on any rank of the group (the counts agree)
        both = paddle.to_tensor(values + [-v for v in values], dtype="int64")
        comm.all_reduce(both, group, op="max", what=f"{name}: the mp slices' owners ({what})")
        with watchdog.host_sync("the mp slices' owners agreement"):
            top = [int(v) for v in both.numpy()]
        if top[:len(values)] != [-v for v in top[len(values):]]:
            return (f"{name}: the ranks of mp group {group.ranks} hold different "
                    f"tensor-parallel matrices whole (this rank {sum(held)} of "
                    f"{len(held)}); joining their slices needs every mp rank to hold its "
                    "slice of the same matrices. Shard the mp ranks' models alike (the "
                    "same units, placements and sizes). Nothing was updated.")
    return None


def _cut_matrix(optimizer: paddle.optimizer.Optimizer, shards: list[paddle.Tensor],
                to_move: list[ShardBuffer]) -> str | None:
    """Why this rank's shards refuse a whole-matrix optimizer, or None; the buffers of
    cut matrices that can move onto owners go into ``to_move``."""
    for p in shards:
        sp = p._hsdp_sharded_param
        if not sp.trainable or len(sp.shape) != 2 or not _updates_as_matrix(optimizer, p):
            continue
        if not sp.slot.in_one_segment:
            why = _cannot_move(optimizer, sp)
            if why is None:
                if all(b is not sp.buffer for b in to_move):
                    to_move.append(sp.buffer)
                continue
            return (f"{type(optimizer).__name__} updates each matrix as a whole, and the "
                    f"parameter '{param_path(sp)}' {sp.shape} is cut into rows across "
                    f"{sp.inner_size * sp.parts} ranks; it cannot be moved onto one rank at "
                    f"the first step ({why}). Keep its matrices whole on one rank each: "
                    "fully_shard(module, shard_placement_fn=paddle_hsdp.owned_matrices()) "
                    "(paddle_hsdp.Owned() for this parameter; or whole on every rank: "
                    "paddle.distributed.Replicate()). Nothing was updated.")
        if getattr(p, "is_distributed", False) and \
                not getattr(optimizer, "handles_tensor_parallel_slices", False):
            return (f"{type(optimizer).__name__} updates each matrix as a whole, and the "
                    f"parameter '{param_path(sp)}' {sp.shape} is this rank's tensor-parallel "
                    "slice: each rank would orthogonalise its slice on its own. Leave it "
                    "to an elementwise update (Muon: muon_param_info_map), or train "
                    "without tensor parallelism. Nothing was updated.")
    ask = getattr(optimizer, "refusal", None)  # the optimizer's own (paddle_hsdp.Muon)
    return ask(shards) if callable(ask) else None
