"""Check the planner against the slow-link benchmark: predicted and measured step times.

    python tools/validate_planner.py --limited /tmp/th/two_hosts.json \\
        --unlimited /tmp/th_none/two_hosts.json --cluster tools/clusters/two_hosts_100mbit.yaml

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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import bench_model  # noqa: E402

from paddle_hsdp.config import planner  # noqa: E402
from paddle_hsdp.config.schema import load_config  # noqa: E402
from paddle_hsdp.config.plan import build_lazily, build_plan, resolve_modules  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limited", required=True)
    ap.add_argument("--unlimited", required=True)
    ap.add_argument("--cluster", default=os.path.join(HERE, "clusters",
                                                      "two_hosts_100mbit.yaml"))
    ap.add_argument("--max-error", type=float, default=0.25)
    args = ap.parse_args(argv)
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
