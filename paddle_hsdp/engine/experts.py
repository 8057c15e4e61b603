"""Expert (MoE) parameters: which they are, and their global names in checkpoints.

With expert parallelism each EP rank builds only its *local* experts, so the same
structured name (``moe.experts.0.fc1.weight``) means a different expert on each EP
rank. ``mark_expert_params(experts, global_indices=[...])`` records which global expert
each local one is; checkpoints and ``sharded_state_dict`` then name expert tensors by
their global index, so a model saved with EP 2 loads with EP 1 (all experts local) and
back, and the consolidated export has the keys of a model holding every expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..hints import expect_layer
from .registry import managed_param

if TYPE_CHECKING:
    import paddle

_INDICES_ATTR = "_hsdp_global_expert_indices"


def mark_expert_params(layer: paddle.nn.Layer, global_indices: Sequence[int] | None = None,
                       ) -> None:
    """Flag every parameter of ``layer`` as an expert (MoE) parameter, the attribute
    Paddle's own engines read. Call it before ``fully_shard``: expert params get buffers
    of their own, sharded in the expert inner group.

    ``global_indices``: when ``layer``'s children are this rank's local experts (a
    ``LayerList``, children named ``0, 1, ...``), the global expert index of each, in
    child order, e.g. ``range(ep_rank * n_local, (ep_rank + 1) * n_local)``. Checkpoints
    then store child ``i`` under the name with ``global_indices[i]`` in its place."""
    expect_layer(layer, "mark_expert_params")
    sharded = [p.name for p in layer.parameters() if managed_param(p) is not None]
    if sharded:
        raise RuntimeError(
            f"mark_expert_params on a layer whose parameters are already sharded "
            f"({sharded[0]}, ...): its buffers were built as dense ones. Call "
            "mark_expert_params before fully_shard.")
    mapping = None if global_indices is None else _index_map(layer, global_indices)
    for p in layer.parameters():
        p.is_moe_param = True
        p.expert = True
    if mapping is not None:
        setattr(layer, _INDICES_ATTR, mapping)


def _index_map(layer: paddle.nn.Layer, global_indices: Sequence[int]) -> dict[str, str]:
    """``{local child name: global index}``, validated before anything is marked."""
    children = [name for name, _ in layer.named_children()]
    try:
        indices = [int(i) for i in global_indices]
    except (TypeError, ValueError):
        raise TypeError("mark_expert_params(global_indices=...) expects a sequence of "
                        f"non-negative ints, got {global_indices!r}") from None
    if len(indices) != len(children):
        raise ValueError(
            f"mark_expert_params: global_indices has {len(indices)} entries but the layer "
            f"has {len(children)} children (its local experts: {children}); give one "
            "global index per local expert, in child order")
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"mark_expert_params: global_indices must be distinct "
                         f"non-negative ints, got {indices}")
    return {child: str(index) for child, index in zip(children, indices, strict=True)}


def global_names(model: paddle.nn.Layer) -> dict[str, str]:
    """``{structured name prefix of a local expert: its global prefix}`` for every layer
    under ``model`` marked with ``global_indices`` (empty when none is)."""
    renames = {}
    for prefix, sub in model.named_sublayers(include_self=True):
        mapping = getattr(sub, _INDICES_ATTR, None)
        if not mapping:
            continue
        base = f"{prefix}." if prefix else ""
        for child, index in mapping.items():
            renames[base + child + "."] = base + index + "."
    return renames


def rename(name: str, renames: dict[str, str]) -> str:
    """``name`` with its local expert prefix (if any) replaced by the global one."""
    for local, glob in renames.items():
        if name.startswith(local):
            return glob + name[len(local):]
    return name


def names_and_aliases(model: paddle.nn.Layer,
                      ) -> tuple[dict[str, paddle.Tensor], dict[str, str]]:
    """``(canonical, aliases)``: ``{name: tensor}`` for every distinct parameter and
    persistable buffer (first name wins), ``{alias: canonical}`` for tied names. Local
    experts marked with global indices are named by their global index."""
    renames = global_names(model)
    canonical: dict[str, paddle.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}  # id of its ShardedParam (else of the tensor) -> first name
    for name, value in model._state_dict_impl(use_hook=False).items():
        name = rename(name, renames)
        sp = managed_param(value)
        key = id(sp) if sp is not None else id(value)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        canonical[name] = value
    return canonical, aliases
