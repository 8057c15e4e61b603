"""Plain sub-modules called on their own while their unit is sharded
(``model.embed_tokens(ids)`` outside the model's forward, ``model.lm_head(h)`` in a
generation loop): the call gathers the unit first, so it never computes on a shard."""

from __future__ import annotations

import paddle

from ..comm import gather_tags
from . import hooks
from .context import context
from .states import ParamState
from .unit import FSDPUnit


def watch_direct_calls(module, unit: FSDPUnit, all_units: list[FSDPUnit]) -> None:
    """Let ``module`` (a plain sub-module whose slots hold ``unit``'s params) be called
    on its own while ``unit`` is sharded: ``model.embed_tokens(ids)`` outside the model's
    forward, ``model.lm_head(h)`` in a generation loop. Without this the call would
    compute on this rank's shard. The call gathers the unit first (a collective: every
    rank must make it), wraps the outputs so backward gathers again, and reshards per
    the unit's policy. Unit modules are covered by their own hooks."""
    if "_hsdp_unit_" in module.__dict__:
        return
    owners = module.__dict__.get("_hsdp_direct_owners")
    if owners is None:
        owners = module.__dict__["_hsdp_direct_owners"] = []
        module.__dict__["_hsdp_direct_stack"] = []
        module.__dict__["_hsdp_direct_handles"] = [
            module.register_forward_pre_hook(_direct_pre_forward(all_units)),
            module.register_forward_post_hook(_direct_post_forward)]
    if unit not in owners:
        owners.append(unit)


def unwatch_direct_calls(module, unit: FSDPUnit) -> None:
    """``unit`` is forgotten: ``module``'s direct calls no longer gather it (its hooks go
    with its last owner)."""
    owners = module.__dict__.get("_hsdp_direct_owners")
    if owners is None or unit not in owners:
        return
    owners.remove(unit)
    if not owners:
        for handle in module.__dict__.pop("_hsdp_direct_handles"):
            handle.remove()
        for name in ("_hsdp_direct_owners", "_hsdp_direct_stack"):
            module.__dict__.pop(name)


def _direct_pre_forward(all_units):
    def pre_forward(module, inputs):
        gathered = [u for u in module.__dict__["_hsdp_direct_owners"]
                    if u.state is not ParamState.UNSHARDED]
        module.__dict__["_hsdp_direct_stack"].append(gathered)
        for u in gathered:
            if u.root() is None:  # never ran: make the root that ends its backward
                hooks.make_root_state(_outermost_unit(u, all_units), all_units)
            u.unshard()
            u.pin()
    return pre_forward


def _direct_post_forward(module, inputs, outputs):
    gathered = module.__dict__["_hsdp_direct_stack"].pop()
    grad_on = paddle.is_grad_enabled()
    for u in gathered:
        u.unpin()
        if grad_on:
            outputs = hooks.wrap_tensors(hooks.on_pre_backward, u, outputs)
        if context.backward.depth == 0 and (not grad_on or u.should_reshard_after_forward()):
            u.reshard()
    if gathered and not grad_on and context.backward.depth == 0:
        gather_tags.raise_pending()  # generation: lm_head(h) called alone, no step
    return outputs


def _outermost_unit(unit: FSDPUnit, all_units: list[FSDPUnit]) -> FSDPUnit:
    for outer in reversed(all_units):  # registered bottom-up: the root comes last
        if outer is unit or id(unit.module) in outer.subtree_ids:
            return outer
    return unit
