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


def _check_config(args) -> int:
    from .config import load_config

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
    from .config import load_config, resolve_degrees
    from .plan import build_lazily, build_plan, resolve_modules

    cfg = load_config(args.config)
    if args.world_size < 1:
        raise ValueError(f"--world-size: expected an int >= 1, got {args.world_size}")
    outer, inner = resolve_degrees(cfg, args.world_size, args.ranks_per_node)
    expert_inner = expert_outer = None
    if args.ep_degree > 1:
        if args.world_size % (args.ep_degree * outer):
            raise ValueError(f"--ep-degree {args.ep_degree}: world size {args.world_size} is "
                             f"not a multiple of ep_degree x fsdp_outer_degree ({outer})")
        expert_inner, expert_outer = args.world_size // args.ep_degree // outer, outer
    model = build_lazily(_load_factory(args.model))
    choice = resolve_modules(model, cfg)
    from . import experts

    for _, module in choice.experts:
        experts.mark_expert_params(module)
    plan = build_plan(model, cfg, choice, outer=outer, inner=inner, expert_inner=expert_inner,
                      expert_outer=expert_outer, micro_steps=args.micro_steps,
                      source=args.config)
    print(plan)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paddle_hsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-config", help="validate a config file alone")
    check.add_argument("config", help="a YAML config file")
    check.set_defaults(run=_check_config)
    plan = sub.add_parser("plan", help="units, memory and traffic a config gives a model")
    plan.add_argument("--config", required=True, help="a YAML config file")
    plan.add_argument("--model", required=True,
                      help="PACKAGE.MODULE:FACTORY or FILE.py:FACTORY building the model")
    plan.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    plan.add_argument("--ranks-per-node", type=int, default=None,
                      help="ranks per machine ('auto' degrees: one outer replica per machine)")
    plan.add_argument("--micro-steps", type=int, default=1,
                      help="micro-batches per optimizer step (gradient accumulation)")
    plan.add_argument("--ep-degree", type=int, default=1,
                      help="expert parallelism: experts shard over world / ep / outer ranks")
    plan.set_defaults(run=_plan)
    return parser


def main(argv=None) -> int:
    from .config import ConfigError
    from .patterns import PatternError

    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, PatternError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
