"""The figures of a one-host run: medians, peaks against the theoretical per-rank bytes,
the wire bytes against the formulas, the memory timeline's peaks, the loss check."""

from __future__ import annotations

import statistics
import time

import bench_model
from benchkit.settings import WORLD


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
        inner = 2 if "2x2" in variant else WORLD
        # AdamW's moments: 1/O of the shard with HFSDP (outer O = 2)
        moments = 8 / (WORLD // inner) if variant.startswith("hfsdp") else 8
        # shards of everything; the root gathered throughout; two layers gathered and one
        # layer's full grads at a time; of the root's full grads, the larger of its two
        # buffers' (the head's, reduced after its backward; the embedding's, at the end)
        embed = shape.vocab * shape.hidden
        if "_muon" in variant:  # the blocks' matrices take Muon (one momentum, 4 B)
            moments = 4
        states = (8 + moments) * p / inner + 4 * root + 3 * 4 * layer \
            + 4 * max(embed, root - embed)
        if variant.endswith("_muon_replicate"):  # the matrices whole on every rank
            states += (8 + moments) * shape.layers * layer * (1 - 1 / inner)
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
        if "timeline" in runs[-1]:
            entry["timeline"] = timeline_summary(runs[-1]["timeline"])
        if runs[-1].get("optimizer_bytes") is not None:
            entry["optimizer_mb_per_rank"] = runs[-1]["optimizer_bytes"] / 2 ** 20
        if "comm_measured" in runs[-1]:
            measured, theory = runs[-1]["comm_measured"], runs[-1]["comm_theoretical"]
            entry["comm_bytes_per_step"] = {
                k: {"measured": measured[k], "theoretical": theory[k],
                    "ratio": measured[k] / theory[k] if theory[k] else None}
                for k in theory}
        if runs[-1].get("owner_imbalance") is not None:
            entry["owner_imbalance"] = runs[-1]["owner_imbalance"]
        if runs[-1].get("ns_flops"):
            entry["ns_flops"] = runs[-1]["ns_flops"]
        summary["variants"][variant] = entry
    for name, entry in summary["variants"].items():
        twin = summary["variants"].get(name + "_replicate")
        if twin is not None:  # owned Muon against Replicate() Muon: the point of owners
            entry["memory_vs_replicate"] = entry["peak_rss_mb_per_rank"] / \
                twin["peak_rss_mb_per_rank"]
            entry["time_vs_replicate"] = entry["median_step_s"] / twin["median_step_s"]
            if "optimizer_mb_per_rank" in entry and "optimizer_mb_per_rank" in twin:
                entry["optimizer_vs_replicate"] = entry["optimizer_mb_per_rank"] / \
                    twin["optimizer_mb_per_rank"]
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


def timeline_summary(timeline: dict) -> dict:
    """Rank 0's memory timeline (tools/bench_worker.py) as it is, plus the engine's bytes
    by kind at the event where their sum peaks and where the sampled RSS peaks."""
    kinds = [k for k in timeline["bytes"] if k != "rss"]
    total = [sum(timeline["bytes"][k][i] for k in kinds) for i in range(len(timeline["t"]))]

    def row(i):
        return {"event": timeline["event"][i], "unit": timeline["unit"][i],
                "t": timeline["t"][i], **{k: timeline["bytes"][k][i] for k in kinds},
                "engine": total[i],
                "rss_above_idle": timeline["bytes"]["rss"][i] - timeline["idle_rss"]
                if "rss" in timeline["bytes"] else None}
    out = {"columns": timeline}
    if total:
        out["at_engine_peak"] = row(max(range(len(total)), key=total.__getitem__))
        rss = timeline["bytes"].get("rss")
        if rss:
            out["at_rss_peak"] = row(max(range(len(rss)), key=rss.__getitem__))
    return out


def check_losses(summary: dict, rtol: float) -> None:
    """Every variant trains the same thing: last losses agree with the single process
    (AdamW); the Muon variants with each other (owned and Replicate(), every layout)."""
    variants = summary["variants"]
    muon = [n for n in variants if "_muon" in n]
    groups = [("the single process", variants["single"]["last_loss"],
               [n for n in variants if n not in muon])]
    if muon:
        groups.append((muon[0], variants[muon[0]]["last_loss"], muon))
    for label, ref, names in groups:
        bad = {n: variants[n]["last_loss"] for n in names
               if abs(variants[n]["last_loss"] - ref) > rtol * abs(ref)}
        if bad:
            raise SystemExit(f"losses disagree with {label} ({ref}): {bad}; timings of a "
                             "variant that trains something else mean nothing")
