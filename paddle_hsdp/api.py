"""The user-facing API: ``fully_shard``, ``FSDPModule``, ``full_state_dict``.

Thin: it validates, builds an :class:`~paddle_hsdp.unit.FSDPUnit` and registers hooks.
"""

from __future__ import annotations

import paddle

from . import hooks
from .mesh import resolve_mesh
from .param import ShardedParam
from .unit import FSDPUnit, UnitState, _is_expert

# Every unit in registration order (bottom-up), and who owns which original param.
_units: list[FSDPUnit] = []
_owner_of: dict[int, tuple[FSDPUnit, ShardedParam]] = {}


class FSDPModule:
    """Mixed into every module ``fully_shard`` returns (``isinstance`` works)."""

    @property
    def _hsdp_unit(self) -> FSDPUnit:
        return self.__dict__["_hsdp_unit_"]

    def unshard(self) -> None:
        """Gather this unit's parameters now (a collective: call on every rank)."""
        self._hsdp_unit.unshard()

    def reshard(self) -> None:
        """Free the gathered parameters; modules see the local shards again."""
        self._hsdp_unit.reshard()


_fsdp_classes: dict[type, type] = {}


def _make_fsdp_class(module) -> None:
    cls = type(module)
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _fsdp_classes[cls]


def _reject_unimplemented(**kwargs) -> None:
    for name, value in kwargs.items():
        if value is not None:
            raise NotImplementedError(
                f"fully_shard({name}=...) is not implemented yet; pass {name}=None.")


def _check_module(module) -> None:
    if not isinstance(module, paddle.nn.Layer):
        raise TypeError(f"fully_shard expects a paddle.nn.Layer, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; "
                         "apply it once per module.")
    for unit in _units:
        if any(sub is module for sub in unit.module.sublayers()):
            raise ValueError(
                f"fully_shard on a {type(module).__name__} whose parent "
                f"{type(unit.module).__name__} is already sharded: apply fully_shard "
                "bottom-up (children first, the root last).")
    if not any(True for _ in module.parameters()):
        raise ValueError(f"fully_shard on a {type(module).__name__} that has no parameters "
                         "at all: there is nothing to shard.")


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=None, offload_policy=None, ignored_params=None):
    """Shard ``module``'s parameters over the inner group, replicate over the outer.

    Call it bottom-up: each call makes one communication unit of the parameters not
    already owned by a sharded sub-module; call it last on the root. After the root
    call, ``module.parameters()`` yields this rank's shards: build the optimizer then.

    ``reshard_after_forward``: True frees the gathered parameters after forward and
    gathers again for backward (ZeRO-3); False keeps them until the unit's backward is
    done (ZeRO-2); None means True for every unit except the root.
    All checks run before any collective, so a misuse raises on every rank alike.
    """
    _reject_unimplemented(shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                          offload_policy=offload_policy, ignored_params=ignored_params)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward!r}: only True, False or None "
            "are supported (an int reshard size is not implemented).")
    _check_module(module)
    mesh = resolve_mesh(mesh)
    hooks.install()
    unit = FSDPUnit(module, len(_units), mesh, reshard_after_forward)
    _claim_params(unit, module)
    unit.build_buffers()
    unit.shard_initial()  # first collective: broadcast over the outer group
    _units.append(unit)
    hooks.register_unit_hooks(unit, _units)
    module.__dict__["_hsdp_unit_"] = unit
    _make_fsdp_class(module)
    return module


def _claim_params(unit: FSDPUnit, module) -> None:
    """Take every parameter of ``module``'s subtree that no unit owns yet; record every
    module slot that names it. Slots naming a param another unit owns (tied weights)
    are handed to that owner, and this unit will gather the owner with itself."""
    claimed: dict[int, ShardedParam] = {}
    for prefix, sub in module.named_sublayers(include_self=True):
        for name, p in list(sub._parameters.items()):
            if p is None or hasattr(p, "_hsdp_sharded_param"):
                continue  # empty slot, or a shard param of a sub-unit
            fqn = f"{prefix}.{name}" if prefix else name
            owner = _owner_of.get(id(p))
            if owner is not None:
                owner_unit, sp = owner
                sp.users.append((sub, name))
                sub._parameters[name] = sp.full if owner_unit.state is UnitState.UNSHARDED \
                    else sp.shard
                if owner_unit is not unit and owner_unit not in unit.borrowed:
                    unit.borrowed.append(owner_unit)
                continue
            if id(p) not in claimed:
                inner = unit.mesh.inner(_is_expert(p))
                claimed[id(p)] = ShardedParam(p, fqn, inner.nranks, inner.rank)
            claimed[id(p)].users.append((sub, name))
    unit.params = list(claimed.values())
    for sp in unit.params:
        _owner_of[id(sp.full)] = (unit, sp)


def mark_expert_params(layer) -> None:
    """Flag every parameter of ``layer`` as an expert (MoE) parameter, the attribute
    Paddle's own engines read. Call it before ``fully_shard``: expert params get buffers
    of their own, sharded in the expert inner group."""
    for p in layer.parameters():
        p.is_moe_param = True
        p.expert = True


def _units_under(model) -> list[FSDPUnit]:
    subtree = set(id(m) for m in model.sublayers(include_self=True))
    return [u for u in _units if id(u.module) in subtree]


@paddle.no_grad()
def full_state_dict(model) -> dict[str, paddle.Tensor]:
    """``{name: full tensor}`` with the names ``model.named_parameters()`` gave before
    sharding. A collective (one all-gather per buffer): call it on every rank."""
    return _gather_named(model, grads=False)


@paddle.no_grad()
def full_grads(model) -> dict[str, paddle.Tensor | None]:
    """``{name: full gradient}`` as the shards hold it now (call
    ``finish_grad_sync`` first for the step's synced value). A collective."""
    return _gather_named(model, grads=True)


def _gather_named(model, grads: bool) -> dict:
    full_of: dict[int, paddle.Tensor] = {}
    for unit in _units_under(model):
        for buf in unit.buffers:
            if grads and not buf.trainable:
                continue
            for sp, full in zip(buf.params, buf.gather_full(grads=grads)):
                full_of[id(sp.shard)] = full
    own = (lambda p: p.grad) if grads else (lambda p: p.detach().clone())
    return {name: full_of.get(id(p), own(p)) for name, p in model.named_parameters()}


def memory_report(model) -> dict[str, int]:
    """Bytes the engine holds for ``model`` on this rank, now: local ``shard`` params,
    ``grad`` (shard grads plus any full-size grads alive), ``gathered`` full params."""
    total = {"shard": 0, "grad": 0, "gathered": 0}
    for unit in _units_under(model):
        for key, value in unit.held_bytes().items():
            total[key] += value
    return total
