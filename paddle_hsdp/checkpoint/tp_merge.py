"""A model's own tensor-parallel merge, where its class has one (PaddleFormers'
``_get_tensor_parallel_mappings(config, is_split=False)``), must be what checkpoints and
exports assume of an mp-split parameter: the concatenation of the mp slices along its
``split_axis`` (topology/placement.py). A fused weight whose slices interleave its
parts (a fused QKV) is not, and is refused, naming the parameter. PaddleFormers 1.2's
Llama has no such mappings (its mp layers' marks are the whole story)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import paddle


def check_merge_is_concat(model: paddle.nn.Layer, split: dict, mp_degree: int) -> None:
    """Refuse a model whose own tensor-parallel merge of a parameter of ``split``
    (``{name: (its split axis, its local shape)}``) is not the concatenation along
    its split axis, e.g. a fused QKV weight whose mp slices interleave q, k and v:
    probed on index arrays, no data moved."""
    for name, (action, axis, shape) in merge_actions(model, split).items():
        numel = int(np.prod(shape))
        slices = [np.arange(numel, dtype=np.int64).reshape(shape) + r * numel
                  for r in range(mp_degree)]
        merged = np.asarray(action(slices))
        if not np.array_equal(merged, np.concatenate(slices, axis=axis)):
            raise NotImplementedError(
                f"{name}: {type(model).__name__}'s tensor-parallel merge of this parameter is "
                f"not a concatenation along split_axis {axis} (a fused weight whose mp slices "
                "interleave its parts): checkpoints record slices as blocks of one tensor, so "
                "this model cannot be saved or exported across tensor-parallel layouts. Build "
                "it without the fused weight (e.g. fuse_attention_qkv=False).")


def merge_actions(model: paddle.nn.Layer, split: dict) -> dict:
    """``{name: (merge action, split axis, local shape)}`` for the parameters of
    ``split`` (``{name: (split axis, local shape)}``) that the model class's own
    tensor-parallel mappings cover (PaddleFormers' ``_get_tensor_parallel_mappings(config,
    is_split=False)``); empty when the class has none (PaddleFormers 1.2's Llama: its mp
    layers' marks are the whole story)."""
    getter = getattr(type(model), "_get_tensor_parallel_mappings", None)
    config = getattr(model, "config", None)
    if getter is None or config is None or not split:
        return {}
    try:
        actions = getter(config, is_split=False)
    except NotImplementedError:
        return {}
    resolve = getattr(type(model), "_resolve_prefix_keys", None)
    keys = resolve(list(actions), list(split), True) if resolve is not None else {}
    out = {}
    for base, action in actions.items():
        name = keys.get(base, base)
        if name in split:
            axis, shape = split[name]
            out[name] = (action, axis, [int(d) for d in shape])
    return out
