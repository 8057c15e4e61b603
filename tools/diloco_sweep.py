"""DiLoCo's loss gap on the demo's model, swept in one process: the math of
``tools/outer_compress_loss.py``'s 4-rank HSDP 2 x 2 runs (tools/demo.py's CharLM
"small", AdamW lr 3e-3 clipped at 1.0, the same seed, init and batches), simulated
with O replicas as plain Paddle models, so a setting takes a minute, not four.

Plain HSDP is one model stepping on every rank's rows. DiLoCo is O models, replica q
on the rows of its inner group's ranks (2q, 2q + 1 at 2 x 2), each with its own AdamW
and clip; every H steps the outer step on the replicas' mean pseudo-gradient (anchor
minus params), Nesterov SGD, as engine/diloco.py; optionally the first ``warmup``
steps as plain HSDP (one set of grads, every replica the same), and the model in
``fragments`` synced in turn (fragment f at the steps where step % H == f H / F,
fragment f holds the units i with i % F == f: blocks.0..2, then the root).

    python tools/diloco_sweep.py --variants plain,h16 --steps 200
    python tools/diloco_sweep.py --grid "h16_lr{0.7,1.0,1.4}_mu{0,0.5,0.9}"   # a sweep
    python tools/diloco_sweep.py --steps 200 --out tools/results/diloco_sweep.json

A variant's name says its settings: ``h16`` (H), ``lr1.0``, ``mu0.5``, ``sgd`` (not
Nesterov), ``w20`` (warm-up steps), ``f4`` (fragments), ``r4`` (replicas: the data of
4 ranks split O ways, O = 1, 2 or 4), ``ilr0.004`` (the inner AdamW's lr; 3e-3 unset), ``cos`` (the inner lr's cosine
decay to 0 over the run; constant unset, as the demo),
``plain`` (HSDP). The loss reported is the mean
over the last 10 steps of the mean over replicas, as the demo's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import paddle  # noqa: E402
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

from demo import SIZES, CharLM, corpus  # noqa: E402

WORLD, MICRO, BATCH, SEQ, LR, CLIP = 4, 2, 8, 64, 3e-3, 1.0
TAIL = 10
UNITS = 4  # the demo's config: blocks.0, blocks.1, blocks.2, then the root


def settings_of(name: str) -> dict:
    """``h16_lr1.0_mu0_w20_f4_r2``: the settings of a variant name (unset: DiLoCo's
    defaults, H = 1 is plain HSDP)."""
    out = {"every": 1, "lr": 0.7, "momentum": 0.9, "nesterov": True, "warmup": 0,
           "fragments": 1, "replicas": 2, "inner_lr": LR, "cosine": False}
    if name == "plain":
        return out
    for part in name.split("_"):
        m = re.fullmatch(r"(h|lr|mu|w|f|r|ilr)([0-9.]+)|sgd|cos", part)
        if not m:
            raise SystemExit(f"variant {name!r}: unknown part {part!r}")
        if part in ("sgd", "cos"):
            out["nesterov" if part == "sgd" else "cosine"] = part == "cos"
            continue
        key = {"h": "every", "lr": "lr", "mu": "momentum", "w": "warmup", "f": "fragments",
               "r": "replicas", "ilr": "inner_lr"}[m.group(1)]
        floats = ("lr", "momentum", "inner_lr")
        out[key] = float(m.group(2)) if key in floats else int(m.group(2))
    return out


def unit_of(name: str) -> int:
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else UNITS - 1


def build(inner_lr: float = LR, cosine_steps: int = 0):
    paddle.seed(0)
    hidden, heads, layers = SIZES["small"]
    model = CharLM(hidden=hidden, heads=heads, layers=layers, seq=SEQ)
    if cosine_steps:  # from inner_lr to 0 over the run (opt_step steps it)
        inner_lr = paddle.optimizer.lr.CosineAnnealingDecay(inner_lr, T_max=cosine_steps)
    opt = paddle.optimizer.AdamW(learning_rate=inner_lr, parameters=model.parameters(),
                                 grad_clip=nn.ClipGradByGlobalNorm(CLIP))
    return model, opt


def batches(steps: int):
    """Every rank's rows of every micro-step, as tools/demo.py draws them."""
    data, rng = corpus(), np.random.default_rng(1234)
    for _ in range(steps):
        step = []
        for _ in range(MICRO):
            starts = rng.integers(0, len(data) - SEQ - 1, size=(WORLD, BATCH))
            step.append(np.stack([np.stack([data[s:s + SEQ + 1] for s in row])
                                  for row in starts]))
        yield step


def step_loss(model, step, ranks) -> float:
    """Backward of the mean loss over ``ranks``' rows (micro-steps averaged)."""
    total = 0.0
    for micro in step:
        ids = paddle.to_tensor(micro[ranks].reshape(-1, SEQ + 1))
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape([-1, 256]), ids[:, 1:].reshape([-1, 1]))
        (loss / len(step)).backward()
        total += float(loss) / len(step)
    return total


def opt_step(opt) -> None:
    opt.step()
    opt.clear_grad()
    if isinstance(opt._learning_rate, paddle.optimizer.lr.LRScheduler):
        opt._learning_rate.step()


def outer_step(s: dict, replicas, anchor, momentum, names) -> None:
    """The outer Nesterov (or plain) SGD step on ``names``, as engine/diloco.py."""
    params = [dict(m.named_parameters()) for m, _ in replicas]
    for n in names:
        mean = sum(anchor[n] - p[n].numpy() for p in params) / len(params)
        momentum[n] = s["momentum"] * momentum[n] + mean
        step = mean + s["momentum"] * momentum[n] if s["nesterov"] else momentum[n]
        anchor[n] = anchor[n] - s["lr"] * step
        for p in params:
            p[n].set_value(anchor[n])


def run(name: str, steps: int) -> dict:
    s = settings_of(name)
    replicas = [build(s["inner_lr"], steps if s["cosine"] else 0)
                for _ in range(s["replicas"])]
    ranks = np.array_split(np.arange(WORLD), s["replicas"])
    first = dict(replicas[0][0].named_parameters())
    trainable = [n for n, p in first.items() if not p.stop_gradient]
    anchor = momentum = None
    H, frags = s["every"], s["fragments"]
    losses, start = [], time.time()
    for t, step in enumerate(batches(steps), start=1):
        if t <= s["warmup"] or H == 1:  # plain HSDP: every replica on every rank's grads
            for model, opt in (replicas if H > 1 else replicas[:1]):
                loss = step_loss(model, step, np.arange(WORLD))
                opt_step(opt)
            losses.append(loss)
            continue
        if anchor is None:
            anchor = {n: first[n].numpy().copy() for n in trainable}
            momentum = {n: np.zeros_like(a) for n, a in anchor.items()}
        mine = []
        for (model, opt), rows in zip(replicas, ranks, strict=True):
            mine.append(step_loss(model, step, rows))
            opt_step(opt)
        losses.append(float(np.mean(mine)))
        phase = (t - s["warmup"]) % H
        for f in range(frags):
            if phase == f * H // frags:
                outer_step(s, replicas, anchor, momentum,
                           [n for n in trainable if unit_of(n) % frags == f])
    final = float(np.mean(losses[-TAIL:]))
    print(f"  {name:28s} {final:.4f}  ({time.time() - start:.0f} s)", flush=True)
    return {"settings": s, "losses": losses, "final_loss": final}


def expand(grid: str) -> list[str]:
    """``h16_lr{0.7,1.0}_mu{0,0.9}`` -> every combination."""
    parts = re.split(r"(\{[^}]*\})", grid)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default="plain,h16")
    ap.add_argument("--grid", action="append", default=[], help="also every name of this "
                    "pattern ({a,b} alternatives)")
    ap.add_argument("--out", default=None, help="JSON of every variant (merged into it "
                    "when it exists: a variant there is not run again)")
    ap.add_argument("--plot", default=None, help="a PNG: the variants' loss over plain's "
                    "per step (left), the final gap against H (right, the h<H>_lr1.0_mu0 "
                    "variants)")
    ap.add_argument("--plot-variants", default=None, help="the left panel's variants "
                    "(default: every one with the demo's constant inner lr)")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    names += [n for g in args.grid for n in expand(g)]
    done = {}
    if args.out and os.path.exists(args.out):
        done = json.load(open(args.out)).get("results", {})
    paddle.set_device("cpu")
    for name in names:
        if name not in done:
            done[name] = run(name, args.steps)
            if args.out:
                save(args, done)
    if args.out:
        save(args, {n: done[n] for n in names})
    plain = done.get("plain")
    if args.plot and plain:
        shown = args.plot_variants.split(",") if args.plot_variants else [
            n for n in names if not done[n]["settings"]["cosine"]]
        plot({n: done[n] for n in names}, shown, plain, args.plot)
    for name in names:
        r = done[name]
        ratio = f"{r['final_loss'] / plain['final_loss']:.4f}" if plain else "-"
        print(f"{name:28s} {r['final_loss']:.4f} vs plain {ratio}")
    return 0


def smooth(losses: list[float]) -> np.ndarray:
    """The mean of the last TAIL steps at every step (the demo's final loss, per step)."""
    sums = np.cumsum(np.concatenate([[0.0], losses]))
    lo = np.maximum(np.arange(1, len(losses) + 1) - TAIL, 0)
    return (sums[1:] - sums[lo]) / (np.arange(1, len(losses) + 1) - lo)


def plot(results: dict, shown: list[str], plain: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415  (only for --plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    base = smooth(plain["losses"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in shown:
        r = results[name]
        if name != "plain":
            left.plot(np.arange(1, len(base) + 1), smooth(r["losses"]) / base - 1,
                      label=f"{name} ({r['final_loss'] / plain['final_loss'] - 1:+.1%})")
    left.axhline(0.02, color="grey", ls="--", lw=0.8)
    left.set(xlabel="optimizer step", ylabel="loss over plain HSDP's - 1 (last 10 steps)",
             title="DiLoCo vs plain HSDP, demo CharLM small (2 replicas; r4: 4)", ylim=(-0.05, 0.6))
    left.legend(fontsize=7)
    by_h = sorted((r["settings"]["every"], r["final_loss"] / plain["final_loss"] - 1)
                  for n, r in results.items()
                  if re.fullmatch(r"h\d+_lr1\.0_mu0", n) and r["settings"]["every"] <= 200)
    if by_h:
        right.plot([h for h, _ in by_h], [g for _, g in by_h], "o-")
        right.set_xscale("log", base=2)
        right.axhline(0.02, color="grey", ls="--", lw=0.8)
        right.set(xlabel="H (steps between syncs)", ylabel="gap after 200 steps",
                  title="outer lr 1.0, momentum 0 (averaging)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plotted {path}")


def save(args, results: dict) -> None:
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "steps": args.steps,
                   "model": "demo CharLM small, one-process simulation of HSDP 2x2",
                   "command": "python tools/diloco_sweep.py " + " ".join(sys.argv[1:]),
                   "results": results}, f, indent=0)


if __name__ == "__main__":
    sys.exit(main())
