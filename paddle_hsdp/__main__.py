"""``python -m paddle_hsdp check-config CFG.yaml`` and ``python -m paddle_hsdp plan ...``.

Neither starts processes or allocates the model: ``check-config`` reads the file alone,
``plan`` builds the model under ``paddle.LazyGuard()`` and prints what
:func:`paddle_hsdp.apply_config` would make of it. Exit status 0 on success, 1 with the
errors (never a traceback) on a bad config, model or argument.
"""

from __future__ import annotations

import argparse
import importlib
import json
import importlib.util
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from .config import layouts, planner
from .config.patterns import PatternError
from .config.plan import (build_lazily, build_plan, compare_outer_sharding,
                          reshard_after_forward_of, resolve_modules)
from .config.schema import ConfigError, load_config, resolve_degrees

if TYPE_CHECKING:
    import paddle

    from .config.plan import ModuleChoice
    from .config.schema import HSDPConfig
    from .topology.cost import UnitShape


def _check_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    print(f"{args.config}: OK")
    for key, value in vars(cfg).items():
        if key != "source":
            print(f"  {key}: {value}")
    return 0


def _load_factory(spec: str) -> Callable[[], paddle.nn.Layer]:
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the callable (errors
    as ValueError, for exit 1)."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"--model: expected PACKAGE.MODULE:FACTORY or FILE.py:FACTORY, "
                         f"got {spec!r}")
    try:
        if module_name.endswith(".py"):
            loaded = importlib.util.spec_from_file_location("_hsdp_plan_model", module_name)
            if loaded is None or loaded.loader is None:
                raise ImportError(f"no such file {module_name!r}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as e:
        raise ValueError(f"--model: cannot import {module_name!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name!r} has no callable {attr!r}")
    return factory


def _plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config if args.config else {})
    if args.cluster:
        return _plan_cluster(args, cfg)
    if args.model_shape:
        raise ValueError("--model-shape works with --cluster only; give --model FACTORY")
    if not args.config or not args.model or args.world_size is None:
        raise ValueError("plan: give --config, --model and --world-size (or --cluster FILE "
                         "to compare every layout of a cluster)")
    if args.world_size < 1:
        raise ValueError(f"--world-size: expected an int >= 1, got {args.world_size}")
    outer, inner = resolve_degrees(cfg, args.world_size, args.ranks_per_node)
    expert_inner = expert_outer = None
    if args.ep_degree > 1:
        if args.world_size % (args.ep_degree * outer):
            raise ValueError(f"--ep-degree {args.ep_degree}: world size {args.world_size} is "
                             f"not a multiple of ep_degree x fsdp_outer_degree ({outer})")
        expert_inner, expert_outer = args.world_size // args.ep_degree // outer, outer
    model, choice = _lazy_model(args, cfg)
    plans = {mode: build_plan(model, cfg, choice, outer=outer, inner=inner,
                              expert_inner=expert_inner, expert_outer=expert_outer,
                              micro_steps=args.micro_steps, source=args.config,
                              outer_sharding=mode) for mode in ("none", "optim")}
    print(plans["optim" if cfg.fsdp_outer_sharding == "optim" else "none"])
    if outer > 1:  # what the other fsdp_outer_sharding would hold and move
        print()
        print(compare_outer_sharding(plans))
    return 0


def _lazy_model(args: argparse.Namespace,
                cfg: HSDPConfig) -> tuple[paddle.nn.Layer, ModuleChoice]:
    """The model built without memory, its experts marked, and what the config picks."""
    model = build_lazily(_load_factory(args.model))
    choice = resolve_modules(model, cfg)
    choice.mark_experts()
    return model, choice


def _plan_cluster(args: argparse.Namespace, cfg: HSDPConfig) -> int:
    """Every layout of ``--cluster``: memory, communication time, a recommendation."""
    _refuse_with_cluster(args)
    cluster = planner.load_cluster(args.cluster)
    # 'auto' compares both: HFSDP is recommended where only it fits
    modes = (("none", "optim") if cfg.fsdp_outer_sharding == "auto"
             else (cfg.fsdp_outer_sharding,))
    if args.model_shape:
        shape = planner.parse_model_shape(args.model_shape)
        title = f"{shape.params() / 1e9:.2f}B-parameter model ({args.model_shape})"
        tps, pps = _degrees(args, shape, cluster)
        dtypes = planner.dtype_bytes(cfg)
        work = layouts.Workload(args.seq_len, args.micro_batch, args.global_batch,
                                args.recompute, dtypes["compute_bytes"])
        options = planner.evaluate_layouts(
            cluster, shape, work, dtypes, tps, pps, args.micro_steps,
            cfg.zero_stage, reshard_after_forward_of(cfg, is_root=False),
            cfg.num_to_forward_prefetch, modes)
    elif args.model and args.config:
        model, choice = _lazy_model(args, cfg)
        title = f"{args.model} with {args.config}"

        def units_for(outer: int, inner: int, outer_sharding: str = "none") -> list[UnitShape]:
            return build_plan(model, cfg, choice, outer=outer, inner=inner,
                              outer_sharding=outer_sharding).units
        options = planner.evaluate(cluster, units_for, args.micro_steps, cfg.zero_stage,
                                   cfg.num_to_forward_prefetch, outer_shardings=modes)
    else:
        raise ValueError("plan --cluster: give --model-shape, or --model with --config")
    best, why = planner.recommend(options)
    if args.json:
        print(json.dumps(planner.as_json(cluster, options, best, why, title), indent=1))
    else:
        print(planner.table(cluster, options, best, why, title, args.top))
    return 0


def _refuse_with_cluster(args: argparse.Namespace) -> None:
    """Arguments a cluster file overrides, or that need a model shape, refused by name."""
    if args.world_size is not None:
        raise ValueError(f"--world-size {args.world_size}: the cluster file sets the world "
                         "(nodes x ranks_per_node); drop --world-size, or drop --cluster to "
                         "plan one world size")
    if args.ranks_per_node is not None:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node}: the cluster file sets it; "
                         "drop one of them")
    axes = [name for name, value in (("--tp", args.tp), ("--pp", args.pp),
                                     ("--search", args.search)) if value]
    if axes and not args.model_shape:
        raise ValueError(f"{', '.join(axes)}: tensor and pipeline degrees are planned for a "
                         "model shape (--model-shape layers=..,hidden=..,...), not a built "
                         "model")


def _degrees(args: argparse.Namespace, shape: planner.ModelShape,
             cluster: planner.Cluster) -> tuple[list, list]:
    """The tensor and pipeline degrees to compare: fixed (--tp, --pp), searched
    (--search tp,pp), or 1."""
    search = {a.strip() for a in (args.search or "").split(",") if a.strip()}
    unknown = sorted(search - {"tp", "pp"})
    if unknown:
        raise ValueError(f"--search: unknown axis {', '.join(unknown)}; allowed: tp, pp "
                         "(e.g. --search tp,pp)")
    for axis in ("tp", "pp"):
        if axis in search and getattr(args, axis):
            raise ValueError(f"--{axis} {getattr(args, axis)} and --search {args.search}: "
                             f"fix {axis} or search it, not both")
    allowed = {"tp": layouts.tp_choices(shape, cluster.ranks_per_node),
               "pp": layouts.pp_choices(shape)}
    out = []
    for axis in ("tp", "pp"):
        value = getattr(args, axis)
        if value and value not in allowed[axis]:
            raise ValueError(f"--{axis} {value}: not one of {allowed[axis]} (" + (
                f"tensor degrees divide the {cluster.ranks_per_node} ranks of a machine and "
                f"the {shape.heads} heads" if axis == "tp"
                else f"pipeline degrees divide the {shape.layers} layers") + ")")
        out.append(allowed[axis] if axis in search else [value or 1])
    return out[0], out[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paddle_hsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="validate a config file alone")
    check.add_argument("config", help="a YAML config file")
    check.set_defaults(run=_check_config)
    plan = sub.add_parser("plan", help="units, memory and traffic a config gives a model; "
                                       "with --cluster, every layout compared")
    plan.add_argument("--config", default=None, help="a YAML config file")
    plan.add_argument("--model", default=None,
                      help="PACKAGE.MODULE:FACTORY or FILE.py:FACTORY building the model")
    plan.add_argument("--model-shape", default=None,
                      help="with --cluster: layers=..,hidden=..,ffn=..,vocab=..[,kv=0.25]"
                           "[,tied=1] for a decoder LM too large to build")
    plan.add_argument("--world-size", type=int, default=None, help="data-parallel ranks")
    plan.add_argument("--ranks-per-node", type=int, default=None,
                      help="ranks per machine ('auto' degrees: one outer replica per machine)")
    plan.add_argument("--micro-steps", type=int, default=1,
                      help="micro-batches per optimizer step (gradient accumulation)")
    plan.add_argument("--ep-degree", type=int, default=1,
                      help="expert parallelism: experts shard over world / ep / outer ranks")
    plan.add_argument("--cluster", default=None,
                      help="a cluster file (tools/clusters/): compare every fsdp_outer_degree, "
                           "pure FSDP and DDP (and tensor / pipeline degrees), recommend one")
    plan.add_argument("--tp", type=int, default=None,
                      help="with --cluster --model-shape: a fixed tensor-parallel degree")
    plan.add_argument("--pp", type=int, default=None,
                      help="with --cluster --model-shape: a fixed pipeline degree")
    plan.add_argument("--search", default=None,
                      help="with --cluster --model-shape: axes to search, e.g. tp,pp (tensor "
                           "degrees inside a machine dividing the heads, pipeline degrees "
                           "dividing the layers)")
    plan.add_argument("--seq-len", type=int, default=4096,
                      help="tokens per sequence, for activation memory and TP/PP traffic")
    plan.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    plan.add_argument("--global-batch", type=int, default=None,
                      help="sequences per optimizer step, the same for every layout (default: "
                           "--micro-steps micro-batches per rank of pure data parallelism)")
    plan.add_argument("--recompute", action="store_true",
                      help="full activation recompute (each layer keeps only its input)")
    plan.add_argument("--top", type=int, default=None,
                      help="with --cluster: the table shows only the N least exposed "
                           "layouts that fit")
    plan.add_argument("--json", action="store_true",
                      help="with --cluster: one JSON object (recommended, layouts) instead "
                           "of the table")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, PatternError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
