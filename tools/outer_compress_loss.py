"""The compressed outer sync's effect on training: the demo's model (tools/demo.py,
CharLM "small") trained by HSDP 2 x 2 on 4 CPU ranks, from config files that differ
only in the outer sync: plain (float32), ``reduce_dtype: bf16`` and
``fsdp_outer_compress: int8`` (blocks of 256, error feedback), same seed and data.

    python tools/outer_compress_loss.py               # 200 steps each, ~10 minutes here
    python tools/outer_compress_loss.py --steps 20    # a quick look

Prints, per variant, the loss at the end (mean of the last 10 steps) and its ratio to
the plain run's, and the outer group's bytes per step from the communication counter
(``comm.json`` of each run) and their ratio to the plain run's; writes it all to
``--out`` (default tools/results/outer_compress_demo.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASE = {"fsdp_outer_degree": 2, "sub_modules_to_wrap": ["blocks.{*}"]}
VARIANTS = {"plain": {}, "bf16_reduce": {"reduce_dtype": "bf16"},
            "int8": {"fsdp_outer_compress": "int8", "fsdp_outer_compress_block": 256}}
TAIL = 10  # steps averaged for "the loss at the end"
TARGET = 0.02  # issue 66: int8's loss within 2% of plain HSDP's


def run(name: str, extra: dict, steps: int, work: str) -> dict:
    cfg = os.path.join(work, f"{name}.json")  # JSON is YAML: apply_config reads it
    with open(cfg, "w") as f:
        json.dump(dict(BASE, **extra), f)
    run_dir = os.path.join(work, name)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_minloglevel="2")
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
         "--log_dir", os.path.join(work, f"logs_{name}"), os.path.join(HERE, "demo.py"),
         "--config", cfg, "--steps", str(steps), "--run-dir", run_dir],
        env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed (rc={proc.returncode}); logs in {work}/logs_{name}")
    losses = [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    comm = json.load(open(os.path.join(run_dir, "comm.json")))
    outer = {k: v["wire_bytes"] for k, v in comm.items() if k.startswith("outer ")}
    print(f"  {name:12s} {time.time() - start:6.1f} s wall", flush=True)
    return {"losses": losses, "final_loss": sum(losses[-TAIL:]) / min(TAIL, len(losses)),
            "outer_wire_bytes_per_step": outer,
            "outer_bytes_per_step": sum(outer.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "outer_compress_demo.json"))
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="hsdp_outer_compress_")
    results = {name: run(name, extra, args.steps, work) for name, extra in VARIANTS.items()}
    shutil.rmtree(work, ignore_errors=True)  # (a failed run keeps its logs there)
    plain = results["plain"]
    print(f"\ndemo CharLM small, HSDP 2x2 on 4 CPU ranks, {args.steps} steps, loss = mean "
          f"of the last {TAIL} steps")
    print(f"{'variant':12s} {'loss':>7s} {'vs plain':>9s} {'outer MB/step':>14s} {'vs plain':>9s}")
    for name, r in results.items():
        r["loss_vs_plain"] = r["final_loss"] / plain["final_loss"]
        r["outer_bytes_vs_plain"] = r["outer_bytes_per_step"] / plain["outer_bytes_per_step"]
        print(f"{name:12s} {r['final_loss']:7.4f} {r['loss_vs_plain']:9.4f} "
              f"{r['outer_bytes_per_step'] / 1e6:14.3f} {r['outer_bytes_vs_plain']:9.3f}")
    gap = abs(results["int8"]["loss_vs_plain"] - 1)
    met = gap <= TARGET
    print(f"target int8 loss within {TARGET:.0%} of plain: {gap:.2%} "
          f"{'met' if met else 'NOT met'}")
    summary = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "model": "demo CharLM small",
               "layout": "HSDP 2x2, 4 CPU ranks (gloo)", "config_base": BASE,
               "variants": {name: dict(VARIANTS[name]) for name in VARIANTS},
               "results": results, "target": {"int8_loss_within": TARGET, "gap": gap,
                                              "met": met},
               "command": "python tools/outer_compress_loss.py --steps " + str(args.steps)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
