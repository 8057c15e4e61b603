"""Sweep HSDP next to tensor parallelism over layouts: mp 2 x outer O x inner I.

    PYTHONPATH=test_collective/workers .venv/bin/python tools/sweep_tp_layouts.py  # O 1..4, I 1, 2
    PYTHONPATH=test_collective/workers .venv/bin/python tools/sweep_tp_layouts.py \
        --outer 3 --inner 1 --json out.json

(test_collective/workers, for the floors computed here: tp_llama.py's reference and
parity.py's measure; ``--no-floor`` runs without it.)

Each layout is one launch of ``test_collective/workers/worker_tp_llama.py`` on
``2 * O * I`` CPU ranks (mp2 x sharding O*I, ``fsdp_outer_degree`` O), one at a time:
PaddleFormers' tensor-parallel ``LlamaForCausalLM`` in float64, trained for 6 steps of
2 micro-batches with SGD and with AdamW, ``ClipGradByGlobalNorm`` active at every step,
against the one-process model on all replicas' rows (tp_llama.py's reference, the mean
over the replicas taken after backward: its [Note: the Llama's float32 islands]). The
worker checks everything against workers/parity.py's float64 bound itself; this prints
what it measured, worst over every rank: the largest relative difference of any final
parameter (each rank's mp slice, relative to the one-process tensor's largest value),
of the losses, and the largest absolute loss difference, and the smallest pre-clip norm
over the clip bound (above 1: the clip was active at every step).

The ``floor`` column is the one-process reference against itself with only the float
order changed (each row its own backward, rows and micro-batches in reverse order):
the noise floor a parity bound must sit above (tools/noise_floor.py does the same for
TinyLM). About 6 minutes for the default sweep on this project's 2-core machine (the
16-rank launch alone 100 s).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "test_collective", "workers")
RUNS = ("clip_sgd", "clip_adamw")  # worker_tp_llama.py's runs of 6 steps, clip active
STEPS, MICRO, PER_RANK = 6, 2, 2  # as worker_tp_llama.py's LONG_STEPS, MICRO, PER_RANK


def launch(outer: int, inner: int, timeout: int) -> tuple[list[dict], str, float]:
    """One layout's launch: ``(figures of every rank, status, seconds)``."""
    nproc = 2 * outer * inner
    layout = {"mp_degree": 2, "sharding_degree": outer * inner, "outer": outer,
              "runs": list(RUNS)}
    log_dir = tempfile.mkdtemp(prefix=f"hsdp_sweep_tp_o{outer}i{inner}_")
    env = dict(os.environ, GLOG_minloglevel="2", PYTHONPATH=os.pathsep.join(
        [ROOT, WORKERS, os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    try:
        rc = subprocess.run(
            [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
             str(nproc), "--log_dir", log_dir, os.path.join(WORKERS, "worker_tp_llama.py"),
             json.dumps({"layouts": [layout]})], env=env, cwd=log_dir, timeout=timeout,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    seconds = time.perf_counter() - start
    figures, ok = [], 0
    for path in glob.glob(os.path.join(log_dir, "workerlog.*")):
        text = open(path, errors="replace").read()
        ok += "WORKER_OK" in text
        figures += [json.loads(line[len("TP_LLAMA_FIGURES "):]) for line in text.splitlines()
                    if line.startswith("TP_LLAMA_FIGURES ")]
    status = "ok" if rc == 0 and ok == nproc else f"exit {rc}, {ok}/{nproc} OK ({log_dir})"
    return figures, status, seconds


def noise_floor(replicas: int, kind: str) -> float:
    """The one-process reference of ``replicas`` sharding ranks against itself with only
    the float order changed: every row its own forward and backward (the grads divided
    by the rows instead of the replicas after backward, its loss by the micro-batches
    before: the same powers of two, so the float32 islands see the same values), the
    rows and the micro-batches in reverse order."""
    import paddle
    import tp_llama
    from parity import max_rel

    paddle.set_default_dtype("float64")
    weights = tp_llama.full_weights(7)
    data = tp_llama.batches(replicas * PER_RANK, STEPS, MICRO)
    flipped = [[ids[::-1].copy() for ids in step[::-1]] for step in data]
    a = tp_llama.reference(weights, data, replicas=replicas, kind=kind)
    b = tp_llama.reference(weights, flipped, replicas=replicas * PER_RANK, kind=kind)
    worst = [max_rel(b["losses"], a["losses"])]
    worst += [max_rel(b["params"][k], v) for k, v in a["params"].items()]
    return max(worst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outer", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--inner", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=int, default=600, help="per launch, seconds")
    ap.add_argument("--no-floor", action="store_true", help="skip the one-process floors")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    if not args.no_floor:  # before the first launch, not after it
        pythonpath.require("sweep_tp_layouts", pythonpath.WORKERS, ("tp_llama", "parity"),
                           f"PYTHONPATH={pythonpath.WORKERS} .venv/bin/python "
                           "tools/sweep_tp_layouts.py")
    rows, failed = [], 0
    floors: dict = {}
    for outer in args.outer:
        for inner in args.inner:
            figures, status, seconds = launch(outer, inner, args.timeout)
            failed += status != "ok"
            for run in RUNS:
                mine = [f for f in figures if f["run"] == run]
                kind = "sgd" if run == "clip_sgd" else "adamw"
                key = (outer * inner, kind)
                if not args.no_floor and key not in floors:
                    floors[key] = noise_floor(*key)
                row = {"outer": outer, "inner": inner, "ranks": 2 * outer * inner,
                       "run": run, "status": status, "seconds": round(seconds, 1),
                       "floor": floors.get(key)}
                if mine:
                    row.update({k: max(f[k] for f in mine) for k in
                                ("params", "loss", "loss_abs", "norm")})
                    row["min_norm_over_clip"] = min(f["min_norm_over_clip"] for f in mine)
                    row["steps"] = mine[0]["steps"]
                rows.append(row)
            print(f"mp2 x outer {outer} x inner {inner}: {status} ({seconds:.0f} s)",
                  flush=True)
    print("\n| layout | ranks | optimizer | params (max rel) | loss (max rel) | loss (max abs) "
          "| pre-clip norm (max rel) | min norm / clip | floor | launch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def cell(key, fmt=".1e"):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"| mp2 x outer {r['outer']} x inner {r['inner']} | {r['ranks']} | "
              f"{'SGD' if r['run'] == 'clip_sgd' else 'AdamW'} | {cell('params')} | "
              f"{cell('loss')} | {cell('loss_abs')} | {cell('norm')} | "
              f"{cell('min_norm_over_clip', '.2f')} | {cell('floor')} | "
              f"{r['status']}, {r['seconds']:.0f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
