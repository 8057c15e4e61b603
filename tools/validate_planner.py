"""Check the planner against measured runs: the slow-link benchmark's step times, and
a tensor-parallel and a pipeline layout's bytes and communication times on CPU ranks.

    python tools/validate_planner.py --limited /tmp/th/two_hosts.json \\
        --unlimited /tmp/th_none/two_hosts.json --cluster tools/clusters/two_hosts_100mbit.yaml
    python tools/validate_planner.py --measure OUT.json --two-hosts 400mbit   # 2 x 2 ranks
    python tools/validate_planner.py --layouts tools/results/layouts_two_hosts_400mbit.json

``--measure`` trains a small PaddleFormers Llama on 4 CPU ranks in three layouts
(``hsdp2x2``; ``tp2``: mp 2 x sharding 2; ``pp2``: ``LlamaForCausalLMPipe``, pp 2 x
sharding 2) with ``tools/layouts_worker.py`` and records, for rank 0's last step, the
bytes per kind of traffic (HSDP's from paddle_hsdp's counter, tensor and pipeline
parallel ones from every gloo call on their groups) and its communication time per
kind (the step's calls replayed back to back without compute, so a slower rank's
compute is not counted), with a calibration of each link: each operation's 2-rank calls
of 16 KiB to 4 MiB (all-reduce, all-gather, paddle_hsdp's reduce-scatter, send), fitted
per operation (``per_op`` in a cluster file). ``--two-hosts RATE`` runs the ranks as
2 namespace hosts x 2 with every link (the veth between them, each host's loopback)
limited to RATE: communication then takes its time from the links, as on a cluster; on
this machine's bare loopback a gloo call's time is mostly the scheduling of 4 processes
on 2 cores, which moves the same measurement by 30% between runs.
``--layouts`` compares a recording with the planner's figures for the same model,
layouts and links: bytes within 1%, each layout's communication time within 25%.

``--limited``: ``tools/bench.py --two-hosts 100mbit --out DIR``'s result; ``--unlimited``:
the same with ``--two-hosts none`` (the time each variant spends off the slow link:
compute, intra-host collectives, the unthrottled veth). The cluster file holds the links
calibrated from one measured transfer (``tools/two_hosts.py calibrate``).

Predicted step time = unlimited step time + the planner's time on the inter-host link
(alpha-beta ring model of :mod:`paddle_hsdp.config.planner` over the bytes of
:mod:`paddle_hsdp.topology.cost`, for the benchmark's model and each variant's layout). Paddle's
DataParallel and stage 3 are not paddle_hsdp: their collectives are modelled from what
they were measured to move (DP: one all-reduce of the grads; stage 3: two all-gathers of
the parameters and one all-reduce of the grads per step, segment_size 0).
A variant is communication-bound when the predicted link time is over half its step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import bench_model

from paddle_hsdp.config import planner
from paddle_hsdp.config.schema import load_config
from paddle_hsdp.config.plan import build_lazily, build_plan, resolve_modules

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LAYOUTS = {"hsdp2x2": (2, 2, {}), "hsdp2x2_bf16": (2, 2, {"reduce_dtype": "bf16"}),
           "hsdp1x4": (1, 4, {})}


def inter_host_seconds(cluster, seconds_by_kind: dict, outer: int, inner: int) -> float:
    """The part of a layout's predicted communication on the inter-host link."""
    crossing = {"outer all_reduce"} if inner <= cluster.ranks_per_node else \
        {"inner all_gather", "inner reduce_scatter"}
    return sum(v for k, v in seconds_by_kind.items() if k in crossing)


def predict(cluster, shape) -> dict[str, float]:
    """Predicted inter-host seconds per step for every benchmark variant."""
    model = build_lazily(lambda: bench_model.build(shape))
    out = {}
    for variant, (outer, inner, dtypes) in LAYOUTS.items():
        cfg = load_config({"sub_modules_to_wrap": ["layers.{*}"], **dtypes})
        units = build_plan(model, cfg, resolve_modules(model, cfg), outer=outer,
                           inner=inner).units
        seconds = planner.step_seconds(units, cluster)
        out[variant] = inter_host_seconds(cluster, seconds, outer, inner)
    params = 4 * shape.params()  # float32 bytes
    world = cluster.world
    link = cluster.inter
    out["dp"] = planner.collective_seconds("all_reduce", world, params, link)
    out["stage3"] = 2 * planner.collective_seconds("all_gather", world, params, link) + \
        planner.collective_seconds("all_reduce", world, params, link)
    return out


# ---------------------------------------------------------------- tensor / pipeline layouts
KINDS = {"inner all_gather": ("inner", "all_gather"), "inner reduce_scatter":
         ("inner", "reduce_scatter"), "outer all_reduce": ("outer", "all_reduce")}


def layout_predictions(result: dict, name: str) -> dict:
    """The planner's bytes and seconds per kind for one measured layout (rank 0)."""
    from paddle_hsdp.config import layouts
    from paddle_hsdp.topology import cost

    s, lay = result["shape"], result["layouts"][name]["layout"]
    shape = planner.ModelShape(s["layers"], s["hidden"], s["ffn"], s["vocab"],
                               s["kv_heads"] / s["heads"], False, s["heads"])
    tp, pp = lay.get("mp_degree", 1), lay.get("pp_degree", 1)
    outer = lay["outer"]
    inner = lay["sharding_degree"] // outer
    micro = result["micro_steps"]
    work = layouts.Workload(result["seq"], result["micro_batch"], act_bytes=4)
    dtypes = {"master_bytes": 4, "gather_bytes": 4, "reduce_bytes": 4, "compute_bytes": 4}
    units = planner.shape_units(shape, inner, outer, dtypes, True, "none", tp, pp)
    cluster = calibrated_cluster(result["calibration"])
    option = planner._layout_option(cluster, shape, work, units, tp, pp, outer, inner,
                                    "none", micro, None, 1)
    wire = cost.step_comm(units, micro)
    bytes_ = {kind: wire.get(key, 0.0) for kind, key in KINDS.items()}
    bytes_["tensor parallel"] = 2 * (tp - 1) / tp * layouts.tp_bytes(shape, work, tp, pp, micro)
    bytes_["pipeline p2p"] = layouts.pp_bytes(shape, work, tp, pp, micro)
    return {"bytes": bytes_, "seconds": {k: option.seconds.get(k, 0.0) for k in
                                         list(KINDS) + ["tensor parallel", "pipeline p2p"]}}


# ring steps and wire bytes of one 2-rank call of ``payload`` bytes, as the planner
# counts them (point-to-point: one message of the payload)
_RING_2 = {"all_reduce": lambda p: (2, p), "all_gather": lambda p: (1, p / 2),
           "reduce_scatter": lambda p: (1, p / 2), "send": lambda p: (1, p)}


def fit_link(calibration: list, op: str, link: str = "intra") -> tuple[float, float]:
    """``(latency per ring step, bytes per second)`` that fit the calibration's 2-rank
    calls of ``op`` on ``link`` best (least squares on the ring model's time, relative to
    each measurement)."""
    import numpy as np

    rows = []
    for where, name, payload, seconds in calibration:
        if (where, name) == (link, op):
            steps, wire = _RING_2[op](payload)
            rows.append([steps / seconds, wire / seconds])
    (latency, seconds_per_byte), *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)),
                                                      rcond=None)
    return max(latency, 1e-7), 1 / max(seconds_per_byte, 1e-15)


def calibrated_cluster(calibration: list):
    """The measured machine as the planner sees it, each link fitted per operation: one
    machine of 4 ranks on the gloo loopback, or (two-host runs) 2 hosts x 2 ranks, the
    loopback inside a host and the veth between them (gloo, nothing overlapped)."""
    def spec(op, link):
        latency, bandwidth = fit_link(calibration, op, link)
        return {"bandwidth_gbit": bandwidth * 8 / 1e9, "latency_us": latency * 1e6}

    def fitted(link):
        return dict(spec("all_gather", link), per_op={op: spec(op, link) for op in _RING_2})

    two = any(row[0] == "inter" for row in calibration)
    return planner.load_cluster({
        "name": "this machine as 2 hosts x 2 CPU ranks, every link limited" if two else
                "this machine, 4 CPU ranks (gloo loopback)",
        "nodes": 2 if two else 1, "ranks_per_node": 2 if two else 4,
        "intra_node": fitted("intra"), "inter_node": fitted("inter" if two else "intra"),
        "device_memory_gib": 24, "overlap_intra_node": False, "backend": "gloo"})


def layout_measurements(result: dict, name: str) -> dict:
    entry = result["layouts"][name]
    payload, seconds = entry["pg_payload_bytes"], entry["replayed_s"]
    tp = entry["layout"].get("mp_degree", 1)
    bytes_ = {kind: entry["hsdp_wire_bytes"].get(kind, 0.0) for kind in KINDS}
    bytes_["tensor parallel"] = 2 * (tp - 1) / tp * payload.get("mp all_reduce", 0.0)
    bytes_["pipeline p2p"] = payload.get("pp send", 0.0) + payload.get("pp recv", 0.0)
    times = {"inner all_gather": seconds.get("inner all_gather", 0.0),
             # gloo has no reduce-scatter: paddle_hsdp's fallback's calls on the inner group
             "inner reduce_scatter": sum(v for k, v in seconds.items()
                                         if k.startswith("inner ") and k != "inner all_gather"),
             "outer all_reduce": sum(v for k, v in seconds.items() if k.startswith("outer ")),
             "tensor parallel": sum(v for k, v in seconds.items() if k.startswith("mp ")),
             "pipeline p2p": seconds.get("pp send", 0.0) + seconds.get("pp recv", 0.0)}
    return {"bytes": bytes_, "seconds": times}


def compare_layouts(path: str, max_time_error: float, max_bytes_error: float) -> bool:
    result = json.load(open(path))
    cluster = calibrated_cluster(result["calibration"])
    print(f"planner vs {path}: a {result['shape']} Llama, seq {result['seq']}, "
          f"{result['micro_steps']} micro-batches of {result['micro_batch']} per rank on "
          f"{cluster.name}; links fitted per operation to 2-rank calls of 16 KiB to 4 MiB "
          f"(latency per ring step + bandwidth):")
    for where, link in (("intra", cluster.intra), ("inter", cluster.inter)):
        if where == "inter" and cluster.nodes == 1:
            continue
        print(f"  {where}: " + ", ".join(
            f"{op} {link.for_op(op).latency_s * 1e6:.0f} us + "
            f"{link.for_op(op).bandwidth / 1e6:.1f} MB/s" for op in _RING_2))
    print(f"{'layout':8s} {'kind':22s} {'bytes pred':>11s} {'measured':>11s} {'error':>7s} "
          f"{'ms pred':>9s} {'measured':>9s} {'error':>7s}")
    ok = True
    for name in result["layouts"]:
        pred, meas = layout_predictions(result, name), layout_measurements(result, name)
        total = [0.0, 0.0]
        for kind in pred["bytes"]:
            pb, mb = pred["bytes"][kind], meas["bytes"][kind]
            ps, ms = pred["seconds"][kind], meas["seconds"][kind]
            if not (pb or mb):
                continue
            be = pb / mb - 1 if mb else float("inf")
            te = ps / ms - 1 if ms else float("inf")
            ok &= abs(be) <= max_bytes_error
            total[0] += ps
            total[1] += ms
            print(f"{name:8s} {kind:22s} {pb:>11,.0f} {mb:>11,.0f} {be:>+7.1%} "
                  f"{ps * 1e3:>9.2f} {ms * 1e3:>9.2f} {te:>+7.1%}")
        te = total[0] / total[1] - 1
        ok &= abs(te) <= max_time_error
        print(f"{name:8s} {'all communication':22s} {'':>11s} {'':>11s} {'':>7s} "
              f"{total[0] * 1e3:>9.2f} {total[1] * 1e3:>9.2f} {te:>+7.1%}")
    print(f"bytes within {max_bytes_error:.0%} and each layout's communication time within "
          f"{max_time_error:.0%}: {'yes' if ok else 'NO'}")
    return ok


def measure(out: str, two_hosts: str | None = None) -> int:
    """Run tools/layouts_worker.py on 4 ranks: on this machine's loopback, or as 2 hosts x
    2 ranks with every link limited to ``two_hosts`` (a tc rate)."""
    import subprocess
    import tempfile

    log_dir = tempfile.mkdtemp(prefix="validate_layouts_")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(HERE, "layouts_worker.py")
    cfg = json.dumps({"out": os.path.abspath(out), "two_hosts": two_hosts})
    if two_hosts:
        from two_hosts import TwoHosts, Unavailable

        try:
            with TwoHosts(rate=two_hosts, loopback_rate=two_hosts) as hosts:
                codes = hosts.launch(2, script, [cfg], log_dir=log_dir, env=env)
        except Unavailable as e:
            print(f"two hosts unavailable here: {e}")
            return 2
        code = max(codes)
    else:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
               "--log_dir", log_dir, script, cfg]
        code = subprocess.call(cmd, env=env, cwd=log_dir)
    print(f"{'wrote ' + out if code == 0 else 'failed'} (logs in {log_dir})")
    return code


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limited")
    ap.add_argument("--unlimited")
    ap.add_argument("--measure", metavar="OUT.json",
                    help="run the tensor / pipeline layouts on 4 CPU ranks, write OUT.json")
    ap.add_argument("--two-hosts", metavar="RATE",
                    help="with --measure: 2 namespace hosts x 2 ranks, every link (the veth "
                         "and each host's loopback) limited to RATE (e.g. 400mbit)")
    ap.add_argument("--layouts", metavar="RESULT.json",
                    help="compare --measure's result with the planner")
    ap.add_argument("--max-bytes-error", type=float, default=0.01)
    ap.add_argument("--cluster", default=os.path.join(HERE, "clusters",
                                                      "two_hosts_100mbit.yaml"))
    ap.add_argument("--max-error", type=float, default=0.25)
    args = ap.parse_args(argv)
    if args.measure:
        return measure(args.measure, args.two_hosts)
    if args.layouts:
        return 0 if compare_layouts(args.layouts, args.max_error, args.max_bytes_error) else 1
    if not (args.limited and args.unlimited):
        ap.error("give --limited and --unlimited, or --measure, or --layouts")
    limited = json.load(open(args.limited))
    unlimited = json.load(open(args.unlimited))
    cluster = planner.load_cluster(args.cluster)
    shape = bench_model.SHAPES[limited["shape"]]
    link = predict(cluster, shape)
    print(f"planner vs {args.limited} ({limited['rate']}, {limited['shape']}, engine "
          f"{limited.get('engine')}); cluster {cluster.name}")
    print(f"{'variant':14s} {'off-link s':>10s} {'link s':>8s} {'predicted':>9s} "
          f"{'measured':>8s} {'error':>7s}  bound")
    ok = True
    for variant, result in limited["variants"].items():
        base = unlimited["variants"][variant]["median_step_s"]
        predicted = base + link[variant]
        measured = result["median_step_s"]
        error = predicted / measured - 1
        bound = link[variant] > predicted / 2
        if bound and abs(error) > args.max_error:
            ok = False
        print(f"{variant:14s} {base:>10.3f} {link[variant]:>8.3f} {predicted:>9.3f} "
              f"{measured:>8.3f} {error:>+7.1%}  {'comm' if bound else 'compute'}")
    print(f"communication-bound variants within {args.max_error:.0%}: "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
