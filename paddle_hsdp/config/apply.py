"""``apply_config(model, config)``: shard, wrap, recompute and cast a whole model from
one YAML file (or dict), the way MindSpeed's FSDP2 config and torch wrap policies do.

Order of work, so that a bad config fails on every rank alike before any collective:
load and check the config, check it against the world (or the live fleet topology),
match every pattern, plan the units; only then initialise fleet (if needed), mark
experts, wrap recomputed modules and call ``fully_shard`` bottom-up, the root last.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology as fleet_topology
from paddle.distributed.fleet.utils import recompute

from ..engine.api import fully_shard, set_zero_stage
from ..engine.placements import owned_matrices
from ..optim.muon import muon_param_info
from ..engine.policies import CPUOffloadPolicy
from ..hints import expect_layer
from ..topology.fleet import MOE_ORDER_HINT
from .plan import Plan, build_plan, mp_policy_of, outer_sync_policy_of, resolve_modules
from .schema import (AUTO, ConfigError, load_config, ranks_per_node_from_env,
                     resolve_degrees)

if TYPE_CHECKING:
    import os

    from ..topology.fleet import HSDPHybridCommunicateGroup
    from .schema import HSDPConfig

logger = logging.getLogger(__name__)


def apply_config(model: paddle.nn.Layer, config: str | os.PathLike | dict | HSDPConfig,
                 ) -> tuple[paddle.nn.Layer, Plan]:
    """Shard ``model`` as ``config`` (a YAML path, a dict or an ``HSDPConfig``) says;
    return ``(model, plan)``, ``str(plan)`` being the ``plan`` command's table. A
    collective (``fully_shard`` is): call it on every rank with the same config."""
    expect_layer(model, "apply_config")
    cfg = load_config(config)
    outer, inner, expert_inner, expert_outer = topology_of(cfg)
    outer_sharding = outer_sharding_of(cfg)
    choice = resolve_modules(model, cfg)
    choice.mark_experts()
    plan = build_plan(model, cfg, choice, outer=outer, inner=inner, expert_inner=expert_inner,
                      expert_outer=expert_outer, source=cfg.source,
                      outer_sharding=outer_sharding)
    # Nothing collective so far; from here on every rank acts.
    init_fleet_if_needed(outer, inner, outer_sharding)
    for _, module in choice.recompute:
        _recompute_forward(module, cfg.use_reentrant)
    kwargs: dict[str, Any] = {"mp_policy": mp_policy_of(cfg),
              "offload_policy": CPUOffloadPolicy(pin_memory=cfg.pin_memory)
              if cfg.offload_to_cpu else None,
              "ignored_params": choice.ignored_params() or None,
              "fsdp_outer_sharding": outer_sharding,
              "sync_module_states": cfg.sync_module_states,
              "outer_sync_policy": outer_sync_policy_of(cfg)}
    if cfg.owned_matrices:  # Muon's matrices whole on one rank each
        kwargs["shard_placement_fn"] = owned_matrices(info=muon_param_info(model))
    for _, module in choice.wrap:
        fully_shard(module, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    if cfg.zero_stage is not None:
        set_zero_stage(model, cfg.zero_stage)
    model.set_prefetch_count(forward=cfg.num_to_forward_prefetch,
                             backward=cfg.num_to_backward_prefetch)
    logger.info("apply_config(%s): %d units, outer %d x inner %d", cfg.source,
                len(plan.units), outer, inner)
    return model, plan


# ---------------------------------------------------------------- topology
def live_hcg() -> HSDPHybridCommunicateGroup | None:
    """fleet's hybrid communicate group, or None before ``fleet.init``."""
    return fleet_topology._HYBRID_PARALLEL_GROUP


def topology_of(cfg: HSDPConfig) -> tuple[int, int, int, int]:
    """``(outer, inner, expert inner, expert outer)`` the config means here: checked
    against the live topology when fleet is up, else against the launcher's world."""
    hcg = live_hcg()
    if hcg is None:
        world = dist.get_world_size()  # the launcher's PADDLE_TRAINERS_NUM before init
        outer, inner = resolve_degrees(cfg, world, ranks_per_node_from_env())
        return outer, inner, inner, outer
    fsdp = hcg.get_fsdp_group()
    outer, inner = hcg.get_fsdp_outer_group().nranks, hcg.get_fsdp_inner_group().nranks
    if cfg.sharding_size == "auto" and cfg.fsdp_outer_degree == "auto":
        wanted_outer, wanted_inner = outer, inner  # follow what fleet.init built
    else:
        wanted_outer, wanted_inner = resolve_degrees(cfg, fsdp.nranks, None)
    errors = []
    if wanted_inner != inner:
        errors.append(f"sharding_size: the config means {wanted_inner} ranks per shard group, "
                      f"the live fleet topology has {inner} (sharding_degree "
                      f"{fsdp.nranks} / fsdp_outer_degree {outer}); use 'auto' to follow it")
    if wanted_outer != outer:
        errors.append(f"fsdp_outer_degree: the config means {wanted_outer}, the live fleet "
                      f"topology has {outer}; use 'auto' to follow it")
    if errors:
        raise ConfigError(errors)
    expert_inner = hcg.get_fsdp_inner_group(is_expert=True).nranks
    expert_outer = hcg.get_fsdp_outer_group(is_expert=True).nranks
    return outer, inner, expert_inner, expert_outer


def outer_sharding_of(cfg: HSDPConfig) -> str:
    """``fsdp_outer_sharding`` as the config means it here: its own value, or with
    'auto' the live fleet's (``sharding_configs``), "none" when fleet is not up."""
    if cfg.fsdp_outer_sharding != AUTO:
        return cfg.fsdp_outer_sharding
    hcg = live_hcg()
    return hcg.get_fsdp_outer_sharding() if hcg is not None else "none"


def init_fleet_if_needed(outer: int, inner: int, outer_sharding: str = "none",
                         ep: int = 1) -> None:
    """``fleet.init`` with HSDP ``outer x inner`` over the whole world, unless fleet is
    up already (:func:`topology_of` has checked that it agrees). ``ep`` > 1: expert
    parallelism over the same ranks, experts sharded over ``outer x inner / ep`` expert
    data-parallel ranks (fleet's moe_sharding group, reshaped by HSDP as the dense one)."""
    if live_hcg() is not None:
        return
    strategy = fleet.DistributedStrategy()
    hybrid = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
              "sharding_degree": outer * inner,
              "sharding_configs": {"fsdp_outer_degree": outer,
                                   "fsdp_outer_sharding": outer_sharding}}
    if ep > 1:
        hybrid.update(ep_degree=ep, moe_sharding_degree=outer * inner // ep)
        strategy.hybrid_parallel_order = list(MOE_ORDER_HINT)
    # (Paddle's TypedDict of hybrid_configs lacks sharding_configs and the MoE degrees
    # its setter takes: it checks the keys against the strategy's proto)
    strategy.hybrid_configs = hybrid  # type: ignore[assignment]
    fleet.init(is_collective=True, strategy=strategy)


# ---------------------------------------------------------------- recompute
def _recompute_forward(module: paddle.nn.Layer, use_reentrant: bool) -> None:
    """Run ``module``'s forward under Paddle's recompute while training with grads: its
    activations are dropped and recomputed in backward (inside a sharded unit, the
    unit's parameters are gathered for backward before the recomputation runs)."""
    if getattr(module, "_hsdp_recompute", False):
        return
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and paddle.is_grad_enabled()):
            return original(*args, **kwargs)
        return recompute(original, *args, use_reentrant=use_reentrant, **kwargs)

    # an instance attribute hiding the class's forward, which Layer.__call__ looks up on
    # the instance (mypy refuses any assignment to a method)
    module.forward = forward  # type: ignore[method-assign]
    module._hsdp_recompute = True
