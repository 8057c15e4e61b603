"""``Layer.state_dict`` / ``set_state_dict`` on sharded models: full tensors out,
this rank's blocks in.

Paddle users save with ``paddle.save(model.state_dict(), path)`` and load with
``model.set_state_dict(paddle.load(path))``. On a sharded model the module slots hold
this rank's shards under the original names, so without help the first call would save
shards that a plain model skips with only a warning, and the second would skip every
sharded parameter the same way. :func:`install` wraps both methods of
``paddle.nn.Layer``:

* ``state_dict()``: every entry that is an HSDP-managed parameter is replaced by the
  full tensor, gathered from the shards (the float32 masters under mixed precision),
  with the keys and tied aliases of the unsharded model. **A collective**: call it on
  every rank (save on one). Unmanaged entries are Paddle's own.
* ``set_state_dict(full_dict)``: each managed parameter takes its block of the full
  tensor; no collective. A managed key whose value does not have the full shape raises
  ``ValueError`` before anything is written (Paddle would skip it with a warning).
  Missing and unexpected keys are reported as Paddle reports them.

The scalable save path (each rank writes its shards) is the checkpoint module's job.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

import paddle

from ..engine.registry import managed_param, owning_unit, registry
from ..engine.unit import expect_everyone_in
from .patching import replace

if TYPE_CHECKING:
    import numpy as np

    from ..engine.param import ShardedParam

_installed = False


def _live_entries(layer: paddle.nn.Layer, args: tuple, kwargs: dict) -> dict:
    """The same keys ``state_dict(*args, **kwargs)`` produces, mapped to the tensors in
    the module slots (never detached), so managed entries can be found."""
    if (len(args) >= 2 and isinstance(args[1], str)) or "prefix" in kwargs:  # torch form
        prefix = kwargs.get("prefix", args[1] if len(args) >= 2 else "")
        return layer._state_dict_impl(OrderedDict(), True, prefix, False, False, True)
    bound = inspect.signature(type(layer)._state_dict_impl).bind(layer, *args, **kwargs)
    a = bound.arguments
    return layer._state_dict_impl(
        OrderedDict(), a.get("include_sublayers", True), a.get("structured_name_prefix", ""),
        a.get("include_non_persistable_buffer", False), False, True)


@paddle.no_grad()
def gather_full(sharded_params: Iterable[ShardedParam]) -> dict[int, paddle.Tensor]:
    """``{id(ShardedParam): full tensor}`` for ``sharded_params``: one all-gather per
    buffer that holds any of them, units in registration order (the same on every
    rank, since every rank asks for the same keys)."""
    wanted = {id(sp) for sp in sharded_params}
    units = {}
    for sp in sharded_params:
        unit = owning_unit(sp)
        units[unit.index] = unit
    out = {}
    for index in sorted(units):
        for buf in units[index].buffers:
            if any(id(sp) in wanted for sp in buf.params):
                for sp, full in zip(buf.params, buf.gather_full()):
                    out[id(sp)] = full
    return out


def full_values(named: dict[str, paddle.Tensor]) -> dict[str, paddle.Tensor]:
    """``{name: full value}`` of a model's tensors on this rank: the sharded parameters
    gathered (:func:`gather_full`, a collective), the others copied."""
    full_of = gather_full([sp for v in named.values() if (sp := managed_param(v)) is not None])
    return {name: full_of[id(sp)] if (sp := managed_param(v)) is not None else v.detach().clone()
            for name, v in named.items()}


def _patch_state_dict(layer_cls: type[paddle.nn.Layer]) -> None:
    original = layer_cls.state_dict

    @functools.wraps(original)
    def state_dict(self: paddle.nn.Layer, *args: Any, **kwargs: Any) -> dict:
        result = original(self, *args, **kwargs)
        if not registry.units:
            return result
        live = _live_entries(self, args, kwargs)
        managed = {key: sp for key, value in live.items()
                   if key in result and (sp := managed_param(value)) is not None}
        if not managed:
            return result
        expect_everyone_in([owning_unit(sp) for sp in managed.values()],
                           f"state_dict() of a sharded {type(self).__name__}")
        full = gather_full(list({id(sp): sp for sp in managed.values()}.values()))
        for key, sp in managed.items():
            result[key] = full[id(sp)]
        return result

    replace(layer_cls, "state_dict", state_dict,
            "sharded parameters appear as full tensors (gathered), as in the unsharded model")


def _patch_set_state_dict(layer_cls: type[paddle.nn.Layer]) -> None:
    original = layer_cls.set_state_dict

    @functools.wraps(original)
    def set_state_dict(self: paddle.nn.Layer, state_dict: dict, use_structured_name: bool = True,
                       *args: Any, **kwargs: Any) -> Any:
        if not registry.units:
            return original(self, state_dict, use_structured_name, *args, **kwargs)
        live = self._state_dict_impl(use_hook=False)
        blocks, units, whole = {}, {}, []
        for key, value in live.items():
            sp = managed_param(value)
            name = key if use_structured_name else value.name
            if sp is None or name not in state_dict:
                continue
            blocks[name] = _block_of(sp, name, state_dict[name])
            if sp.parts > 1:  # the other outer sub-blocks of its inner block too
                whole.append((sp, name))
            unit = owning_unit(sp)
            units[unit.index] = unit
        # Every check passed: from here on the call writes. Slots must hold the
        # shards for Paddle's loader to write blocks into them (local, no collective).
        for unit in units.values():
            unit.reshard(force=True)
            unit.finish_rebuild()  # an outer all-gather in flight would overwrite them
        result = original(self, {**state_dict, **blocks}, use_structured_name, *args, **kwargs)
        for sp, name in whole:
            value = _as_tensor(state_dict[name])
            registry.buffer_of(sp).storage.write_block(sp, sp.rows_of(value, sub=False))
        return result

    replace(layer_cls, "set_state_dict", set_state_dict,
            "full tensors load into this rank's blocks of sharded parameters")


def _as_tensor(value: paddle.Tensor | np.ndarray) -> paddle.Tensor:
    return value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)


def _block_of(sp: ShardedParam, key: str, value: paddle.Tensor | np.ndarray) -> paddle.Tensor:
    """The rows of a full tensor this rank's shard parameter holds, in its shape."""
    value = _as_tensor(value)
    if list(value.shape) != list(sp.shape):
        raise ValueError(
            f"set_state_dict: '{key}' has shape {list(value.shape)}, but the sharded model "
            f"expects the full parameter, shape {list(sp.shape)}: pass a full state dict "
            "(what model.state_dict() returns on a sharded model too). Nothing was loaded.")
    return sp.rows_of(value, sub=True)


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_state_dict(paddle.nn.Layer)
    _patch_set_state_dict(paddle.nn.Layer)
    _installed = True
