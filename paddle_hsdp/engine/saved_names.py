"""The names a model's tensors are saved under: the same in every layout
(engine/holdings.py states them for the checkpoint).

* the unsharded model's structured names, tied aliases recorded once
  (:func:`paddle_hsdp.engine.experts.names_and_aliases`);
* local experts marked with ``global_indices`` under their global index (same place);
* a PaddleFormers pipeline model (``...ForCausalLMPipe``, a ``PipelinePretrainedModel``)
  under the names of its one-process model (``model.layers.3.mlp.up_proj.weight``,
  not the stage's ``4.mlp.up_proj.weight``), from PaddleFormers' own name prefixes, so a
  pipeline checkpoint loads into the plain ``...ForCausalLM`` and back. A plain Paddle
  ``PipelineLayer`` keeps its names (``<global layer index>.<name>``): every stage count
  gives a layer the same index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .experts import names_and_aliases

if TYPE_CHECKING:
    import paddle


def saved_names(model: paddle.nn.Layer) -> tuple[dict, dict]:
    """``(canonical, aliases)`` as :func:`names_and_aliases` gives them, renamed for a
    PaddleFormers pipeline model (see the module docstring)."""
    canonical, aliases = names_and_aliases(model)
    rename = pipeline_renamer(model)
    if rename is None:
        return canonical, aliases
    renamed = {}
    for name, value in canonical.items():
        single = rename(name)
        if single in renamed:  # a layer shared by two of this stage's positions
            aliases[name] = single
            continue
        renamed[single] = value
    return renamed, {rename(a): rename(c) for a, c in aliases.items()}


def pipeline_renamer(model: paddle.nn.Layer) -> Callable[[str], str] | None:
    """``name -> one-process name`` for a PaddleFormers pipeline model (duck-typed on its
    ``get_sequential_name_prefixes`` / ``get_shardlayer_prefix``), else None."""
    prefixes_of = getattr(model, "get_sequential_name_prefixes", None)
    shared_prefix = getattr(model, "get_shardlayer_prefix", None)
    if prefixes_of is None or shared_prefix is None:
        return None
    prefixes = prefixes_of()

    def rename(name: str) -> str:
        parts = name.split(".")
        if parts[0] in ("shared_layers", "local_shared_layers"):
            head, rest = shared_prefix(parts, _shared_desc(parts[0])), parts[2:]
        elif parts[0].isdigit() and len(parts) > 1 and parts[1].isdigit():
            # virtual pipeline stages: "<chunk offset>.<index in chunk>.<name>"
            head, rest = prefixes[str(int(parts[0]) + int(parts[1]))], parts[2:]
        elif parts[0].isdigit():
            head, rest = prefixes[parts[0]], parts[1:]
        else:
            raise ValueError(f"{type(model).__name__}: {name!r} is not a pipeline layer's "
                             "parameter name (expected '<layer index>.<name>' or "
                             "'shared_layers.<key>.<name>')")
        return ".".join(([head] if head else []) + rest)

    return rename


def _shared_desc(kind: str) -> type:
    from paddle.distributed.fleet.meta_parallel import LocalSharedLayerDesc, SharedLayerDesc

    return SharedLayerDesc if kind == "shared_layers" else LocalSharedLayerDesc
