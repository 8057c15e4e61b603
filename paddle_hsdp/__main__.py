"""``python -m paddle_hsdp check-config CFG.yaml`` and ``python -m paddle_hsdp plan ...``.

Neither starts processes or allocates the model: ``check-config`` reads the file alone,
``plan`` builds the model under ``paddle.LazyGuard()`` and prints what
:func:`paddle_hsdp.apply_config` would make of it. Exit status 0 on success, 1 with the
errors (never a traceback) on a bad config, model or argument.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from .config import planner
from .config.patterns import PatternError
from .config.plan import (build_lazily, build_plan, compare_outer_sharding,
                          reshard_after_forward_of, resolve_modules)
from .config.schema import ConfigError, load_config, resolve_degrees


def _check_config(args) -> int:
    cfg = load_config(args.config)
    print(f"{args.config}: OK")
    for key, value in vars(cfg).items():
        if key != "source":
            print(f"  {key}: {value}")
    return 0


def _load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the callable (errors
    as ValueError, for exit 1)."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"--model: expected PACKAGE.MODULE:FACTORY or FILE.py:FACTORY, "
                         f"got {spec!r}")
    try:
        if module_name.endswith(".py"):
            loaded = importlib.util.spec_from_file_location("_hsdp_plan_model", module_name)
            if loaded is None:
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


def _plan(args) -> int:
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


def _lazy_model(args, cfg):
    """The model built without memory, its experts marked, and what the config picks."""
    model = build_lazily(_load_factory(args.model))
    choice = resolve_modules(model, cfg)
    choice.mark_experts()
    return model, choice


def _plan_cluster(args, cfg) -> int:
    """Every layout of ``--cluster``: memory, communication time, a recommendation."""
    cluster = planner.load_cluster(args.cluster)
    if args.model_shape:
        shape = planner.parse_model_shape(args.model_shape)
        title = f"{shape.params() / 1e9:.2f}B-parameter model ({args.model_shape})"
        reshard = reshard_after_forward_of(cfg, is_root=False)

        def units_for(outer, inner, outer_sharding="none"):
            return planner.shape_units(shape, inner, outer, planner.dtype_bytes(cfg), reshard,
                                       outer_sharding)
    elif args.model and args.config:
        model, choice = _lazy_model(args, cfg)
        title = f"{args.model} with {args.config}"

        def units_for(outer, inner, outer_sharding="none"):
            return build_plan(model, cfg, choice, outer=outer, inner=inner,
                              outer_sharding=outer_sharding).units
    else:
        raise ValueError("plan --cluster: give --model-shape, or --model with --config")
    # 'auto' compares both: HFSDP is recommended where only it fits
    modes = (("none", "optim") if cfg.fsdp_outer_sharding == "auto"
             else (cfg.fsdp_outer_sharding,))
    options = planner.evaluate(cluster, units_for, args.micro_steps, cfg.zero_stage,
                               cfg.num_to_forward_prefetch, outer_shardings=modes)
    best, why = planner.recommend(options)
    print(planner.table(cluster, options, best, why, title))
    return 0


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
                           "pure FSDP and DDP, and recommend one")
    plan.set_defaults(run=_plan)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, PatternError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
