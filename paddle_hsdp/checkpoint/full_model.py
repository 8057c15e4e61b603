"""The full model on one rank: every sharded block, tensor-parallel slice and pipeline
stage joined, under the checkpoint's names (engine/saved_names.py). What an export
writes; ``consolidate`` builds the same from a checkpoint's files.

1. Within each sharding group: the managed parameters gathered from their shards (one
   all-gather per buffer, as ``full_state_dict``).
2. Within each mp group: each tensor-parallel parameter's slices all-gathered and
   joined along its ``split_axis`` (checkpoint/placement.py; a model whose own merge is
   not that is refused there).
3. Within the pipeline group of global rank 0: each later stage sends its tensors to
   rank 0 (point to point; the other pipeline groups, which hold copies, send nothing).

Local experts of different EP ranks are not joined: under expert parallelism (degree
above 1) this is refused, naming ``save_checkpoint`` + ``consolidate``, which are.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from ..comm import collectives as comm
from ..engine.holdings import dtype_name, original_and_local, trainable_names
from ..engine.saved_names import saved_names
from ..patches.state_dict import full_values
from ..topology.placement import ModelAxes, split_axis
from .format import gather_json
from .tp_merge import check_merge_is_concat

_TAG = "export"


def refusal(model: paddle.nn.Layer, axes: ModelAxes, call: str) -> str | None:
    """Why the full model cannot be joined here (alike on every rank), or None."""
    experts = [n for n, p in model.named_parameters()
               if getattr(p, "is_moe_param", False) or getattr(p, "expert", False)]
    if axes.ep_degree > 1 and experts:
        return (f"{call}: expert parallelism (ep_degree {axes.ep_degree}, e.g. {experts[0]!r}): "
                "each EP rank holds other experts and they are not joined here; allowed: "
                "ep_degree 1. Use paddle_hsdp.save_checkpoint (experts under their global "
                "indices) and `python -m paddle_hsdp.checkpoint consolidate`. Nothing was "
                "written.")
    return None


@paddle.no_grad()
def full_model(model: paddle.nn.Layer, call: str = "full_model",
               trainable_only: bool = False) -> dict | None:
    """``{checkpoint name: full tensor}`` (tied aliases included) on global rank 0, None
    on every other rank. A collective: call it on every rank. ``trainable_only``: the
    frozen parameters (``stop_gradient``) left out (LoRA adapters alone)."""
    axes = ModelAxes()
    why = refusal(model, axes, call)
    if why is not None:
        raise NotImplementedError(why)
    canonical, aliases = saved_names(model)
    if trainable_only:
        canonical, aliases = trainable_names(canonical, aliases)
    split = {}  # {name: (split axis, local shape)} of mp-split tensors
    if axes.mp_degree > 1:
        for name, value in canonical.items():
            original, local = original_and_local(value)
            axis = split_axis(original)
            if axis is not None:
                split[name] = (axis, local)
    if split:
        check_merge_is_concat(model, split, axes.mp_degree)
    tensors = full_values(canonical)
    for name in sorted(split):
        tensors[name] = _joined_over_mp(tensors[name], split[name][0], axes, name)
    if axes.pp_degree > 1:
        tensors = _joined_over_stages(tensors, axes)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    for alias, name in aliases.items():
        tensors.setdefault(alias, tensors[name])
    return tensors


def _joined_over_mp(tensor: paddle.Tensor, axis: int, axes: ModelAxes,
                    name: str) -> paddle.Tensor:
    group = axes.hcg.get_model_parallel_group()
    flat = tensor.reshape([-1])
    out = paddle.empty([flat.shape[0] * group.nranks], dtype=flat.dtype)
    comm.all_gather_into(out, flat, group, tag=_TAG, what=f"{name}: its tensor-parallel slices")
    parts = [p.reshape(tensor.shape) for p in out.split(group.nranks)]
    return paddle.concat(parts, axis=axis)


def _joined_over_stages(tensors: dict, axes: ModelAxes) -> dict:
    """Every stage's tensors on the pipeline group of global rank 0, at its stage 0."""
    group = axes.hcg.get_pipe_parallel_group()
    if 0 not in group.ranks:  # a copy of rank 0's group: every member skips alike
        return tensors
    listing = {n: [list(t.shape), dtype_name(t.dtype)] for n, t in sorted(tensors.items())}
    stages = gather_json(listing, "gathering the pipeline stages' tensors", group=group)
    dst = group.ranks[0]
    for stage, (src, names) in enumerate(zip(group.ranks, stages)):
        if stage == 0:
            continue
        for name, (shape, dtype) in names.items():
            if dist.get_rank() == src:
                comm.send(tensors[name].contiguous(), dst, group, tag=_TAG, what=name)
            elif dist.get_rank() == dst:
                received = paddle.empty(shape, dtype=dtype)
                comm.recv(received, src, group, tag=_TAG, what=name)
                tensors.setdefault(name, received)  # a shared layer: stage 0's copy stays
    return tensors
