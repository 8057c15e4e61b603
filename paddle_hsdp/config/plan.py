"""A config's dry run on a model: which modules become units, what each rank holds and
what one step moves, without processes, collectives or parameter memory.

:func:`resolve_modules` turns a config's patterns into modules (shared with
:func:`paddle_hsdp.apply_config`, so the plan describes exactly what it will shard);
:func:`build_plan` claims parameters unit by unit the way ``fully_shard`` does, groups
them into buffers with the engine's own rule
(:func:`~paddle_hsdp.engine.unit.buffer_groups`), sizes the shards with the engine's
own :class:`~paddle_hsdp.engine.param.ShardedParam`, and costs them with
:mod:`paddle_hsdp.topology.cost`, the formulas the communication counter is checked
against. Parameters built under ``paddle.LazyGuard()`` are read for their shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import paddle

from ..engine.dtypes import dtypes_of, element_size
from ..engine.experts import mark_expert_params
from ..engine.layout import segment_layout
from ..engine.param import ShardedParam
from ..engine.placements import Owned, owned_matrices
from ..optim.muon import muon_param_info
from ..engine.policies import MixedPrecisionPolicy, OuterSyncPolicy, outer_sync_policy_from
from ..engine.unit import buffer_groups
from ..topology.placement import is_expert
from ..topology import cost
from .patterns import match_modules, order_bottom_up
from .schema import ConfigError, HSDPConfig

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ModuleChoice:
    """What a config's patterns select in one model (paths from the model's children)."""

    wrap: list  # [(path, module)], bottom-up; the root is not in it (always last)
    ignored: list
    recompute: list
    experts: list

    def mark_experts(self) -> None:
        """Flag the parameters of every ``expert_modules`` match as expert parameters."""
        for _, module in self.experts:
            mark_expert_params(module)

    def ignored_params(self) -> list:
        seen, out = set(), []
        for _, module in self.ignored:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def resolve_modules(model: paddle.nn.Layer, config: HSDPConfig) -> ModuleChoice:
    """Match every pattern list; refuse a module that is both wrapped and ignored (or
    wrapped inside an ignored one). Raises ``ConfigError`` / ``PatternError`` before
    anything is touched."""
    def match(key: str) -> list[tuple[str, paddle.nn.Layer]]:
        patterns = list(getattr(config, key))
        return match_modules(model, patterns, key) if patterns else []

    choice = ModuleChoice(order_bottom_up(match("sub_modules_to_wrap")), match("ignored_modules"),
                          match("recompute_modules"), match("expert_modules"))
    errors = []
    for path, _ in choice.wrap:
        for ignored_path, _ in choice.ignored:
            if path == ignored_path or path.startswith(ignored_path + "."):
                errors.append(f"sub_modules_to_wrap: '{path}' is also ignored (ignored_modules "
                              f"matches '{ignored_path}'); a module is either wrapped or ignored")
    if errors:
        raise ConfigError(errors)
    return choice


def mp_policy_of(config: HSDPConfig) -> MixedPrecisionPolicy | None:
    """The ``MixedPrecisionPolicy`` a config asks for (None when it sets no dtype and
    no ``fsdp_outer_compress``)."""
    dtypes = {k: _DTYPES[getattr(config, k)] for k in ("param_dtype", "reduce_dtype",
                                                        "output_dtype") if getattr(config, k)}
    if not dtypes and config.fsdp_outer_compress is None:
        return None
    return MixedPrecisionPolicy(cast_forward_inputs=config.cast_forward_inputs,
                                outer_compress=config.fsdp_outer_compress,
                                outer_compress_block=config.fsdp_outer_compress_block,
                                **dtypes)


def outer_sync_policy_of(config: HSDPConfig) -> OuterSyncPolicy | None:
    """The ``OuterSyncPolicy`` of ``fsdp_outer_sync_every`` and ``fsdp_outer_optimizer``
    (None for every 1: plain HSDP)."""
    if config.fsdp_outer_sync_every == 1:
        return None
    return outer_sync_policy_from(config.fsdp_outer_sync_every, config.fsdp_outer_optimizer,
                                  config.fsdp_outer_sync_fragments)


def reshard_after_forward_of(config: HSDPConfig, is_root: bool) -> bool:
    """What a unit does after forward under ``config`` (``fully_shard``'s default: every
    unit but the root reshards)."""
    if config.zero_stage is not None:
        return config.zero_stage == 3
    if config.reshard_after_forward is not None:
        return config.reshard_after_forward
    return not is_root


@dataclass
class Plan:
    """The dry run's result; ``str()`` is the table the ``plan`` command prints."""

    world_size: int
    outer: int
    inner: int
    expert_inner: int
    units: list = field(default_factory=list)  # cost.UnitShape, in wrap order
    micro_steps: int = 1
    zero_stage: int | None = None
    forward_prefetch: int = 1
    source: str = ""
    outer_sharding: str = "none"

    def comm_bytes(self) -> dict:
        """Wire bytes per rank for one optimizer step, ``{(group label, op): bytes}``."""
        return cost.step_comm(self.units, self.micro_steps, self.zero_stage)

    def memory_bytes(self) -> dict:
        return cost.memory_per_rank(self.units, self.forward_prefetch)

    def __str__(self) -> str:
        mb = 2.0 ** 20
        lines = [f"paddle_hsdp plan for {self.source or 'a config'}: world {self.world_size} = "
                 f"outer {self.outer} x inner {self.inner}"
                 + (f" (experts: inner {self.expert_inner})" if self.expert_inner != self.inner
                    else "")
                 + f", {self.micro_steps} micro-step(s) per optimizer step"
                 + (", optimizer state sharded across outer (fsdp_outer_sharding: optim)"
                    if self.outer_sharding == "optim" and self.outer > 1 else ""),
                 "",
                 f"{'#':>3s}  {'unit':<36s} {'params':>12s} {'buffers':>7s} {'reshard':>7s} "
                 f"{'shard MB':>9s} {'gathered MB':>11s}"]
        for i, u in enumerate(self.units):
            shard = sum(b.shard_numel * b.master_bytes for b in u.buffers)
            lines.append(f"{i:>3d}  {u.path[:36]:<36s} {u.params:>12,d} {len(u.buffers):>7d} "
                         f"{'yes' if u.reshard_after_forward else 'no':>7s} "
                         f"{shard / mb:>9.2f} {u.gathered_bytes / mb:>11.2f}")
        mem = self.memory_bytes()
        lines += ["", "per rank (MB): " + ", ".join(
            f"{k.replace('_', ' ')} {v / mb:.2f}" for k, v in mem.items())
            + f"; total persistent {(mem['params'] + mem['grads'] + mem['optimizer']) / mb:.2f}",
            "per optimizer step, bytes on the wire per rank:"]
        comm = self.comm_bytes()
        for (label, op), nbytes in sorted(comm.items()):
            lines.append(f"  {label + ' ' + op:<28s} {nbytes:>16,.0f}  ({nbytes / mb:.2f} MB)")
        return "\n".join(lines)


def build_plan(model: paddle.nn.Layer, config: HSDPConfig, choice: ModuleChoice, *, outer: int,
               inner: int,
               expert_inner: int | None = None, expert_outer: int | None = None,
               micro_steps: int = 1, source: str = "",
               labels: dict | None = None, outer_sharding: str | None = None) -> Plan:
    """Cost ``config`` on ``model`` for an ``outer x inner`` layout (experts may have
    their own inner size when EP > 1). ``labels``: the counter's group labels
    (``inner``, ``expert_inner``, ``outer``), the defaults fleet gives.
    ``outer_sharding``: "none" or "optim" (None: the config's; its 'auto' is "none")."""
    if outer_sharding is None:
        outer_sharding = "optim" if config.fsdp_outer_sharding == "optim" else "none"
    expert_inner = expert_inner or inner
    expert_outer = expert_outer or outer
    labels = {"inner": "inner", "expert_inner": "expert_inner", "outer": "outer",
              **(labels or {})}
    if expert_inner == inner and expert_outer == outer:
        labels["expert_inner"] = labels["inner"]  # one group for both: its first name
    policy = mp_policy_of(config)
    owner = owned_matrices(info=muon_param_info(model)) if config.owned_matrices else None
    claimed = {id(p) for p in choice.ignored_params()}
    units: list[cost.UnitShape] = []
    wrapped = {id(module) for _, module in choice.wrap}
    for path, module in [*choice.wrap, ("", model)]:
        sps, segment = [], 0
        for prefix, sub in module.named_sublayers(include_self=True):
            if sub is not module and id(sub) in wrapped:
                segment += 1  # as the engine splits a unit's buffers (buffer_groups)
            for name, p in sub._parameters.items():
                if p is None or id(p) in claimed:
                    continue
                claimed.add(id(p))
                size = expert_inner if is_expert(p) else inner
                fqn = ".".join(x for x in (path, prefix, name) if x)
                parts = expert_outer if is_expert(p) else outer
                parts = parts if outer_sharding == "optim" and not p.stop_gradient else 1
                sps.append(ShardedParam(p, fqn, size, 0, parts))
                sps[-1].segment = segment
        # (the unit's index as the engine numbers it when this is the first model sharded)
        buffers = tuple(_buffer_shape(params, expert, policy, labels,
                                      expert_outer if expert else outer, owner, len(units))
                        for (_, _, _, expert, _), params in buffer_groups(sps, {}).items())
        units.append(cost.UnitShape(path or "<root>", buffers,
                                    reshard_after_forward_of(config, path == ""),
                                    sum(sp.numel for sp in sps)))
    return Plan(world_size=outer * inner, outer=outer, inner=inner, expert_inner=expert_inner,
                units=units, micro_steps=micro_steps, zero_stage=config.zero_stage,
                forward_prefetch=config.num_to_forward_prefetch, source=source,
                outer_sharding=outer_sharding)


def compare_outer_sharding(plans: dict) -> str:
    """``{"none": Plan, "optim": Plan}`` of one layout side by side: persistent bytes per
    rank and the outer group's wire bytes per step (the same across machines)."""
    mb = 2.0 ** 20
    lines = ["fsdp_outer_sharding: per rank (MB)            params    grads optimizer "
             "   total   outer bytes/step"]
    for mode, plan in plans.items():
        mem = plan.memory_bytes()
        outer = sum(v for (label, _), v in plan.comm_bytes().items() if label == "outer")
        name = {"none": "none (HSDP)", "optim": "optim (HFSDP)"}[mode]
        lines.append(f"  {name:<39s} {mem['params'] / mb:>8.2f} {mem['grads'] / mb:>8.2f} "
                     f"{mem['optimizer'] / mb:>9.2f} "
                     f"{(mem['params'] + mem['grads'] + mem['optimizer']) / mb:>8.2f} "
                     f"{outer:>18,.0f}")
    return "\n".join(lines)


def _buffer_shape(params: list[ShardedParam], expert: bool, policy: MixedPrecisionPolicy | None,
                  labels: dict, outer: int,
                  owner: Callable[[paddle.Tensor], Owned | None] | None = None,
                  rotation: int = 0) -> cost.BufferShape:
    gather, reduce, compute = dtypes_of(params[0].dtype, policy)
    owned = [owner is not None and owner(sp.full) is not None for sp in params]
    return cost.BufferShape(
        shard_numel=segment_layout([sp.shape for sp in params], params[0].inner_size
                                   * params[0].parts, owned, rotation).segment_numel
        * params[0].parts,
        outer_parts=params[0].parts,
        logical_numel=sum(sp.numel for sp in params),
        inner=params[0].inner_size, outer=outer,
        master_bytes=element_size(params[0].dtype), gather_bytes=element_size(gather),
        reduce_bytes=element_size(reduce), compute_bytes=element_size(compute),
        trainable=params[0].trainable,
        inner_label=labels["expert_inner" if expert else "inner"], outer_label=labels["outer"],
        outer_compress_block=(policy.outer_compress_block
                              if policy is not None and policy.outer_compress
                              and params[0].trainable else 0),
        outer_compress=(policy.outer_compress if policy is not None else None) or "int8")


def build_lazily(factory: Callable[[], paddle.nn.Layer]) -> paddle.nn.Layer:
    """``factory()`` under ``paddle.LazyGuard()``: parameters with shapes, no memory."""
    with paddle.LazyGuard():
        return factory()
