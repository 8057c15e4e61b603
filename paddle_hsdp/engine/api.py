"""The user-facing API: ``fully_shard``, ``FSDPModule``, ``full_state_dict``.

Thin: it validates, builds an :class:`~paddle_hsdp.engine.unit.FSDPUnit` and registers hooks.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import numpy as np
import paddle
from paddle.distributed import Replicate, Shard

from ..comm import collectives as comm
from ..comm import gather_tags
from ..hints import expect_layer
from ..topology.mesh import resolve_mesh
from ..topology.placement import is_expert
from . import agreement, direct_calls, grad_hooks, hooks
from .context import context
from .controls import UnitControls, UnitPolicies
from .flex import sharded_state_dict
from .param import ShardedParam
from .reductions import wait_pending_reduces
from .placements import Owned
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, OuterSyncPolicy
from .registry import managed_param, owning_unit, param_path, registry, units_under
from .states import ParamState
from .unit import FSDPUnit, expect_everyone_in

if TYPE_CHECKING:
    from paddle.distributed import Placement, ProcessMesh
    from ..topology.mesh import HCGMesh, ProcessMeshGroups
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    # fully_shard's shard_placement_fn: a parameter's placement (None: the default)
    PlacementFn = Callable[[paddle.Tensor], Placement | None]

    # fully_shard mixes FSDPModule into the class of the module it shards (a Layer):
    # its methods run on that Layer
    _ShardedLayer = paddle.nn.Layer
else:
    _ShardedLayer = object

_L = TypeVar("_L", bound=paddle.nn.Layer)


class FSDPModule(_ShardedLayer):
    """Mixed into every module ``fully_shard`` returns (``isinstance`` works).

    The methods follow torch FSDP2. Where paddle_hsdp differs, the docstring says so.
    Methods with ``recurse`` apply to every FSDP module in the subtree (default True).
    """

    @property
    def _hsdp_unit(self) -> FSDPUnit:
        return self.__dict__["_hsdp_unit_"]

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        return units_under(self) if recurse else [self._hsdp_unit]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except BaseException:
            # A forward that raised leaves gathered params in the module slots, so
            # model.parameters() would give full tensors; put the shards back (local).
            hooks.abandon_forward(units_under(self))
            raise

    def sharded_state_dict(self, structured_name_prefix: str = "",
                           ) -> dict[str, ShardedWeight]:
        """This rank's shards as ``ShardedWeight``s for Paddle's ``flex_checkpoint.dcp``
        (see :func:`paddle_hsdp.engine.flex.sharded_state_dict`)."""
        for unit in units_under(self):
            unit.reshard(force=True)  # the shards are the truth; no stale gathered copy
        return sharded_state_dict(self, structured_name_prefix)

    def unshard(self, async_op: bool = False) -> comm.Handle | None:
        """Gather this unit's parameters now (a collective: call on every rank).

        With ``async_op=True`` returns a handle with ``wait()``; on gloo collectives
        complete before they return, so the handle is already done."""
        _check_bool(async_op, "unshard(async_op)")
        self._hsdp_unit.unshard()
        return comm.Handle.completed() if async_op else None

    def reshard(self) -> None:
        """Free the gathered parameters; modules see the local shards again."""
        self._hsdp_unit.reshard(force=True)

    def set_reshard_after_forward(self, value: bool, recurse: bool = True) -> None:
        """True: free gathered params after forward, gather again for backward (ZeRO-3)."""
        _check_bool(value, "set_reshard_after_forward(value)")
        _check_bool(recurse, "set_reshard_after_forward(recurse)")
        for unit in self._units(recurse):
            unit.controls.reshard_after_forward = bool(value)

    def set_reduce_grads_at_end_of_backward(self, value: bool, recurse: bool = True) -> None:
        """paddle_hsdp's addition. False (default): each unit reduce-scatters its grads
        as soon as its backward is done, so full-size grads of about one unit are alive
        at a time; this needs every rank to run the same units, whose inputs require
        grad alike. True: every unit reduces when the whole backward ends (all full-size
        grads alive at once), safe for models that cannot promise that."""
        _check_bool(value, "set_reduce_grads_at_end_of_backward(value)")
        _check_bool(recurse, "set_reduce_grads_at_end_of_backward(recurse)")
        for unit in self._units(recurse):
            unit.controls.reduce_grads_in_backward = not value

    def set_reshard_after_backward(self, value: bool, recurse: bool = True) -> None:
        """False: keep params gathered after backward for the next micro-step. They are
        resharded after the optimizer step in any case (the update makes them stale)."""
        _check_bool(value, "set_reshard_after_backward(value)")
        _check_bool(recurse, "set_reshard_after_backward(recurse)")
        for unit in self._units(recurse):
            unit.controls.reshard_after_backward = bool(value)

    def set_requires_gradient_sync(self, value: bool, recurse: bool = True) -> None:
        """False: no grad communication at the end of backward; full-size grads
        accumulate locally. Differs from torch: whatever is still unreduced at the
        optimizer step is reduce-scattered there, so a forgotten True never leaves
        replicas with unsynced grads."""
        _check_bool(value, "set_requires_gradient_sync(value)")
        _check_bool(recurse, "set_requires_gradient_sync(recurse)")
        for unit in self._units(recurse):
            unit.controls.requires_gradient_sync = bool(value)

    def set_requires_all_reduce(self, value: bool, recurse: bool = True) -> None:
        """Whether the step boundary runs the outer all-reduce. paddle_hsdp runs it once
        per optimizer step anyway (never per micro-step), so torch's pattern (False on
        non-last micro-steps, True on the last) gives exactly one all-reduce. False at
        the step itself: each replica steps on the mean grad of its own inner group."""
        _check_bool(value, "set_requires_all_reduce(value)")
        _check_bool(recurse, "set_requires_all_reduce(recurse)")
        for unit in self._units(recurse):
            unit.controls.requires_all_reduce = bool(value)

    def set_is_last_backward(self, value: bool) -> None:
        """Accepted for torch compatibility. paddle_hsdp finishes grad sync at the
        optimizer step boundary, so it needs no marking of the last backward; the flag
        is recorded on the units (``unit.controls.is_last_backward``) and changes nothing."""
        _check_bool(value, "set_is_last_backward(value)")
        for unit in units_under(self):
            unit.controls.is_last_backward = bool(value)

    def set_gradient_divide_factor(self, factor: float, recurse: bool = True) -> None:
        """Divide the summed grads by ``factor`` instead of the data-parallel size."""
        if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
                or not math.isfinite(factor) or factor <= 0):
            raise ValueError("set_gradient_divide_factor(factor): factor must be a finite "
                             f"number > 0, got {factor!r}")
        _check_bool(recurse, "set_gradient_divide_factor(recurse)")
        for unit in self._units(recurse):
            unit.controls.gradient_divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Gather these FSDP modules right after this one, before its forward."""
        self._hsdp_unit.controls.forward_prefetch = [
            _unit_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """Gather these FSDP modules right after this one, before its backward."""
        self._hsdp_unit.controls.backward_prefetch = [
            _unit_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_prefetch_count(self, forward: int = 1, backward: int = 1,
                           recurse: bool = True) -> None:
        """How many units ahead (in recorded forward order) to gather; 0 disables.
        paddle_hsdp's addition: the default is one unit ahead both ways."""
        for name, count in (("forward", forward), ("backward", backward)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
                raise ValueError(f"set_prefetch_count({name}=...): a whole number of units "
                                 f">= 0 (0 disables prefetch), got {count!r}")
        _check_bool(recurse, "set_prefetch_count(recurse)")
        for unit in self._units(recurse):
            unit.controls.forward_prefetch_count = int(forward)
            unit.controls.backward_prefetch_count = int(backward)


def _check_bool(value: object, what: str) -> None:
    """Strings such as "False" are truthy: accept real booleans only."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r} "
                        f"({type(value).__name__})")


def _unit_of(module: FSDPModule, what: str) -> FSDPUnit:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{what}: {type(module).__name__} is not an FSDP module "
                         "(call fully_shard on it first)")
    return module._hsdp_unit


ZERO_STAGES = {
    # stage: (reshard_after_forward, reshard_after_backward, requires_gradient_sync)
    3: (True, True, True),
    2: (False, True, True),
    1: (False, False, False),
}


def set_zero_stage(model: paddle.nn.Layer, stage: int) -> None:
    """One word for the three ZeRO levels, on every FSDP module under ``model``.

    * 3: params freed after forward and gathered again for backward; grads
      reduce-scattered every micro-step.
    * 2: params stay gathered from a unit's forward until its backward is done; grads
      reduce-scattered every micro-step.
    * 1: params stay gathered and full-size grads accumulate locally through the
      micro-steps; one reduce-scatter and one outer all-reduce at the optimizer step.
    Optimizer state is sharded at every level.
    """
    expect_layer(model, "set_zero_stage")
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"set_zero_stage: stage must be one of {sorted(ZERO_STAGES)}, "
                         f"got {stage!r}")
    if not isinstance(model, FSDPModule):
        raise ValueError("set_zero_stage: call fully_shard on the model first")
    forward, backward, sync = ZERO_STAGES[stage]
    for unit in units_under(model):
        unit.controls.reshard_after_forward = forward
        unit.controls.reshard_after_backward = backward
        unit.controls.requires_gradient_sync = sync


_fsdp_classes: dict[type, type] = {}


def _refuse_save_pretrained(self: paddle.nn.Layer, *args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(
        f"{type(self).__name__}.save_pretrained on a model sharded by fully_shard: it would "
        "write this rank's shards, or gather on the ranks that call it only. Call "
        "paddle_hsdp.integrations.paddleformers.export_pretrained(model, dir) on every rank "
        "(HSDPTrainer.save_model does): it gathers the full weights and writes what "
        "from_pretrained loads. Nothing was written.")


def _make_fsdp_class(module: paddle.nn.Layer) -> None:
    cls = type(module)
    if cls not in _fsdp_classes:
        body = {}
        if hasattr(cls, "save_pretrained"):
            # PaddleFormers' save_pretrained knows nothing of shards: refused on each
            # rank that calls it, before any collective (rank 0 alone included)
            body["save_pretrained"] = _refuse_save_pretrained
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), body)
    module.__class__ = _fsdp_classes[cls]


def _check_reshard_after_forward(value: object) -> bool | None:
    """None, True, False; Paddle's own fully_shard also takes 1 and 0 for True/False."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if isinstance(value, numbers.Integral):
        if value in (0, 1):
            return bool(value)
        raise NotImplementedError(
            f"reshard_after_forward={value!r}: only True, False (or 1, 0) or None are "
            "supported (torch's int reshard size is not implemented).")
    raise TypeError(f"reshard_after_forward must be None, True or False, got {value!r} "
                    f"({type(value).__name__})")


def _check_args(shard_placement_fn: PlacementFn | None, mp_policy: MixedPrecisionPolicy | None,
                offload_policy: OffloadPolicy | None,
                ignored_params: Iterable[paddle.Tensor] | None) -> list[paddle.Tensor]:
    """Check the arguments that need no model; return ``ignored_params`` as a list (a
    generator is read once, here)."""
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be a callable param -> placement or None, "
                        f"got {type(shard_placement_fn).__name__}")
    ignored = []
    if ignored_params is not None:
        if isinstance(ignored_params, paddle.Tensor) or not hasattr(ignored_params, "__iter__"):
            raise TypeError("ignored_params must be an iterable (set, list) of parameters, "
                            f"got {type(ignored_params).__name__}")
        ignored = list(ignored_params)
        bad = [type(p).__name__ for p in ignored if not isinstance(p, paddle.Tensor)]
        if bad:
            raise TypeError(f"ignored_params must hold parameters only, got {bad[0]}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a paddle_hsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError("offload_policy must be paddle_hsdp.OffloadPolicy or "
                        f"CPUOffloadPolicy, got {type(offload_policy).__name__}")
    return ignored


def _check_module(module: paddle.nn.Layer) -> None:
    if not isinstance(module, paddle.nn.Layer):
        expect_layer(module, "fully_shard")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; "
                         "apply it once per module.")
    for unit in registry.units:
        if any(sub is module for sub in unit.module.sublayers()):
            raise ValueError(
                f"fully_shard on a {type(module).__name__} whose parent "
                f"{type(unit.module).__name__} is already sharded: apply fully_shard "
                "bottom-up (children first, the root last).")
    if not any(True for _ in module.parameters()):
        raise ValueError(f"fully_shard on a {type(module).__name__} that has no parameters "
                         "at all: there is nothing to shard.")


def _check_sizes(claims: list[tuple]) -> None:
    """A zero-size parameter has no rows to shard and no storage to gather from."""
    for _, _, fqn, p, owner, _ in claims:
        if owner is None and 0 in list(p.shape):
            raise ValueError(
                f"fully_shard: parameter '{fqn}' has a zero-size shape {list(p.shape)}: "
                "there is nothing to shard. Leave it out with ignored_params=[...] (it stays "
                "as it is on every rank) or remove it from the model.")


def _ignored_in(module: paddle.nn.Layer, ignored: list) -> dict:
    """``{id: param}`` of the ``ignored`` params this call is about: those in
    ``module``'s subtree (others belong to other calls, as in torch). Raises for one a
    sub-module's ``fully_shard`` already sharded: this call can no longer leave it whole."""
    wanted = {id(p): p for p in ignored}
    subtree = {id(m) for m in module.sublayers(include_self=True)}
    for p in ignored:
        sp = managed_param(p)
        if sp is not None and id(owning_unit(sp).module) in subtree:
            raise ValueError(
                f"ignored_params holds {param_path(sp)} of {type(owning_unit(sp).module).__name__}, "
                "which an earlier fully_shard call on a sub-module already sharded; pass it "
                "in that call's ignored_params instead.")
    found = {}
    for sub in module.sublayers(include_self=True):
        for p in sub._parameters.values():
            if p is not None and id(p) in wanted:
                found[id(p)] = p
    return found


def _placements(module: paddle.nn.Layer, shard_placement_fn: PlacementFn | None,
                ignored: set) -> dict:
    """``{id(param): "replicate", "owned" or "shard"}``: params a placement keeps whole
    (on every rank, or on one: :class:`~.placements.Owned`), or cut into rows because
    the user asked ``Shard(0)`` (a whole-matrix optimizer then refuses them rather than
    moving them onto owners); checks the rest."""
    if shard_placement_fn is None:
        return {}
    out = {}
    for p in module.parameters():
        if id(p) in ignored or hasattr(p, "_hsdp_sharded_param"):
            continue
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        if isinstance(placement, Shard) and placement.get_dim() == 0:
            out[id(p)] = "shard"
            continue
        if isinstance(placement, Replicate):
            out[id(p)] = "replicate"
            continue
        if isinstance(placement, Owned):
            out[id(p)] = "owned"
            continue
        raise NotImplementedError(
            f"shard_placement_fn returned {placement!r} for {p.name}: supported are None "
            "(default), paddle.distributed.Shard(0), paddle_hsdp.Owned() (keep the "
            "parameter whole on one rank: Muon's matrices, paddle_hsdp.owned_matrices()) "
            "and paddle.distributed.Replicate() (whole on every rank).")
    return out


OUTER_SHARDING = ("none", "optim")


def _with_sharding_configs(mesh, mp_policy: MixedPrecisionPolicy | None,
                           outer_sync_policy: OuterSyncPolicy | None) -> tuple:
    """The policies with fleet's ``sharding_configs`` filled in where the call sets
    none (``fsdp_outer_compress`` where ``mp_policy`` compresses nothing,
    ``fsdp_outer_sync_every`` / ``fsdp_outer_optimizer`` where ``outer_sync_policy``
    is None)."""
    configured_mp, configured_outer = mesh.outer_policies()
    if configured_mp is not None:
        if mp_policy is None:
            mp_policy = configured_mp
        elif isinstance(mp_policy, MixedPrecisionPolicy) and mp_policy.outer_compress is None:
            mp_policy = dataclasses.replace(
                mp_policy, outer_compress=configured_mp.outer_compress,
                outer_compress_block=configured_mp.outer_compress_block)
    return mp_policy, configured_outer if outer_sync_policy is None else outer_sync_policy


def _check_outer_sync_policy(policy: object, outer_sharding: str, placements: dict,
                             offload_policy: OffloadPolicy | None) -> None:
    """What DiLoCo (``OuterSyncPolicy(every >= 2)``) cannot be combined with yet, refused
    before any collective."""
    if policy is None:
        return
    if not isinstance(policy, OuterSyncPolicy):
        raise TypeError("fully_shard(outer_sync_policy=...) must be None or a "
                        f"paddle_hsdp.OuterSyncPolicy, got {type(policy).__name__}")
    if not policy.trains_apart:
        return
    if outer_sharding == "optim":
        raise NotImplementedError(
            f"OuterSyncPolicy(every={policy.every}) (fsdp_outer_sync_every) with "
            "fsdp_outer_sharding='optim' (HFSDP): each replica's inner optimizer would hold "
            "1/O of the state, so replicas cannot step apart between outer syncs. Use "
            "fsdp_outer_sharding='none' with outer syncs every H steps, or every=1.")
    if "replicate" in placements.values():
        raise NotImplementedError(
            f"OuterSyncPolicy(every={policy.every}) with a Replicate() placement: a "
            "replicated parameter's grads are reduced over the whole FSDP group, across "
            "the replicas. Shard it (Shard(0), the default) or use every=1.")
    if getattr(offload_policy, "offloads", False):
        raise NotImplementedError(
            f"OuterSyncPolicy(every={policy.every}) with CPUOffloadPolicy: the outer sync "
            "reads the shards where the device holds them. Use one of the two.")


def _check_outer_sharding(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value in OUTER_SHARDING):
        return value
    raise ValueError(f"fully_shard(fsdp_outer_sharding=...) must be None (the mesh's: "
                     f"sharding_configs['fsdp_outer_sharding'] with mesh=None, 'none' on "
                     f"an explicit mesh), 'none' or 'optim', got {value!r}")


def fully_shard(module: _L, *, mesh: ProcessMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: PlacementFn | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: OffloadPolicy | None = None,
                ignored_params: Iterable[paddle.Tensor] | None = None,
                enable_tensor_fusion_and_overlap: bool = True,
                fsdp_outer_sharding: str | None = None,
                sync_module_states: bool = True,
                outer_sync_policy: OuterSyncPolicy | None = None) -> _L:
    """Shard ``module``'s parameters over the inner group, replicate over the outer.

    Call it bottom-up: each call makes one communication unit of the parameters not
    already owned by a sharded sub-module; call it last on the root. After the root
    call, ``module.parameters()`` yields this rank's shards: build the optimizer then.

    ``reshard_after_forward``: True frees the gathered parameters after forward and
    gathers again for backward (ZeRO-3); False keeps them until the unit's backward is
    done (ZeRO-2); None means True for every unit except the root. See also
    :func:`set_zero_stage`.
    ``shard_placement_fn(param)``: None or ``Shard(0)`` (default dim-0 blocks), or
    ``Replicate()`` (kept whole on every rank; grads all-reduced over the FSDP group).
    ``mp_policy``: a :class:`MixedPrecisionPolicy`. ``offload_policy``:
    :class:`OffloadPolicy` (none) or :class:`CPUOffloadPolicy`.
    ``ignored_params``: params left alone: not sharded, not synchronised (the user's);
    those outside ``module`` are not this call's business and are left out.
    ``enable_tensor_fusion_and_overlap`` (Paddle's own ``fully_shard`` keyword):
    True (default) issues prefetch all-gathers, reduce-scatters and outer all-reduces
    asynchronously and waits for each just before its result is needed; False makes
    every collective synchronous. Parameters are fused into buffers either way.
    ``fsdp_outer_sharding`` (paddle_hsdp's addition): ``"none"`` (HSDP: every outer
    replica keeps the optimizer state of its whole inner shard), ``"optim"`` (HFSDP:
    each outer replica's optimizer sees 1/O of it; the step's outer all-reduce becomes
    a reduce-scatter and, after the update, an all-gather; see docs/engine.md), or
    None: ``sharding_configs["fsdp_outer_sharding"]`` with ``mesh=None``, ``"none"``
    on an explicit mesh. With outer degree 1 both are the same.
    ``sync_module_states`` (torch FSDP's name): True (default) takes every parameter
    and buffer of the unit from the first rank of its FSDP group (each rank receives
    its own rows: one scatter per buffer over the inner group, then the outer
    broadcast; the module buffers by one broadcast per dtype), so ranks seeded apart
    or a checkpoint loaded on one rank still train one model. False: the weights are
    known to be equal on every rank; a fingerprint per tensor is compared instead, and
    the call refuses on every rank, naming the first tensor that differs
    (docs/engine.md, "Replicas agree before sharding").
    ``outer_sync_policy`` (paddle_hsdp's addition): an :class:`OuterSyncPolicy`;
    ``every=H >= 2`` trains the outer replicas apart and syncs them every H optimizer
    steps with an outer Nesterov step (DiLoCo, docs/knobs.md); None or ``every=1``:
    plain HSDP, the grads averaged at every step. Not with ``fsdp_outer_sharding=
    "optim"``, ``Replicate()`` placements or offloading.
    Every check runs before anything changes and before any collective (but the
    fingerprints' own), so a rejected call raises on every rank alike and leaves the
    model as it was.
    """
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward)
    _check_bool(enable_tensor_fusion_and_overlap,
                "fully_shard(enable_tensor_fusion_and_overlap)")
    _check_bool(sync_module_states, "fully_shard(sync_module_states)")
    ignored_list = _check_args(shard_placement_fn, mp_policy, offload_policy, ignored_params)
    outer_sharding = _check_outer_sharding(fsdp_outer_sharding)
    _check_module(module)
    ignored_here = _ignored_in(module, ignored_list)
    ignored = set(registry.ignored) | set(ignored_here)
    placements = _placements(module, shard_placement_fn, ignored)
    if isinstance(offload_policy, CPUOffloadPolicy):
        offload_policy.check_supported()
    resolved = resolve_mesh(mesh)  # may create an explicit mesh's groups (every rank alike)
    if outer_sharding is None:
        outer_sharding = resolved.outer_sharding()
    mp_policy, outer_sync_policy = _with_sharding_configs(resolved, mp_policy,
                                                          outer_sync_policy)
    _check_outer_sync_policy(outer_sync_policy, outer_sharding, placements, offload_policy)
    claims = _plan_claims(module, ignored, placements)
    _check_sizes(claims)
    module_buffers = agreement.module_buffers(module)
    if not sync_module_states:  # collectives of fingerprints only; nothing changed yet
        agreement.verify(_held_params(claims) + module_buffers, resolved,
                         f"fully_shard({type(module).__name__})")
    # Nothing changed so far; from here on the call acts.
    _build_unit(module, resolved, claims, placements, ignored_here, module_buffers,
                UnitPolicies(mp_policy, offload_policy, outer_sharding, outer_sync_policy),
                UnitControls(reshard_after_forward=reshard_after_forward,
                             overlap=bool(enable_tensor_fusion_and_overlap)),
                bool(sync_module_states))
    return module


def _build_unit(module: paddle.nn.Layer, resolved: HCGMesh | ProcessMeshGroups, claims: Any,
                placements: Any, ignored_here: Any, module_buffers: list,
                policies: UnitPolicies, controls: UnitControls,
                sync_module_states: bool) -> None:
    """fully_shard's acting half, every argument checked: the unit made, its
    parameters claimed and cut (the first collectives), its hooks installed."""
    registry.ignored.update(ignored_here)
    hooks.install()
    unit = FSDPUnit(module, registry.next_index, resolved, policies, controls)
    _apply_claims(unit, claims, placements)
    unit.build_buffers(placements)
    grad_hooks.watch_grads(unit)
    unit.shard_initial(sync_module_states, module_buffers)  # first collectives
    grad_hooks.watch_shard_grads(unit)
    registry.add(unit)
    hooks.register_unit_hooks(unit, registry.units)
    module.__dict__["_hsdp_unit_"] = unit
    _make_fsdp_class(module)
    for sp in unit.params:
        for sub, _ in sp.users:
            direct_calls.watch_direct_calls(sub, unit, registry.units)


def forget(model: paddle.nn.Layer) -> None:
    """Release ``model``'s fully_shard units: the engine keeps no reference to them, to
    their buffers or to the model (its hooks are removed), and pooled staging memory is
    dropped, so the model and its memory go when you drop your references. The model is
    not usable afterwards (its parameters are shards). Call it on every rank (the unit
    indices that tag collectives stay alike), not during a forward or backward."""
    units = registry.units_under(model)
    if not units:
        raise ValueError(f"forget: no fully_shard unit in this {type(model).__name__}")
    running = [u for u in units if u in context.backward.active or u.pending_calls]
    if context.backward.in_flight or running:
        raise RuntimeError(f"forget({type(model).__name__}) during a forward or backward (a "
                           "graph still holds its units): call it between steps")
    mine = {id(u) for u in units}
    for other in registry.units:
        if id(other) in mine:
            continue
        if id(model) in other.subtree_ids or any(
                id(u) in mine for u in other.borrowed + other.borrowed_by):
            raise ValueError(
                f"forget({type(model).__name__}): {other.label} outside it is sharded "
                "with it (it contains the model, or they share a tied parameter); forget "
                "the whole model that fully_shard was called on")
    wait_pending_reduces()  # nothing of theirs left in flight
    for unit in units:  # what is in flight lands before its buffers go
        unit.reshard(force=True)
        for buf in unit.buffers:
            buf.pieces.finish_rebuild()
            if buf.host is not None:
                buf.host.drop()
    gather_tags.forget_units(u.index for u in units)
    for unit in units:
        unit.hooks.remove()
        unit.module.__dict__.pop("_hsdp_unit_", None)
        for sp in unit.params:
            for sub, _ in sp.users:
                direct_calls.unwatch_direct_calls(sub, unit)
            # a Paddle tensor's attributes are invisible to Python's collector: a cycle
            # through one would never be freed
            sp.forget_shard()
        unit.leave_roots()
    registry.forget(units, list(model.parameters()))
    registry.storage_may_have_changed()
    context.staging.release()


def _plan_claims(module: paddle.nn.Layer, ignored: set, placements: dict) -> list[tuple]:
    """What :func:`_apply_claims` will do, without doing it: for every module slot of
    ``module``'s subtree, ``(sub, name, fqn, param, owner, segment)`` where ``owner`` is
    the ``(unit, ShardedParam)`` of a param another unit owns (tied weights), else None,
    and ``segment`` counts the sharded sub-modules met before the slot in
    ``named_sublayers`` order (see :func:`~paddle_hsdp.engine.unit.buffer_groups`)."""
    claims = []
    segment = 0
    for prefix, sub in module.named_sublayers(include_self=True):
        if sub is not module and "_hsdp_unit_" in sub.__dict__:
            segment += 1  # params after a sharded sub-module travel apart from those before
        for name, p in list(sub._parameters.items()):
            if p is None or hasattr(p, "_hsdp_sharded_param") or id(p) in ignored:
                continue  # empty slot, a shard param of a sub-unit, or ignored
            fqn = f"{prefix}.{name}" if prefix else name
            claims.append((sub, name, fqn, p, registry.owner_of.get(id(p)), segment))
    return claims


def _held_params(claims: list[tuple]) -> list[agreement.Held]:
    """The parameters this call will shard (not those another unit owns), once each,
    for the agreement check."""
    held, seen = [], set()
    for _, _, fqn, p, owner, _ in claims:
        if owner is None and id(p) not in seen:
            seen.add(id(p))
            held.append(agreement.Held(fqn, p, is_expert(p)))
    return held


def _apply_claims(unit: FSDPUnit, claims: list[tuple], placements: dict) -> None:
    """Take every planned param no unit owns yet; record every module slot that names
    it. Slots naming a param another unit owns (tied weights) are handed to that owner,
    and this unit will gather the owner with itself."""
    claimed: dict[int, ShardedParam] = {}
    for sub, name, fqn, p, owner, segment in claims:
        if owner is not None:
            owner_unit, sp = owner
            sp.users.append((sub, name))
            sub._parameters[name] = sp.full if owner_unit.state is ParamState.UNSHARDED \
                else sp.shard
            if owner_unit is not unit and owner_unit not in unit.borrowed:
                unit.borrowed.append(owner_unit)
                owner_unit.borrowed_by.append(unit)
            direct_calls.watch_direct_calls(sub, owner_unit, registry.units)
            continue
        if id(p) not in claimed:
            if placements.get(id(p)) == "replicate":
                claimed[id(p)] = ShardedParam(p, fqn, 1, 0)  # whole on every rank
            else:
                inner = unit.mesh.inner(is_expert(p))
                parts, part = unit.outer_parts(is_expert(p), not p.stop_gradient)
                claimed[id(p)] = ShardedParam(p, fqn, inner.nranks, inner.rank, parts, part)
            claimed[id(p)].segment = segment  # where it is first met
            claimed[id(p)].placement = placements.get(id(p))
        claimed[id(p)].users.append((sub, name))
    unit.params = list(claimed.values())
    for sp in unit.params:
        registry.owner_of[id(sp.full)] = (unit, sp)


@paddle.no_grad()
def full_state_dict(model: paddle.nn.Layer) -> dict[str, paddle.Tensor]:
    """``{name: full tensor}`` with exactly the keys of the unsharded model's
    ``state_dict()``: tied aliases and persistable buffers included, sharded params
    gathered from their (float32 master) shards, everything else copied. A collective
    (one all-gather per buffer): call it on every rank."""
    expect_layer(model, "full_state_dict")
    expect_everyone_in(units_under(model), "full_state_dict(model)")
    live = model._state_dict_impl(use_hook=False)
    out = model.state_dict()
    return {k: v.detach().clone() if v is live.get(k) else v for k, v in out.items()}


@paddle.no_grad()
def full_grads(model: paddle.nn.Layer) -> dict[str, paddle.Tensor | None]:
    """``{name: full gradient}`` as the shards hold it now (call
    ``finish_grad_sync`` first for the step's synced value). A collective."""
    expect_layer(model, "full_grads")
    expect_everyone_in(units_under(model), "full_grads(model)")
    return _gather_named(model, grads=True)


def _gather_named(model: paddle.nn.Layer, grads: bool) -> dict:
    full_of: dict[int, paddle.Tensor] = {}
    for unit in units_under(model):
        for buf in unit.buffers:
            if grads and not buf.trainable:
                continue
            for sp, full in zip(buf.params, buf.gather_full(grads=grads), strict=True):
                full_of[id(sp.shard)] = full
    own = (lambda p: p.grad) if grads else (lambda p: p.detach().clone())
    return {name: full_of.get(id(p), own(p)) for name, p in model.named_parameters()}
