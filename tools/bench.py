"""Side-by-side benchmark: paddle_hsdp against what Paddle users run today.

    python tools/bench.py                 # 73M LlamaLike, every variant, 2 alternating rounds
    python tools/bench.py --shape 140m    # the memory comparison
    python tools/bench.py --quick         # tiny model, one round (< 2 minutes; the tests run it)

Variants, on the same 4 CPU ranks (gloo), same model, data and steps, launched one at a
time and alternated round by round so that machine noise hits all of them alike:

* ``hsdp2x2`` / ``hsdp1x4``: paddle_hsdp, one unit per decoder layer plus the root;
* ``dp``: ``paddle.DataParallel``;
* ``stage3``: Paddle's ``GroupShardedStage3`` with ``segment_size=0`` (every parameter
  sharded, as paddle_hsdp does). Its entry point refuses CPU; the class runs with
  ``device="cpu"`` when its CUDA check is bypassed during construction, which the
  worker does (and says so). Its losses are checked against the others before its
  timings are reported;
* ``single``: one process on the whole batch (the loss reference).

Printed and written to ``OUT/bench.json`` (with ``loss.png`` and ``bars.png``): median
step time (steps after the first) and its ratio to DataParallel and to stage 3; training
peak RSS per rank above the idle runtime (``FLAGS_use_system_allocator=true``, peak mark
reset after set-up) beside the theoretical per-rank figure; per-step wire bytes per
group kind from ``paddle_hsdp.comm.counter`` against DESIGN's formulas; and the last
loss's difference from the single process. On a GPU machine compare against
``group_sharded_parallel(level="p_g_os")`` and ``paddle.distributed.fsdp`` instead of the
CPU bypass (not done here: no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_model  # noqa: E402

VARIANTS = ["hsdp2x2", "hsdp1x4", "dp", "stage3", "single"]
WORLD = 4


def run_variant(variant, args, out_dir, round_index) -> dict:
    out = os.path.join(out_dir, f"{variant}_{round_index}.json")
    base = variant.endswith("_base")  # the same variant on the --baseline engine
    cfg = {"variant": variant[:-len("_base")] if base else variant, "shape": args.shape,
           "steps": args.steps, "per_rank": args.per_rank, "world": WORLD, "out": out}
    engine = args.baseline if base else ROOT
    env = dict(os.environ, FLAGS_use_system_allocator="true", GLOG_minloglevel="2",
               PYTHONPATH=engine + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = os.path.join(HERE, "bench_worker.py")
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


def theoretical_mb(variant: str, shape: bench_model.Shape, per_rank: int) -> float:
    """Per-rank bytes a variant needs at least: float32 params, grads and AdamW moments
    (16 bytes per parameter it holds), plus what its schedule keeps full-size at once,
    plus activations (see Shape.activation_bytes_per_layer) and logits."""
    p, layer = shape.params(), shape.layer_params()
    root = p - shape.layers * layer  # embedding, head and final norm: the root unit
    batch = per_rank * (WORLD if variant == "single" else 1)
    act = shape.layers * shape.activation_bytes_per_layer(batch) \
        + 3 * 4 * batch * shape.seq * shape.vocab
    variant = variant.replace("_base", "")
    if variant in ("dp", "single"):
        states = 16 * p + (4 * p if variant == "dp" else 0)  # DataParallel's fused grads
    else:
        inner = 2 if variant == "hsdp2x2" else WORLD
        # shards of everything; the root gathered throughout; two layers gathered and one
        # layer's full grads at a time; the root's full grads at the end of backward
        states = 16 * p / inner + 4 * root + 3 * 4 * layer + 4 * root
    return (states + act) / 2 ** 20


def summarise(results: dict, args) -> dict:
    shape = bench_model.SHAPES[args.shape]
    ref_loss = results["single"][0]["losses"][-1]
    summary = {"shape": args.shape, "params": shape.params(), "steps": args.steps,
               "per_rank": args.per_rank, "rounds": args.rounds, "world": WORLD,
               "date": time.strftime("%Y-%m-%d"), "variants": {}}
    for variant, runs in results.items():
        steady = [t for r in runs for t in r["step_times"][1:]] or \
                 [t for r in runs for t in r["step_times"]]
        entry = {"median_step_s": statistics.median(steady),
                 "first_step_s": statistics.median(r["step_times"][0] for r in runs),
                 "peak_rss_mb_per_rank": max(max(r["peak_rss_mb"]) for r in runs),
                 "theoretical_mb_per_rank": theoretical_mb(variant, shape, args.per_rank),
                 "last_loss": runs[-1]["losses"][-1],
                 "last_loss_diff_vs_single": abs(runs[-1]["losses"][-1] - ref_loss),
                 "losses": runs[-1]["losses"]}
        if "comm_measured" in runs[-1]:
            measured, theory = runs[-1]["comm_measured"], runs[-1]["comm_theoretical"]
            entry["comm_bytes_per_step"] = {
                k: {"measured": measured[k], "theoretical": theory[k],
                    "ratio": measured[k] / theory[k] if theory[k] else None}
                for k in theory}
        summary["variants"][variant] = entry
    for entry in summary["variants"].values():
        for base in ("dp", "stage3"):
            if base in summary["variants"]:
                entry[f"time_vs_{base}"] = entry["median_step_s"] / \
                    summary["variants"][base]["median_step_s"]
                entry[f"memory_vs_{base}"] = entry["peak_rss_mb_per_rank"] / \
                    summary["variants"][base]["peak_rss_mb_per_rank"]
        entry["memory_vs_theoretical"] = entry["peak_rss_mb_per_rank"] / \
            entry["theoretical_mb_per_rank"]
    return summary


def print_table(summary: dict) -> None:
    print(f"\n{summary['shape']} LlamaLike ({summary['params'] / 1e6:.1f}M params), "
          f"{summary['world']} CPU ranks, {summary['per_rank']} sequence(s) of "
          f"{bench_model.SHAPES[summary['shape']].seq} per rank, {summary['steps']} steps x "
          f"{summary['rounds']} round(s), {summary['date']}")
    print("stage3 = Paddle's GroupShardedStage3(segment_size=0) with its CUDA check "
          "bypassed during construction (CPU)")
    head = (f"{'variant':12s} {'step s':>8s} {'vs dp':>6s} {'vs st3':>6s} {'peak MB':>8s} "
            f"{'theory':>7s} {'vs st3':>6s} {'vs th.':>6s} {'loss diff':>9s}")
    print(head)
    for name, e in summary["variants"].items():
        print(f"{name:12s} {e['median_step_s']:8.3f} {e.get('time_vs_dp', 0):6.2f} "
              f"{e.get('time_vs_stage3', 0):6.2f} {e['peak_rss_mb_per_rank']:8.0f} "
              f"{e['theoretical_mb_per_rank']:7.0f} {e.get('memory_vs_stage3', 0):6.2f} "
              f"{e['memory_vs_theoretical']:6.2f} {e['last_loss_diff_vs_single']:9.2e}")
    for name, e in summary["variants"].items():
        for kind, c in e.get("comm_bytes_per_step", {}).items():
            if c["theoretical"]:
                print(f"{name:12s} {kind:22s} {c['measured'] / 2**20:9.2f} MiB/step "
                      f"(theory {c['theoretical'] / 2**20:9.2f}, x{c['ratio']:.3f})")


def plot(summary: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        ax.plot(summary["variants"][name]["losses"], marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{summary['shape']} LlamaLike: loss per variant")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"))
    plt.close(fig)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [summary["variants"][n]["median_step_s"] for n in names])
    a.set_ylabel("median step time (s)")
    b.bar(names, [summary["variants"][n]["peak_rss_mb_per_rank"] for n in names],
          label="measured")
    b.plot(names, [summary["variants"][n]["theoretical_mb_per_rank"] for n in names], "k_",
           markersize=20, label="theoretical")
    b.set_ylabel("training peak RSS per rank (MB)")
    b.legend()
    for axis in (a, b):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{summary['shape']} LlamaLike, {summary['world']} CPU ranks")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bars.png"))
    plt.close(fig)


def check_losses(summary: dict, rtol: float) -> None:
    """Every variant trains the same thing: last losses agree with the single process."""
    ref = summary["variants"]["single"]["last_loss"]
    bad = {n: e["last_loss"] for n, e in summary["variants"].items()
           if abs(e["last_loss"] - ref) > rtol * abs(ref)}
    if bad:
        raise SystemExit(f"losses disagree with the single process ({ref}): {bad}; "
                         "timings of a variant that trains something else mean nothing")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(bench_model.SHAPES), default="73m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-rank", type=int, default=1, dest="per_rank")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="result folder (default: a new temp dir)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a folder holding another paddle_hsdp package (e.g. a git "
                         "worktree of an older commit): adds hsdp2x2_base and "
                         "hsdp1x4_base, run with it, for before/after ratios")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 3 steps, one round: checks the tool, not the engine")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.steps, args.rounds = "tiny", 3, 1
    variants = args.variants.split(",")
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
        variants += [f"{v}_base" for v in variants if v.startswith("hsdp")]
    if "single" not in variants:
        variants.append("single")
    out_dir = args.out or tempfile.mkdtemp(prefix="hsdp_bench_")
    os.makedirs(out_dir, exist_ok=True)
    results = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # alternate the order
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for variant in order:
            results[variant].append(run_variant(variant, args, out_dir, r))
    summary = summarise(results, args)
    check_losses(summary, rtol=1e-3)
    print_table(summary)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, out_dir)
    print(f"\nwrote {out_dir}/bench.json, loss.png, bars.png")
    return summary


if __name__ == "__main__":
    main()
