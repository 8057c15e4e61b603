"""An optimizer's state as an unsharded run has it, and an optimizer built before
``fully_shard`` (issue 64).

* :func:`cut_full_state`: ``Optimizer.set_state_dict`` given a full state (saved by an
  unsharded run, or :func:`full_optimizer_state_dict`) keeps each rank's rows of each
  per-parameter tensor (its HFSDP sub-block with outer sub-shards), as Paddle's sharding
  optimizer and torch's ``set_optimizer_state_dict(full_state_dict=True)`` do; a
  tensor of neither the full nor the shard's shape is refused, naming the key.
* :func:`full_optimizer_state_dict`: the other way: every sharded parameter's states
  gathered to full tensors under the same keys (a collective: one all-gather per
  buffer and state, over the outer group first where the state is cut in pieces).
* :func:`adopt_shards`: an optimizer built from the full parameters before the root's
  ``fully_shard`` holds parameters that now are empty; its parameter lists take the
  shards instead (the same names, the same per-parameter attributes), and state it
  already made is cut to the shard's rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from ..comm import collectives as comm
from .optimizers import (ensure_accumulators, optimizer_params, sharded_params_of, states_of,
                         unwrap_optimizer)
from .registry import managed_param, param_path, units_under

if TYPE_CHECKING:
    from .buffer import ShardBuffer
    from .param import ShardedParam


def _owner_of_key(key: str, by_name: dict[str, paddle.Tensor]) -> paddle.Tensor | None:
    """The shard whose accumulator ``key`` is (Paddle names them
    ``<param name>_<state>_<n>``), or None."""
    for i, c in enumerate(key):
        if c == "_" and key[:i] in by_name:
            return by_name[key[:i]]
    return None


def _per_param_entries(optimizer: paddle.optimizer.Optimizer, state_dict: dict[str, Any],
                       ) -> list[tuple[str, str | None, paddle.Tensor, Any]]:
    """``(key, master-weights key or None, shard, value)`` of every tensor of
    ``state_dict`` that belongs to one of the optimizer's shards."""
    shards = {p.name: p for p in sharded_params_of(unwrap_optimizer(optimizer))}
    found: list[tuple[str, str | None, paddle.Tensor, Any]] = [
        ("master_weights", name, shards[name], value)
        for name, value in (state_dict.get("master_weights") or {}).items() if name in shards]
    for key, value in state_dict.items():
        if hasattr(value, "shape"):
            owner = _owner_of_key(key, shards)
            if owner is not None:
                found.append((key, None, owner, value))
    return found


def cut_full_state(optimizer: paddle.optimizer.Optimizer, state_dict: dict[str, Any],
                   ) -> dict[str, Any]:
    """``state_dict`` with every full-shape tensor of a sharded parameter replaced by
    this rank's rows of it (the shard's shape); shard-shaped tensors and scalars (beta
    powers, steps) as they are. Raises ``ValueError`` for any other shape, naming the
    key, before anything is loaded. No collective."""
    adopt_shards(optimizer)
    entries = _per_param_entries(optimizer, state_dict)
    if entries:
        # made now, so the state loads into them at once (Paddle would hold it back
        # until the first step) and full_optimizer_state_dict can read it; not for a
        # state without per-parameter tensors (a peer's before its first step), which
        # Paddle would refuse for the accumulators it does not hold
        ensure_accumulators(unwrap_optimizer(optimizer))
    out = dict(state_dict)
    masters = dict(state_dict.get("master_weights") or {})
    for key, master, p, value in entries:
        sp = p._hsdp_sharded_param
        shape = list(value.shape)
        if math.prod(shape) == 1 or shape == list(p.shape):
            if master:
                masters[master] = value if isinstance(value, paddle.Tensor) \
                    else paddle.to_tensor(value)
            continue
        if shape != sp.shape:
            name = f"master_weights['{master}']" if master else f"'{key}'"
            raise ValueError(
                f"set_state_dict: the optimizer state {name} of parameter "
                f"'{param_path(sp)}' ({p.name}) has shape {shape}, neither the full parameter's "
                f"{sp.shape} nor this rank's shard's {list(p.shape)}. Pass the state of "
                "an unsharded run or of paddle_hsdp.full_optimizer_state_dict (full "
                "shapes), or this rank's own (shard shapes); a checkpoint of another "
                "layout loads with paddle_hsdp.load_checkpoint(path, model, optimizer). "
                "Nothing was loaded.")
        tensor = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
        rows = sp.rows_of(tensor, sub=True).clone()
        if master:
            masters[master] = rows
        else:
            out[key] = rows
    if masters:
        out["master_weights"] = _into_existing_masters(optimizer, masters)
    return out


def _into_existing_masters(optimizer: paddle.optimizer.Optimizer,
                           masters: dict[str, Any]) -> dict[str, Any]:
    """Master weights written into the ones the optimizer made (after every check):
    Paddle keys a parameter's accumulators by its master weight's tensor name, which
    a loaded tensor would not carry."""
    existing = getattr(unwrap_optimizer(optimizer), "_master_weights", None) or {}
    out = dict(masters)
    for name, value in masters.items():
        own = existing.get(name)
        if own is not None and isinstance(value, paddle.Tensor) and \
                list(own.shape) == list(value.shape):
            paddle.assign(value.astype(own.dtype), output=own)
            out[name] = own
    return out


@paddle.no_grad()
def full_optimizer_state_dict(model: paddle.nn.Layer, optimizer: paddle.optimizer.Optimizer,
                              rank0_only: bool = False) -> dict[str, Any]:
    """``optimizer.state_dict()`` as an unsharded run of ``model`` has it: every
    per-parameter state of a sharded parameter (moments, master weights) full-size,
    under the same keys; scalars and the scheduler's state as they are. Loads into an
    unsharded optimizer, or back into a sharded one in any layout
    (``optimizer.set_state_dict``). A collective: call it on every rank. With
    ``rank0_only=True`` only global rank 0 gets the dict (the others ``{}``); every
    rank still takes part in the gathers."""
    from .unit import expect_everyone_in  # (unit imports this package's lower modules)

    if not isinstance(rank0_only, (bool, np.bool_)):
        raise TypeError(f"full_optimizer_state_dict(rank0_only) must be True or False, "
                        f"got {rank0_only!r}")
    inner_opt = unwrap_optimizer(optimizer)
    adopt_shards(inner_opt)
    units = units_under(model)
    mine = {id(sp.shard) for unit in units for sp in unit.params if hasattr(sp, "shard")}
    expect_everyone_in(units, "full_optimizer_state_dict(model, optimizer)")
    state = optimizer.state_dict()
    full: dict[str, Any] = dict(state)
    masters = dict(state.get("master_weights") or {})
    shards = [p for p in sharded_params_of(inner_opt) if id(p) in mine]
    by_shard = {id(p): states_of(inner_opt, p) for p in shards}
    for unit in units:  # registration order: the same on every rank
        for buf in unit.buffers:
            held = [sp for sp in buf.params if id(getattr(sp, "shard", None)) in by_shard]
            if held:
                _gather_buffer_states(buf, held, by_shard, full, masters,
                                      _held_by_one_replica(inner_opt, buf, held))
    if masters:
        full["master_weights"] = masters
    if rank0_only and paddle.distributed.get_rank() != 0:
        return {}
    return full


def _held_by_one_replica(optimizer: paddle.optimizer.Optimizer, buf: ShardBuffer,
                         held: list[ShardedParam]) -> dict[str, str]:
    """``{param name: state key}`` of the states of ``held`` that one outer replica
    keeps (Muon's shared matrices' momentum, issue 65): the same on every rank of the
    outer group (the owners are chosen alike there)."""
    owners = getattr(optimizer, "momentum_owners", None) or {}
    masters = getattr(optimizer, "_master_weights", None) or {}
    # (Paddle's accumulator name: keyed by the master weight's name where there is one)
    return {sp.shard.name: f"{getattr(masters.get(sp.shard.name), 'name', sp.shard.name)}"
            "_moment1_0" for sp in held if sp.shard.name in owners}


def _gather_buffer_states(buf: ShardBuffer, held: list[ShardedParam],
                          by_shard: dict[int, dict], full: dict[str, Any],
                          masters: dict[str, Any], alone: dict[str, str]) -> None:
    """One buffer's per-parameter states gathered full-size into ``full`` under their
    keys (master weights into ``masters``): a collective over its inner group; where
    one outer replica keeps a parameter's momentum (``alone``), summed over the outer
    group too (the others hold none: zeros)."""
    for name in _state_names(held, by_shard, bool(alone)):
        tensors = [by_shard[id(sp.shard)].get(name) for sp in held]
        lone = set(alone) if name == "moment1" else set()
        values = _gather_states(buf, held, tensors, name, lone)
        for sp, t, value in zip(held, tensors, values, strict=True):
            if value is None:
                continue
            if name == "master_weight":
                masters[sp.shard.name] = value
            elif t is not None:
                full[t.name] = value
            elif sp.shard.name in lone:
                full[alone[sp.shard.name]] = value


def _state_names(held: list[ShardedParam], by_shard: dict[int, dict],
                 alone: bool = False) -> list[str]:
    """The per-parameter states (not scalars) the buffer's parameters have, sorted (the
    same on every rank: the same optimizer over the same shards; ``alone``: momentum
    one replica keeps, named on every rank)."""
    names = {"moment1"} if alone else set()
    for sp in held:
        for name, t in by_shard[id(sp.shard)].items():
            if list(t.shape) == list(sp.shard.shape) and math.prod(sp.shape) > 1:
                names.add(name)
    return sorted(names)


def _gather_states(buf: ShardBuffer, held: list[ShardedParam],
                   tensors: list[paddle.Tensor | None], name: str,
                   lone: set[str] | frozenset = frozenset(),
                   ) -> list[paddle.Tensor | None]:
    """Each ``held`` parameter's state ``name`` full-size: this rank's pieces laid out
    as the buffer's flat shard, gathered over the outer group (outer sub-shards; summed
    over it where one replica keeps some parameters' of it: ``lone``, their names; the
    others' then come from outer rank 0), then the inner group; None where the
    parameter has no such state."""
    dtype = next((t.dtype for t in tensors if t is not None), None)
    if dtype is None:  # none held here: every rank must still join in the same dtype
        dtype = _lone_state_dtype(held) if lone else paddle.float32
    flat = paddle.zeros([buf.shard_numel], dtype)
    for sp, t in zip(held, tensors, strict=True):
        # (summed over the replicas: a state every replica holds from the first only)
        if t is not None and sp.sub_numel and \
                (not lone or sp.shard.name in lone or buf.outer.rank == 0):
            paddle.assign(t.reshape([-1]).astype(dtype), output=sp.piece_of(flat))
    what = f"{buf.describe()}: the optimizer state '{name}'"
    if buf.parts > 1:
        flat = buf.pieces.outer_gather(flat, what=name)
    elif lone:
        comm.all_reduce(flat, buf.outer, what=what)
    out = paddle.empty([buf.padded_numel], dtype)
    comm.all_gather_into(out, flat, buf.inner, tag="optimizer state", what=what)
    return [None if t is None and not lone else sp.full_of(out).clone()
            for sp, t in zip(held, tensors, strict=True)]


def _lone_state_dtype(held: list[ShardedParam]) -> paddle.dtype:
    """The dtype of momentum another replica keeps alone (Muon's: float32 for
    low-precision shards, else theirs), for a rank that holds none of a buffer's: its
    all-reduce must match the owner's."""
    dtype = held[0].shard.dtype if held else paddle.float32
    return dtype if dtype in (paddle.float32, paddle.float64) else paddle.float32


def adopt_shards(optimizer: paddle.optimizer.Optimizer) -> list[str]:
    """Swap every full parameter ``fully_shard`` replaced in the optimizer's parameter
    lists for its shard (same name, same attributes: the shard carries them); state the
    optimizer already made for it is cut to the shard's rows. Local, alike on every
    rank. Returns the swapped parameters' names."""
    inner = unwrap_optimizer(optimizer)
    swap = {}
    for p in optimizer_params(inner):
        sp = managed_param(p)
        if sp is not None and hasattr(sp, "shard") and p is not sp.shard:
            swap[id(p)] = sp
    if not swap:
        return []
    _swap_in(inner._parameter_list, swap)
    groups = getattr(inner, "_param_groups", None)
    if groups is not None and groups is not inner._parameter_list:
        _swap_in(groups, swap)
    for sp in swap.values():
        _cut_existing_state(inner, sp)
    return [param_path(sp) for sp in swap.values()]


def _swap_in(params: list, swap: dict[int, ShardedParam]) -> None:
    """In place: a flat list of parameters, or a list of parameter-group dicts."""
    for i, entry in enumerate(params):
        if isinstance(entry, dict):
            entry["params"] = [swap[id(p)].shard if id(p) in swap else p
                               for p in entry["params"]]
        elif id(entry) in swap:
            params[i] = swap[id(entry)].shard


def _cut_existing_state(optimizer: paddle.optimizer.Optimizer, sp: ShardedParam) -> None:
    """Accumulators or a master weight made for the full parameter (a step ran before
    fully_shard) keep the shard's rows of it."""
    name = sp.shard.name
    for table in getattr(optimizer, "_accumulators", {}).values():
        value = table.get(name)
        if value is not None and list(value.shape) == sp.shape and math.prod(sp.shape) > 1:
            table[name] = sp.rows_of(value, sub=True).clone()
    masters = getattr(optimizer, "_master_weights", None) or {}
    value = masters.get(name)
    if value is not None and list(value.shape) == sp.shape:
        masters[name] = sp.rows_of(value, sub=True).clone()
