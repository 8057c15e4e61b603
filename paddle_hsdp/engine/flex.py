"""The ``flex_checkpoint`` bridge: this rank's shards (and its optimizer's states) as
``ShardedWeight``s for Paddle's ``flex_checkpoint.dcp`` save/load, each a view of the
unpadded rows at the parameter's global offset (its tensor-parallel slice's place in
the full tensor, as Paddle's own mp layers give it, plus its row offset), so a dcp
load writes straight into the shard storage. ``FSDPModule.sharded_state_dict`` gives the model's; the
``AdamW.sharded_state_dict`` patch (:mod:`paddle_hsdp.patches.flex_optimizer`) the
optimizer's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from ..topology.placement import ModelAxes
from .experts import names_and_aliases
from .optimizers import ensure_accumulators, optimizer_params, states_of, unwrap_optimizer
from .registry import managed_param, registry

if TYPE_CHECKING:
    import paddle


def sharded_state_dict(model: paddle.nn.Layer, structured_name_prefix: str = "",
                       ) -> dict[str, ShardedWeight]:
    """``{name: ShardedWeight}`` for Paddle's ``flex_checkpoint.dcp`` save/load: each
    managed parameter as this rank's unpadded rows (a view of the shard storage, so a
    dcp load writes straight into it) at its global offset (with its tensor-parallel
    slice's place in the full tensor); everything else whole (an mp slice at its place).
    Outer replicas describe the same pieces; dcp keeps one. With outer sub-shards
    (``fsdp_outer_sharding="optim"``) each rank describes the sub-block its optimizer
    sees, distinct on every rank; since a dcp load writes only those, the rest of each
    shard is rebuilt (one outer all-gather per buffer) before the next read of it.
    Tied aliases are left out (their one tensor is saved under the first name)."""
    canonical, _ = names_and_aliases(model)
    axes = ModelAxes()
    out, rebuild = {}, []
    for name, value in canonical.items():
        key = structured_name_prefix + name
        sp = managed_param(value)
        if sp is None:
            place = axes.place(value, value.shape)
            out[key] = ShardedWeight(key, value, tuple(place.local_shape),
                                     tuple(place.full_shape), tuple(place.offset))
            continue
        place = axes.place(sp.full, sp.shape)
        start, count = sp.row_range(sub=True)
        buf = registry.buffer_of(sp)
        if buf.parts > 1 and buf not in rebuild:
            rebuild.append(buf)
        if count == 0:
            continue  # this rank's block is all padding
        local = buf.storage.flat[sp.slot.flat_offset:sp.slot.flat_offset + count * sp.row_numel]
        local = local.reshape([count] + sp.rest)
        local.name = sp.shard.name
        offset, size = place.rows(start, count)
        out[key] = ShardedWeight(key, local, tuple(size), tuple(place.full_shape),
                                 tuple(offset))
    for buf in rebuild:  # after the views above: a load may write them
        buf.pieces.owe_rebuild()
    return out


def optimizer_sharded_state_dict(optimizer: paddle.optimizer.Optimizer,
                                 model_sharded_state_dict: dict[str, ShardedWeight],
                                 ) -> dict[str, ShardedWeight]:
    """The optimizer's state as ``ShardedWeight``s, in the form Paddle's own
    ``AdamW.sharded_state_dict`` gives (``{param key}.moment1_0``, ``.beta1_pow_acc_0``,
    ..., ``.w_0`` for a master weight), each row-shaped state a view of its unpadded
    rows at the parameter's global offset, so a dcp load writes straight into it. Keys
    follow ``model_sharded_state_dict`` (from ``model.sharded_state_dict()``); states of
    a parameter whose block is all padding on this rank are left out, like the block."""
    optimizer = unwrap_optimizer(optimizer)
    ensure_accumulators(optimizer)
    key_of: dict[str, str] = {}
    for model_key, weight in sorted(model_sharded_state_dict.items()):
        key_of.setdefault(weight.local_tensor.name, model_key)  # tied: the first key owns it
    out = {}
    for p in optimizer_params(optimizer):
        key = key_of.get(p.name)
        if key is None:
            continue
        ref = model_sharded_state_dict[key]
        for acc, t in sorted(states_of(optimizer, p).items()):
            name = f"{key}.{'w' if acc == 'master_weight' else acc}_0"  # Paddle's names
            if list(t.shape) == list(p.shape):  # rows like its parameter's
                rows = int(ref.local_shape[0]) if ref.local_shape else 1
                local = t if rows == int(t.shape[0]) else t[0:rows]
                out[name] = ShardedWeight(name, local, tuple(ref.local_shape),
                                          tuple(ref.global_shape), tuple(ref.global_offset))
            else:  # a scalar state (beta powers): whole, the same wherever it is held
                shape = tuple(int(d) for d in t.shape)
                out[name] = ShardedWeight(name, t, shape, shape, (0,) * len(shape))
    return out
