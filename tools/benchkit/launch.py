"""Launching: one variant on 4 CPU ranks (or one process), or on 2 hosts x 2 ranks, and
the rounds that alternate them; the engine copied aside for a two-host run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from benchkit.settings import RANKS_PER_HOST, ROOT, TOOLS, WORLD


def run_variant(variant, args, out_dir, round_index) -> dict:
    out = os.path.join(out_dir, f"{variant}_{round_index}.json")
    base = variant.endswith("_base")  # the same variant on the --baseline engine
    cfg = {"variant": variant[:-len("_base")] if base else variant, "shape": args.shape,
           "steps": args.steps, "per_rank": args.per_rank, "world": WORLD, "out": out}
    engine = args.baseline if base else ROOT
    env = dict(os.environ, FLAGS_use_system_allocator="true", GLOG_minloglevel="2",
               PYTHONPATH=engine + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = os.path.join(TOOLS, "bench_worker.py")
    if variant == "single":
        cmd = [sys.executable, worker, json.dumps(cfg)]
    else:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
               str(WORLD), "--log_dir", os.path.join(out_dir, f"log_{variant}_{round_index}"),
               worker, json.dumps(cfg)]
    start = time.time()
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        logs = os.path.join(out_dir, f"log_{variant}_{round_index}")
        raise SystemExit(f"{variant} failed (rc={proc.returncode}); logs in {logs}\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    print(f"  {variant:8s} round {round_index}: {time.time() - start:5.1f} s wall", flush=True)
    return result


def run_rounds(variants: list, rounds: int, run_one) -> dict:
    """Every variant once per round, the order reversed every other round so that
    machine noise hits all of them alike."""
    results = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        print(f"round {r + 1}/{rounds}", flush=True)
        for variant in order:
            results[variant].append(run_one(variant, r))
    return results


def freeze_engine(out_dir: str) -> str:
    """Copy paddle_hsdp/ into the result folder and return the folder to import it from:
    every launch of the run then uses the same engine, even if the checkout moves
    meanwhile (a long run on a shared tree would otherwise mix two versions)."""
    engine_dir = os.path.join(out_dir, "engine")
    shutil.rmtree(engine_dir, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "paddle_hsdp"), os.path.join(engine_dir, "paddle_hsdp"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return engine_dir


def run_on_two_hosts(hosts, variant: str, args, out_dir: str, round_index: int) -> dict:
    """One variant on 2 hosts x 2 ranks (the engine from ``args.engine_dir``); adds what
    crossed during the whole launch."""
    out = os.path.join(out_dir, f"{variant}_{round_index}.json")
    base = variant.endswith("_base")  # the same variant on the --baseline engine
    cfg = {"variant": variant[:-len("_base")] if base else variant, "shape": args.shape,
           "steps": args.steps, "per_rank": args.per_rank, "world": WORLD, "out": out,
           "two_hosts": True}
    engine = args.baseline if base else args.engine_dir
    env = dict(os.environ, FLAGS_use_system_allocator="true", GLOG_minloglevel="2",
               PYTHONPATH=engine + os.pathsep + os.environ.get("PYTHONPATH", ""))
    logs = os.path.join(out_dir, f"log_{variant}_{round_index}")
    bytes_before, drops_before = hosts.veth_bytes(), hosts.qdisc_drops()
    start = time.time()
    codes = hosts.launch(RANKS_PER_HOST, os.path.join(TOOLS, "bench_worker.py"),
                         [json.dumps(cfg)], log_dir=logs, env=env, timeout=args.timeout)
    if codes != [0, 0] or not os.path.exists(out):
        raise SystemExit(f"{variant} failed on two hosts (exit codes {codes}); logs in {logs}")
    with open(out) as f:
        result = json.load(f)
    result["launch_veth_bytes"] = hosts.veth_bytes() - bytes_before
    result["launch_qdisc_drops"] = hosts.qdisc_drops() - drops_before
    print(f"  {variant:12s} round {round_index}: {time.time() - start:5.1f} s wall",
          flush=True)
    return result


def engine_version() -> str:
    """The commit the engine was run at, "+dirty" when paddle_hsdp/ had changes (read
    only; "unknown" outside a git checkout)."""
    def git(*cmd):
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--", "paddle_hsdp").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")
