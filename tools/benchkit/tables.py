"""The printed tables: the one-host comparison (with the timelines' peaks and the wire
bytes) and the two-host one."""

from __future__ import annotations

import bench_model
from benchkit.settings import AGREEMENT


def print_table(summary: dict) -> None:
    print(f"\n{summary['shape']} LlamaLike ({summary['params'] / 1e6:.1f}M params), "
          f"{summary['world']} CPU ranks, {summary['per_rank']} sequence(s) of "
          f"{bench_model.SHAPES[summary['shape']].seq} per rank, {summary['steps']} steps x "
          f"{summary['rounds']} round(s), {summary['date']}")
    print("stage3 = Paddle's GroupShardedStage3(segment_size=0) with its CUDA check "
          "bypassed during construction (CPU)")
    head = (f"{'variant':12s} {'step s':>8s} {'vs dp':>6s} {'vs st3':>6s} {'peak MB':>8s} "
            f"{'theory':>7s} {'vs st3':>6s} {'vs th.':>6s} {'optim MB':>8s} {'loss diff':>9s}")
    print(head)
    for name, e in summary["variants"].items():
        optim = e.get("optimizer_mb_per_rank")
        print(f"{name:12s} {e['median_step_s']:8.3f} {e.get('time_vs_dp', 0):6.2f} "
              f"{e.get('time_vs_stage3', 0):6.2f} {e['peak_rss_mb_per_rank']:8.0f} "
              f"{e['theoretical_mb_per_rank']:7.0f} {e.get('memory_vs_stage3', 0):6.2f} "
              f"{e['memory_vs_theoretical']:6.2f} "
              f"{'-' if optim is None else f'{optim:.1f}':>8s} "
              f"{e['last_loss_diff_vs_single']:9.2e}")
    for name, e in summary["variants"].items():
        ns = e.get("ns_flops")
        if ns and ns["model"]:  # Muon: Newton-Schulz work per rank against the model's
            print(f"{name:12s} Newton-Schulz flops per step: largest rank "
                  f"{ns['max_rank'] / ns['model']:.3f} of the model's, all ranks together "
                  f"{ns['all_ranks'] / ns['model']:.2f}x it (once per job: 1.00x)")
    for name, e in summary["variants"].items():
        if "memory_vs_replicate" in e:  # owned Muon against Replicate() Muon
            optim = e.get("optimizer_vs_replicate")
            print(f"{name:12s} vs its Replicate() twin: peak memory "
                  f"{e['memory_vs_replicate']:.2f}x, step time {e['time_vs_replicate']:.2f}x"
                  + ("" if optim is None else f", optimizer state {optim:.2f}x")
                  + (f"; owner imbalance {e['owner_imbalance']:.2f}"
                     if "owner_imbalance" in e else ""))
    for name, e in summary["variants"].items():
        for where in ("at_engine_peak", "at_rss_peak"):
            r = e.get("timeline", {}).get(where)
            if r:
                mb = 2 ** 20
                parts = ", ".join(f"{k} {r[k] / mb:.0f}" for k in
                                  ("shard", "shard_grad", "optimizer", "gathered",
                                   "full_grad", "staging"))
                rss = "" if r["rss_above_idle"] is None else \
                    f"; RSS above idle {r['rss_above_idle'] / mb:.0f}"
                print(f"{name:12s} timeline {where.replace('_', ' ')} ({r['event']}, unit "
                      f"{r['unit']}): engine {r['engine'] / mb:.0f} MB = {parts}{rss}")
    for name, e in summary["variants"].items():
        for kind, c in e.get("comm_bytes_per_step", {}).items():
            if c["theoretical"]:
                print(f"{name:12s} {kind:22s} {c['measured'] / 2**20:9.2f} MiB/step "
                      f"(theory {c['theoretical'] / 2**20:9.2f}, x{c['ratio']:.3f})")


def print_two_hosts(summary: dict) -> None:
    import two_hosts

    mb = 1e6
    rate = two_hosts.parse_rate(summary["rate"])
    print(f"\n2 hosts x {summary['ranks_per_host']} ranks, link {summary['rate']}"
          + (f" ({rate / mb:.1f} MB/s each way)" if rate else "")
          + f", {summary['shape']} LlamaLike ({summary['params'] / 1e6:.1f}M params), "
          f"{summary['per_rank']} sequence(s) per rank, {summary['steps']} steps x "
          f"{summary['rounds']} round(s), {summary['date']}, engine {summary['engine']}")
    print("cross-host MB per step: (a) expected from the ranks' traffic (ring; gloo model), "
          "(b) veth frames and TCP payload; diff = payload / (a) - 1")
    print(f"{'variant':13s} {'step s':>6s} {'vs dp':>5s} {'vs st3':>6s} {'(a)ring':>7s} "
          f"{'(a)gloo':>7s} {'frames':>7s} {'payload':>7s} {'diff':>7s}  {'diff gl':>7s}  "
          f"{'retx':>4s} {'rto':>3s} {'loss diff':>9s}")
    for name, e in summary["variants"].items():
        c = e["cross_host"]
        print(f"{name:13s} {e['median_step_s']:6.3f} {_ratio(e, 'dp'):>5s} "
              f"{_ratio(e, 'stage3'):>6s} {c['expected_bytes_per_step'] / mb:7.2f} "
              f"{c['expected_gloo_bytes_per_step'] / mb:7.2f} "
              f"{c['veth_frame_bytes_per_step'] / mb:7.2f} "
              f"{c['veth_payload_bytes_per_step'] / mb:7.2f} "
              f"{_percent(c['payload_vs_expected'], c['agrees'])} "
              f"{_percent(c['payload_vs_expected_gloo'], c['agrees_gloo'])} "
              f"{c['retrans_segs']:4d} {c['rto_timeouts']:3d} "
              f"{e.get('last_loss_diff_vs_dp', 0):9.2e}")
    print("! = payload and (a) differ by more than "
          f"{AGREEMENT:.0%} (control traffic, or traffic the ring model does not describe)")
    for t in summary["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        print(f"target {t['variant']} <= {t['at_most']}x {t['vs']}: {ratio} {verdict}")
    for t in summary.get("byte_targets", []):
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.3f}x"
        expected = "" if t["expected_ratio"] is None else \
            f" (counter, ring: {t['expected_ratio']:.3f}x)"
        bound = "" if t["at_most"] is None else f" <= {t['at_most']}x"
        if t["at_most"] is None:
            verdict = "(no target)"
        print(f"{t['variant']} cross-host bytes{bound} vs {t['vs']}'s: {ratio}{expected} "
              f"{verdict}")
    cross = summary["variants"].get("hfsdp2x2", {}).get("cross_vs_hsdp2x2")
    if cross:  # HFSDP's cross-host bytes against HSDP's (target: equal within 1%)
        print("hfsdp2x2 cross-host bytes vs hsdp2x2: " + ", ".join(
            f"{key.replace('_bytes_per_step', '')} {value:+.1%}"
            for key, value in cross.items() if value is not None))
    for key, note in summary["notes"].items():
        print(f"  {key}: {note}")


def _ratio(entry: dict, base: str) -> str:
    ratio = entry.get(f"time_vs_{base}")
    return "-" if ratio is None else f"{ratio:.2f}"


def _percent(diff, agrees: bool) -> str:
    return f"{'n/a' if diff is None else f'{diff:+.1%}':>7s}{' ' if agrees else '!'}"
