"""A replica's state, streamed from a donor replica to the ones that need it.

Per local rank ``i``, over the round's outer group ``i``: the donor's rank ``i`` sends
its own shard state, one tensor at a time (every unit buffer's flat shard, the
parameters and buffers the engine does not shard, then each optimizer-state tensor),
so no rank ever holds more than its own shard plus one tensor in flight. What is not
a tensor (names, shapes and dtypes, the step count, the RNG state, an LR scheduler's
and the user's extra state) goes first, pickled, through the coordinator's store.

Members of the round that are neither donor nor receiver take part in each broadcast
with a scratch tensor (a broadcast needs every member). Receivers take the model's
tensors in place and hand the optimizer its state once everything arrived and the
checksums of every tensor agree across the group (one all-reduce of max, one of
min): a receiver whose transfer fails holds a state it must not use, and says so at
the next round (``fresh``).
"""

from __future__ import annotations

import math
import pickle
import zlib

import numpy as np
import paddle

from ..comm import collectives as comm
from ..engine.registry import registry
from .rounds import FaultToleranceError
from .store import key


def _model_tensors(model) -> list[tuple[str, paddle.Tensor]]:
    """The tensors a replica's model state is made of, in one order on every replica."""
    out = []
    for unit in registry.units_under(model):  # outer sub-shards: refused by attach
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


def stream_state(store, round_number: int, group, donor: int, receiving: bool, model,
                 optimizer, extra: dict) -> dict | None:
    """Copy the donor replica's state to this rank (if ``receiving``). Every member of
    ``group`` calls it. ``extra``: the donor's plain state (step, RNG, scheduler, user);
    returns the donor's ``extra`` on a receiver, None elsewhere."""
    donor_rank = group.virtual_rank(donor)
    sending = group.replica == donor
    meta_key = key("r", round_number, "state", group.local_rank)
    model_tensors = _model_tensors(model)
    if sending:
        opt_tensors, opt_rest = _flatten(optimizer.state_dict())
        meta = {"model": [(n, list(t.shape), _dtype(t)) for n, t in model_tensors],
                "optimizer": [(p, list(t.shape), _dtype(t)) for p, t in opt_tensors],
                "optimizer_rest": opt_rest, "extra": extra}
        store.set(meta_key, pickle.dumps(meta))
    else:
        meta = pickle.loads(store.get(meta_key))
        opt_tensors = None
    mine = [(n, list(t.shape), _dtype(t)) for n, t in model_tensors]
    if mine != meta["model"]:
        first = next(((a, b) for a, b in zip(mine, meta["model"]) if a != b),
                     f"{len(mine)} tensors here, {len(meta['model'])} there")
        raise FaultToleranceError(
            f"paddle_hsdp.ft: replica {group.replica} cannot take replica {donor}'s state: "
            "their models differ (names, shapes or dtypes of the shards; the inner degree "
            f"or the sharding must be the same). First difference: {first}")
    sums = []

    def move(target):
        if math.prod(target.shape) == 0:  # nothing to send (a rank's empty share of a buffer)
            return
        comm.broadcast(target, src=donor_rank, group=group, tag="ft state")
        sums.append(_checksum(target))

    for name, tensor in model_tensors:  # a receiver takes it in place
        move(tensor if sending or receiving else paddle.zeros(tensor.shape, tensor.dtype))
    received_opt = []
    for i, (path, shape, dtype) in enumerate(meta["optimizer"]):
        target = opt_tensors[i][1] if sending else paddle.zeros(shape, dtype)
        move(target)
        received_opt.append((tuple(path), target))
    _check_identical(sums, group)
    if not receiving:
        return None
    optimizer.set_state_dict(_unflatten(received_opt, meta["optimizer_rest"]))
    registry.storage_may_have_changed()
    for unit in registry.units_under(model):
        unit.reshard(force=True)  # params kept gathered hold the old values
    return meta["extra"]


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
