"""The command line (tools/bench.py's): its flags, and the two runs it chooses between,
on one host or on two."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import bench_model
from benchkit.cross_host import check_two_host_losses, summarise_two_hosts
from benchkit.launch import (engine_version, freeze_engine, run_on_two_hosts, run_rounds,
                             run_variant)
from benchkit.plots import plot
from benchkit.settings import MUON_VARIANTS, TWO_HOST_SHAPE, TWO_HOST_VARIANTS, VARIANTS
from benchkit.summary import check_losses, summarise
from benchkit.tables import print_table, print_two_hosts

DESCRIPTION = "Side-by-side benchmark: paddle_hsdp against what Paddle users run today."


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--shape", choices=sorted(bench_model.SHAPES), default=None,
                    help=f"model (default 73m; {TWO_HOST_SHAPE} with --two-hosts)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-rank", type=int, default=1, dest="per_rank")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated (default {','.join(VARIANTS)}; Muon: "
                         f"{','.join(MUON_VARIANTS)}; with --two-hosts "
                         f"{','.join(TWO_HOST_VARIANTS)})")
    ap.add_argument("--out", default=None, help="result folder (default: a new temp dir)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a folder holding another paddle_hsdp package (e.g. a git "
                         "worktree of an older commit): adds a <variant>_base run with "
                         "it for each paddle_hsdp variant, for before/after ratios "
                         "(with --two-hosts too)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 3 steps, one round: checks the tool, not the engine")
    ap.add_argument("--two-hosts", default=None, metavar="RATE", dest="two_hosts",
                    help="2 hosts x 2 ranks (network namespaces; root) over a link limited "
                         "to RATE (e.g. 100mbit, or none): the slow-link comparison")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.two_hosts:
        return main_two_hosts(args)
    args.shape = args.shape or "73m"
    if args.quick:
        args.shape, args.steps, args.rounds = "tiny", 3, 1
    variants = (args.variants or ",".join(VARIANTS)).split(",")
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
        variants += [f"{v}_base" for v in variants if "hsdp" in v]
    if "single" not in variants:
        variants.append("single")
    out_dir = args.out or tempfile.mkdtemp(prefix="hsdp_bench_")
    os.makedirs(out_dir, exist_ok=True)
    results = run_rounds(variants, args.rounds,
                         lambda variant, r: run_variant(variant, args, out_dir, r))
    summary = summarise(results, args)
    check_losses(summary, rtol=1e-3)
    print_table(summary)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, out_dir)
    print(f"\nwrote {out_dir}/bench.json, loss.png, bars.png"
          + (", timeline.png" if any("timeline" in e for e in summary["variants"].values())
             else ""))
    return summary


def main_two_hosts(args):
    import two_hosts

    args.shape = args.shape or TWO_HOST_SHAPE
    variants = (args.variants or ",".join(TWO_HOST_VARIANTS)).split(",")
    # a variant named with _base runs on the --baseline engine (e.g. a DiLoCo variant,
    # which an engine from before issue 66 lacks, so none is added for it unasked)
    unknown = sorted({v.removesuffix("_base") for v in variants} - set(TWO_HOST_VARIANTS))
    if unknown:  # e.g. "single": one process has no second host
        raise SystemExit(f"--two-hosts runs {', '.join(TWO_HOST_VARIANTS)}; not {unknown}")
    if any(v.endswith("_base") for v in variants) and not args.baseline:
        raise SystemExit("--variants names a <variant>_base run: give --baseline DIR, the "
                         "engine it runs on")
    if args.baseline:  # (an engine from before issue 66 has no int8 outer sync)
        args.baseline = os.path.abspath(args.baseline)
        variants += [f"{v}_base" for v in variants if "hsdp" in v and not v.endswith("_int8")
                     and "_diloco" not in v and not v.endswith("_base")]
    out_dir = args.out or tempfile.mkdtemp(prefix="hsdp_bench_two_hosts_")
    os.makedirs(out_dir, exist_ok=True)
    start, engine = time.time(), engine_version()
    args.engine_dir = freeze_engine(out_dir)
    try:
        with two_hosts.TwoHosts(rate=args.two_hosts) as hosts:
            results = run_rounds(variants, args.rounds, lambda v, r: run_on_two_hosts(
                hosts, v, args, out_dir, r))
    except (two_hosts.Unavailable, ValueError) as e:
        print(f"bench --two-hosts: {e}", file=sys.stderr)
        raise SystemExit(two_hosts.EXIT_UNAVAILABLE)
    summary = summarise_two_hosts(results, args)
    summary["wall_s"] = time.time() - start
    summary["engine"] = engine  # as copied at the start; every launch used that copy
    print_two_hosts(summary)
    with open(os.path.join(out_dir, "two_hosts.json"), "w") as f:
        json.dump(summary, f, indent=1)
    check_two_host_losses(summary)
    print(f"\nwrote {out_dir}/two_hosts.json ({summary['wall_s']:.0f} s)")
    return summary
