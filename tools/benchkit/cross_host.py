"""The figures of a two-host run: step times and their ratios, the bytes that crossed
the link against the ring and gloo models, the targets, the loss check."""

from __future__ import annotations

import statistics
import time

import bench_model
from benchkit.settings import (AGREEMENT, DILOCO, RANKS_PER_HOST, TWO_HOST_BYTE_TARGETS,
                               TWO_HOST_TARGETS)


def cross_host_figures(runs: list) -> dict:
    """Bytes per timed step across the link, over every round: (a) expected, (b) the
    veth's frames and TCP payload, and how far (b) is from (a)."""
    nets = [r["two_hosts"] for r in runs]
    steps = sum(n["window_steps"] for n in nets)
    expected = sum(n["expected_cross_bytes"] for n in nets) / steps
    expected_gloo = sum(n["expected_cross_bytes_gloo"] for n in nets) / steps
    payload = sum(n["veth_payload_bytes"] for n in nets) / steps
    diff = (payload - expected) / expected if expected else None
    diff_gloo = (payload - expected_gloo) / expected_gloo if expected_gloo else None
    return {"expected_bytes_per_step": expected, "expected_basis": nets[0]["expected_basis"],
            "expected_gloo_bytes_per_step": expected_gloo,
            "veth_frame_bytes_per_step": sum(n["veth_bytes"] for n in nets) / steps,
            "veth_payload_bytes_per_step": payload, "payload_vs_expected": diff,
            "agrees": diff is not None and abs(diff) <= AGREEMENT,
            "payload_vs_expected_gloo": diff_gloo,
            "agrees_gloo": diff_gloo is not None and abs(diff_gloo) <= AGREEMENT,
            "retrans_segs": sum(sum(n["retrans_segs_per_host"].values()) for n in nets),
            "rto_timeouts": sum(sum(n["rto_timeouts_per_host"].values()) for n in nets),
            "qdisc_drops": sum(r["launch_qdisc_drops"] for r in runs),
            "launch_veth_bytes": [r["launch_veth_bytes"] for r in runs],
            "hosts_of_ranks": nets[0]["hosts_of_ranks"]}


def summarise_two_hosts(results: dict, args) -> dict:
    shape = bench_model.SHAPES[args.shape]
    summary = {"rate": args.two_hosts, "shape": args.shape, "params": shape.params(),
               "steps": args.steps, "per_rank": args.per_rank, "rounds": args.rounds,
               "hosts": 2, "ranks_per_host": RANKS_PER_HOST,
               "date": time.strftime("%Y-%m-%d"), "variants": {},
               "notes": {
                   "expected": "(a) ring: sum over ranks of the ring bytes each rank "
                               "sends to a ring successor on the other host (groups in rank "
                               "order); (a) gloo: the same but reduce-scatters as "
                               "paddle_hsdp makes them on gloo (a gloo reduce per owner's "
                               "slice, modelled as ring reduce-scatter + pieces to the owner)",
                   "hsdp1x4": "its inner group spans both hosts: 2 of the 4 ring links "
                              "cross, so half of the ring traffic is counted as crossing; "
                              "gloo has no reduce-scatter and paddle_hsdp reduces each slice "
                              "to its owner instead, whose traffic need not follow a ring",
                   "dp/stage3": "Paddle's collectives are not counted by paddle_hsdp's "
                                "counter: ring formula on the model's sizes",
                   "hfsdp2x2": "its outer reduce-scatter over two ranks is an exchange "
                               "of slices (one all-gather of a slice each; gloo has no "
                               "reduce-scatter): a ring's bytes, like hsdp2x2's outer "
                               "all-reduce",
                   "*_diloco16": "DiLoCo: the replicas train apart and sync every 16 "
                                 "steps (a reduce-scatter of the pseudo-gradient and an "
                                 "all-gather of the new params); its step time is the "
                                 "mean over the timed steps, the sync's included",
                   "*_diloco16_f<F>": "streaming DiLoCo: the units dealt by size into "
                                      "F fragments (an engine from before 2026-12-07, "
                                      "as a _base run: unit i in fragment i % F) synced "
                                      "in turn, one every 16 / F steps: the same bytes "
                                      "per step as *_diloco16, each sync a fragment's",
                   "*_int8": "the outer sync as blockwise int8 codes and a float32 "
                              "scale per 256 values with error feedback: an all-gather "
                              "of every replica's message (counter op all_reduce_int8)",
                   "veth_payload": "frames minus 66 bytes of Ethernet/IPv4/TCP headers "
                                   "each (pure ACKs carry none)",
                   "retx/rto": "TCP segments retransmitted and retransmission timeouts "
                               "(stalls of >= 200 ms) in both hosts over the timed steps "
                               "of all rounds"}}
    for variant, runs in results.items():
        steady = [t for r in runs for t in r["step_times"][1:]]
        summary["variants"][variant] = {
            "median_step_s": statistics.median(steady), "mean_step_s": statistics.mean(steady),
            "step_times": steady,
            "last_loss": runs[-1]["losses"][-1], "losses": runs[-1]["losses"],
            "cross_host": cross_host_figures(runs)}
    add_ratios(summary)
    summary["targets"] = [target_status(summary, *t) for t in TWO_HOST_TARGETS]
    summary["byte_targets"] = [byte_target_status(summary, *t) for t in TWO_HOST_BYTE_TARGETS]
    return summary


def byte_target_status(summary: dict, variant: str, base: str, at_most: float | None) -> dict:
    """Cross-host bytes per step (the veth's TCP payload, and the counter's ring
    figure) of ``variant`` over ``base``'s, measured in the same run."""
    variants = summary["variants"]
    ratios = {}
    if variant in variants and base in variants:
        ours, theirs = variants[variant]["cross_host"], variants[base]["cross_host"]
        ratios = {key: ours[key] / theirs[key] for key in
                  ("veth_payload_bytes_per_step", "expected_bytes_per_step") if theirs[key]}
    ratio = ratios.get("veth_payload_bytes_per_step")
    return {"variant": variant, "vs": base, "at_most": at_most, "ratio": ratio,
            "expected_ratio": ratios.get("expected_bytes_per_step"),
            "met": None if ratio is None or at_most is None else ratio <= at_most}


def add_ratios(summary: dict) -> None:
    variants = summary["variants"]
    for entry in variants.values():
        for base in ("dp", "stage3", "hsdp2x2"):
            if base in variants:
                entry[f"time_vs_{base}"] = \
                    entry["median_step_s"] / variants[base]["median_step_s"]
                entry[f"mean_time_vs_{base}"] = \
                    entry["mean_step_s"] / variants[base]["mean_step_s"]
        if "hsdp2x2" in variants:  # HFSDP: the same cross-host bytes as HSDP's
            ours, theirs = entry["cross_host"], variants["hsdp2x2"]["cross_host"]
            entry["cross_vs_hsdp2x2"] = {
                key: ours[key] / theirs[key] - 1 if theirs[key] else None
                for key in ("expected_bytes_per_step", "expected_gloo_bytes_per_step",
                            "veth_payload_bytes_per_step")}
        if "dp" in variants:
            entry["last_loss_diff_vs_dp"] = abs(entry["last_loss"] - variants["dp"]["last_loss"])


def target_status(summary: dict, variant: str, base: str, at_most: float) -> dict:
    # (DiLoCo: means, its sync step included)
    key = f"mean_time_vs_{base}" if DILOCO in variant else f"time_vs_{base}"
    ratio = summary["variants"].get(variant, {}).get(key)
    return {"variant": variant, "vs": base, "at_most": at_most, "ratio": ratio,
            "met": None if ratio is None or at_most is None else ratio <= at_most}


def check_two_host_losses(summary: dict) -> None:
    """Same training everywhere: last losses agree with DataParallel's (bfloat16 reduce
    and the int8 outer sync are allowed their rounding)."""
    variants = summary["variants"]
    if "dp" not in variants:
        return
    ref = variants["dp"]["last_loss"]
    bad = {n: e["last_loss"] for n, e in variants.items() if DILOCO not in n
           and abs(e["last_loss"] - ref) > (1e-2 if n.endswith(("_bf16", "_int8")) else 1e-3) * abs(ref)}
    if bad:
        raise SystemExit(f"losses disagree with DataParallel's ({ref}): {bad}")
