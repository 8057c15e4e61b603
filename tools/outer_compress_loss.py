"""The outer sync's effect on training: the demo's model (tools/demo.py, CharLM
"small") trained by HSDP 2 x 2 on 4 CPU ranks, from config files that differ only in
the outer sync: plain (float32), ``reduce_dtype: bf16``, ``fsdp_outer_compress: int8``
(blocks of 256, error feedback), and DiLoCo (``fsdp_outer_sync_every: 16``, the outer
Nesterov step with DiLoCo's 0.7 and 0.9; with int8 too; or as plain averaging, lr 1 and
no momentum), same seed and data.

    python tools/outer_compress_loss.py               # 200 steps each, ~10 minutes here
    python tools/outer_compress_loss.py --steps 20    # a quick look
    python tools/outer_compress_loss.py --variants plain,diloco16,diloco16_int8 \
        --out tools/results/diloco_demo.json --plot docs/diloco_loss.png

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
INT8 = {"fsdp_outer_compress": "int8", "fsdp_outer_compress_block": 256}
VARIANTS = {"plain": {}, "bf16_reduce": {"reduce_dtype": "bf16"}, "int8": INT8,
            "diloco16": {"fsdp_outer_sync_every": 16},
            "diloco16_int8": dict(INT8, fsdp_outer_sync_every=16),
            # the outer step as plain averaging (lr 1, no momentum): local SGD every 16
            "diloco16_avg": {"fsdp_outer_sync_every": 16,
                             "fsdp_outer_optimizer": {"lr": 1.0, "momentum": 0.0}}}
DEFAULT_VARIANTS = "plain,bf16_reduce,int8"
TAIL = 10  # steps averaged for "the loss at the end"
TARGET = 0.02  # issue 66: int8's (and DiLoCo's) loss within 2% of plain HSDP's


def run(name: str, extra: dict, steps: int, work: str) -> dict:
    cfg = os.path.join(work, f"{name}.json")  # JSON is YAML: apply_config reads it
    with open(cfg, "w") as f:
        json.dump(dict(BASE, **extra), f)
    run_dir = os.path.join(work, name)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.exists(os.path.join(run_dir, "comm.json")) and \
        sum(1 for _ in open(metrics)) == steps  # --work: a finished run is read again
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_minloglevel="2")
    start = time.time()
    proc = subprocess.CompletedProcess([], 0) if done else subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
         "--log_dir", os.path.join(work, f"logs_{name}"), os.path.join(HERE, "demo.py"),
         "--config", cfg, "--steps", str(steps), "--run-dir", run_dir],
        env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed (rc={proc.returncode}); logs in {work}/logs_{name}")
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    comm = json.load(open(os.path.join(run_dir, "comm.json")))
    # (an op only the plan has, e.g. the all-reduce DiLoCo does not make, has no bytes)
    outer = {k: v.get("wire_bytes", 0.0) for k, v in comm.items() if k.startswith("outer ")}
    print(f"  {name:12s} {time.time() - start:6.1f} s wall", flush=True)
    return {"losses": losses, "final_loss": sum(losses[-TAIL:]) / min(TAIL, len(losses)),
            "outer_wire_bytes_per_step": outer,
            "outer_bytes_per_step": sum(outer.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "outer_compress_demo.json"))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated, 'plain' first; of {', '.join(VARIANTS)}")
    ap.add_argument("--plot", default=None, help="a PNG of every variant's loss curve")
    ap.add_argument("--work", default=None, help="the runs' folder, kept (default: a new "
                    "temporary one, removed); a variant whose run there finished is read, "
                    "not run again")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if names[0] != "plain" or not set(names) <= set(VARIANTS):
        raise SystemExit(f"--variants: 'plain' first, then any of {', '.join(VARIANTS)}; "
                         f"got {args.variants!r}")
    work = args.work or tempfile.mkdtemp(prefix="hsdp_outer_compress_")
    results = {name: run(name, VARIANTS[name], args.steps, work) for name in names}
    if args.work is None:
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
    gaps = {name: abs(r["loss_vs_plain"] - 1) for name, r in results.items() if name != "plain"}
    for name, gap in gaps.items():
        print(f"target {name} loss within {TARGET:.0%} of plain: {gap:.2%} "
              f"{'met' if gap <= TARGET else 'NOT met'}")
    gap = gaps.get("int8", max(gaps.values(), default=0.0))
    met = all(g <= TARGET for g in gaps.values())
    if args.plot:
        plot(results, args.steps, args.plot)
    summary = {"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "model": "demo CharLM small",
               "layout": "HSDP 2x2, 4 CPU ranks (gloo)", "config_base": BASE,
               "variants": {name: dict(VARIANTS[name]) for name in names},
               "results": results, "target": {"int8_loss_within": TARGET, "gap": gap,
                                              "gaps": gaps, "met": met},
               "command": "python tools/outer_compress_loss.py " + " ".join(
                   argv if argv is not None else sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"written {args.out}")
    return 0


def plot(results: dict, steps: int, path: str) -> None:
    """Each variant's loss per step, smoothed over ``TAIL`` steps, in one figure."""
    import matplotlib  # noqa: PLC0415  (only for --plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        losses = r["losses"]
        smooth = [sum(losses[max(0, i - TAIL + 1):i + 1]) / (i + 1 - max(0, i - TAIL + 1))
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=f"{name} ({r['final_loss']:.4f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss (mean of the last {TAIL} steps)")
    ax.set_title(f"demo CharLM small, HSDP 2x2 on 4 CPU ranks, {steps} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plotted {path}")


if __name__ == "__main__":
    sys.exit(main())
