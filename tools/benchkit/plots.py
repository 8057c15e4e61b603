"""The pictures of a one-host run: loss.png, bars.png and timeline.png."""

from __future__ import annotations

import os


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
    plot_timelines(summary, out_dir, plt)


TIMELINE_COLOURS = {"shard": "tab:blue", "shard_grad": "tab:cyan", "optimizer": "tab:purple",
                    "gathered": "tab:green", "full_grad": "tab:red", "staging": "tab:orange"}


def plot_timelines(summary: dict, out_dir: str, plt) -> None:
    """``timeline.png``: rank 0's memory timeline of each hsdp variant that recorded one,
    one line per kind of engine bytes, their sum, and the process RSS above idle where
    sampled (the dotted line: the training peak the table reports); backward shaded."""
    named = [(n, e["timeline"]) for n, e in summary["variants"].items() if "timeline" in e]
    if not named:
        return
    mb = 2 ** 20
    fig, axes = plt.subplots(len(named), 1, figsize=(12, 3.6 * len(named)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], named):
        cols = tl["columns"]
        t, by = cols["t"], cols["bytes"]
        kinds = [k for k in TIMELINE_COLOURS if k in by]
        for k in kinds:
            ax.plot(t, [v / mb for v in by[k]], drawstyle="steps-post", lw=1.2,
                    color=TIMELINE_COLOURS[k], label=k)
        total = [sum(by[k][i] for k in kinds) / mb for i in range(len(t))]
        ax.plot(t, total, drawstyle="steps-post", color="black", lw=1.5, label="engine total")
        if "rss" in by:
            ax.plot(t, [(v - cols["idle_rss"]) / mb for v in by["rss"]], color="gray",
                    lw=1.2, label="RSS above idle (sampled)")
        peak = summary["variants"][name]["peak_rss_mb_per_rank"]
        ax.axhline(peak, color="gray", ls=":", lw=1, label=f"peak RSS (max rank) {peak:.0f}")
        _shade_backward(ax, t, cols["event"])
        ax.set_ylabel("MB (rank 0)")
        ax.set_title(f"{name}: memory by kind at each engine event")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("seconds since the first timed step started")
    fig.suptitle(f"{summary['shape']} LlamaLike, {summary['world']} CPU ranks")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "timeline.png"), dpi=110)
    plt.close(fig)


def _shade_backward(ax, t, events) -> None:
    """Grey spans from a step's first backward event to its end of backward."""
    start = None
    for when, event in zip(t, events):
        if event.startswith("backward") and start is None:
            start = when
        if event == "backward end" and start is not None:
            ax.axvspan(start, when, color="0.92", zorder=0)
            start = None
