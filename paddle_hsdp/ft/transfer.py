"""A replica's state, streamed from a donor replica to the ones that need it.

Per local rank ``i``, over the round's outer group ``i``: the donor's rank ``i`` sends
its own shard state, one tensor at a time (every unit buffer's flat shard, the
parameters and buffers the engine does not shard, then each optimizer-state tensor),
so no rank ever holds more than its own shard plus one tensor in flight. What is not
a tensor (names, shapes and dtypes, the step count, the RNG state, an LR scheduler's
and the user's extra state) goes first, as JSON, through the job's shared data on etcd.

With shared optimizer pieces (HFSDP with redundancy, :mod:`.pieces`) the model comes
from the donor and each piece's optimizer state from a holder of that piece.

Members of the round that are neither donor nor receiver take part in each broadcast
with a scratch tensor (a broadcast needs every member). Receivers take the model's
tensors in place and hand the optimizer its state once everything arrived and the
checksums of every tensor agree across the group (one all-reduce of max, one of
min): a receiver whose transfer fails holds a state it must not use, and says so at
the next round (``fresh``).
"""

from __future__ import annotations

import math
import json
import zlib

import numpy as np
import paddle

from ..comm import collectives as comm
from ..engine.registry import registry
from .protocol import FaultToleranceError
from .store import key


def _model_tensors(model) -> list[tuple[str, paddle.Tensor]]:
    """The tensors a replica's model state is made of, in one order on every replica."""
    out = []
    for unit in registry.units_under(model):  # shared pieces: every piece is in the flat
        for buf in unit.buffers:
            out.append((f"unit{unit.index}.buffer{buf.index}", buf.flat))
    for name, param in model.named_parameters():
        if not hasattr(param, "_hsdp_sharded_param"):  # ignored params: kept whole
            out.append((f"param.{name}", param))
    for name, buffer in model.named_buffers():
        out.append((f"buffer.{name}", buffer))
    return out


def _flatten(state: dict, prefix: tuple = ()) -> tuple[list, dict]:
    """An optimizer state dict as (path, tensor) pairs and the rest (plain values)."""
    tensors, rest = [], {}
    for name in sorted(state):
        value = state[name]
        if isinstance(value, paddle.Tensor):
            tensors.append((prefix + (name,), value))
        elif isinstance(value, dict) and value and \
                all(isinstance(v, paddle.Tensor) for v in value.values()):
            sub, _ = _flatten(value, prefix + (name,))
            tensors.extend(sub)
        else:
            rest[name] = value
    return tensors, rest


def _unflatten(pairs, rest: dict) -> dict:
    out = dict(rest)
    for path, tensor in pairs:
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    return out


def _dtype(tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")  # what paddle.zeros takes


def _checksum(tensor) -> int:
    data = np.ascontiguousarray(tensor.numpy())
    return zlib.crc32(data.view(np.uint8).reshape(-1)) if data.size else 0


def stream_state(store, record, group, model, optimizer, extra: dict) -> tuple[dict | None, int]:
    """Copy round ``record``'s donor state to this rank if its replica is a receiver.
    Every member of ``group`` calls it. ``extra``: this replica's plain state (step,
    RNG, scheduler, user; the donor's is sent); returns the donor's ``extra`` on a
    receiver, None elsewhere, and the bytes of tensors this rank broadcast or took
    (for the log). With shared optimizer pieces (``group.pieces``,
    :mod:`.pieces`) each piece's optimizer state comes from a holder of that piece."""
    donor, replica = record.donor, group.replica
    receiving = replica in record.receivers
    model_tensors = _model_tensors(model)
    meta = _exchange_meta(store, record, (group.local_rank, "model"), replica == donor,
                          lambda: {"model": _described(model_tensors), "extra": extra})
    mine = _described(model_tensors)
    if mine != meta["model"]:
        first = next(((a, b) for a, b in zip(mine, meta["model"]) if a != b),
                     f"{len(mine)} tensors here, {len(meta['model'])} there")
        raise FaultToleranceError(
            f"paddle_hsdp.ft: replica {replica} cannot take replica {donor}'s state: "
            "their models differ (names, shapes or dtypes of the shards; the inner degree "
            f"or the sharding must be the same). First difference: {first}")
    sums, moved = [], [0]

    def move(target, src):
        if math.prod(target.shape) == 0:  # nothing to send (a rank's empty share of a buffer)
            return
        comm.broadcast(target, src=group.virtual_rank(src), group=group, tag="ft state")
        sums.append(_checksum(target))
        moved[0] += math.prod(target.shape) * target.element_size()

    for _, tensor in model_tensors:  # a receiver takes it in place
        move(tensor if replica == donor or receiving
             else paddle.zeros(tensor.shape, tensor.dtype), donor)
    received = None
    plan = group.pieces
    for q, piece_donor, takers in _optimizer_phases(record, plan):
        sending, taking = replica == piece_donor, replica in takers
        opt_tensors, opt_rest = _flatten(optimizer.state_dict()) if sending else (None, None)
        opt_meta = _exchange_meta(
            store, record, (group.local_rank, "optimizer", q), sending,
            lambda: {"tensors": _described(opt_tensors), "rest": opt_rest})
        pairs = []
        for i, (path, shape, dtype) in enumerate(opt_meta["tensors"]):
            target = opt_tensors[i][1] if sending else paddle.zeros(shape, dtype)
            move(target, piece_donor)
            pairs.append((tuple(path), target))
        if taking:
            received = (pairs, opt_meta["rest"])
    _check_identical(sums, group)
    if not receiving:
        return None, moved[0]
    if received is not None:
        optimizer.set_state_dict(_unflatten(*received))
    registry.storage_may_have_changed()
    for unit in registry.units_under(model):
        unit.reshard(force=True)  # params kept gathered hold the old values
    return meta["extra"], moved[0]


def _described(tensors) -> list:
    """``(name, shape, dtype)`` of each named tensor: what a receiver allocates."""
    return [[n, list(t.shape), _dtype(t)] for n, t in tensors]  # as JSON gives it back


def _exchange_meta(store, record, where: tuple, sending: bool, build) -> dict:
    """What is not a tensor goes as JSON through the store (never a pickle: what a
    trainer reads from the network must not run code): the sender writes ``build()``
    under round ``record``'s key ``where``, the others read it; a reader stops waiting
    once a failure is announced in the round (the sender may be dead). The receiver
    gets the JSON round trip (tuples become lists); so does the sender, alike."""
    meta_key = key("r", record.number, "state", *where)
    if sending:
        text = json.dumps(build(), default=_plain)
        store.set(meta_key, text)
        return json.loads(text)

    def abort():
        if store.failed(record.number):
            raise FaultToleranceError(f"paddle_hsdp.ft: a failure was announced while "
                                      f"{meta_key} was awaited")
    return json.loads(store.get(meta_key, abort=abort))


def _plain(value):
    """JSON for the numpy scalars a scheduler's or optimizer's state may hold."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"paddle_hsdp.ft: {type(value).__name__} in a replica's state cannot "
                    "go to a rejoining group as JSON")


def _optimizer_phases(record, plan) -> list[tuple[int, int, list[int]]]:
    """``(piece, its donor, the replicas taking it)`` for each optimizer-state copy of
    the round: the donor's whole state to every receiver, or with shared pieces one
    copy per piece that has a receiver."""
    if plan is None or plan.parts == 1:
        return [(0, record.donor, list(record.receivers))]
    phases = []
    for q in range(plan.parts):
        takers = plan.receivers(record, q)
        if takers:
            phases.append((q, plan.donor(q), takers))
    return phases


def _check_identical(sums: list[int], group) -> None:
    """Every member holds what the donor sent, bit for bit (checksums of each tensor)."""
    if not sums:
        return
    values = paddle.to_tensor(np.array(sums, dtype="int64"))
    high, low = values.clone(), -values
    comm.all_reduce(high, group, op="max", tag="ft state check")
    comm.all_reduce(low, group, op="max", tag="ft state check")
    if not np.array_equal(high.numpy(), -low.numpy()):
        raise FaultToleranceError(
            f"paddle_hsdp.ft: the state copied from the donor differs between replicas "
            f"after the transfer ({int((high.numpy() != -low.numpy()).sum())} tensors)")
