"""paddle_hsdp demo: train a small character-level causal LM with HSDP on 4 CPU ranks.

Layout: fsdp_outer_degree=2 over sharding_degree=4, i.e. 2 replicas x 2-way shards,
one unit per block, by hand; or, with ``--config FILE``, whatever the YAML file says
(``paddle_hsdp.apply_config``; examples in tools/configs/). ``--model moe`` swaps each
block's MLP for a mixture of experts (4 experts, top-1, all local to every rank).
The text is the source of a few Python standard-library modules (no download). Rank 0
shows a progress bar with loss and tokens/s and ends with the loss against step 1.

``build_model`` / ``build_moe_model`` are factories for ``python -m paddle_hsdp plan
--model tools/demo.py:build_model``.
"""

import argparse
import inspect
import json
import os
import time

import numpy as np

import paddle_hsdp  # noqa: F401  (teaches fleet the fsdp_outer_degree option)
from paddle_hsdp.engine.registry import registry as hsdp_registry

import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed import fleet


def init_hsdp(sharding: int, outer: int):
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": sharding,
        "sharding_configs": {"fsdp_outer_degree": outer},
    }
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def group_table(hcg) -> str:
    mine = [hcg.get_fsdp_group().ranks, hcg.get_fsdp_inner_group().ranks,
            hcg.get_fsdp_outer_group().ranks]
    rows = []
    dist.all_gather_object(rows, [dist.get_rank()] + mine)
    header = ("rank", "FSDP group", "inner (shards)", "outer (replicas)")
    cells = [header] + [tuple(str(c) for c in row) for row in sorted(rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] +
                     [line(r) for r in cells[1:]])


# ------------------------------------------------------------------ model
class Block(nn.Layer):
    def __init__(self, hidden: int, heads: int, moe: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiHeadAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MoEMLP(hidden) if moe else nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask)
        return x + self.mlp(self.ln2(x))


class MoEMLP(nn.Layer):
    """Top-1 routing over ``n_experts`` expert MLPs. An expert that got no tokens is
    skipped: it lives inside its block's unit, so its rank still joins every collective
    (its grads enter the reduce-scatter as zeros)."""

    def __init__(self, hidden: int, n_experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts)
        self.experts = nn.LayerList([
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(n_experts)])

    def forward(self, x):
        flat = x.reshape([-1, x.shape[-1]])
        probs = F.softmax(self.gate(flat), axis=-1)
        choice = paddle.argmax(probs, axis=-1)
        out = paddle.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows = paddle.nonzero(choice == i).reshape([-1])
            if rows.shape[0] == 0:
                continue
            picked = paddle.gather(flat, rows)
            weight = paddle.gather(probs[:, i], rows).unsqueeze(-1)
            out = paddle.scatter(out, rows, expert(picked) * weight, overwrite=True)
        return out.reshape(x.shape)


class TiedHead(nn.Layer):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True)


class CharLM(nn.Layer):
    def __init__(self, vocab=256, hidden=64, heads=4, layers=3, seq=64, moe=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = self.create_parameter([seq, hidden],
                                         default_initializer=nn.initializer.Normal(0, 0.02))
        self.blocks = nn.LayerList([Block(hidden, heads, moe) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = TiedHead(self.embed.weight)
        causal = paddle.tril(paddle.ones([seq, seq], dtype="bool"))
        self.register_buffer("mask", causal, persistable=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed(ids) + self.pos[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


def build_model(seq: int = 64) -> CharLM:
    return CharLM(seq=seq)


def build_moe_model(seq: int = 64) -> CharLM:
    return CharLM(seq=seq, moe=True)


def corpus() -> np.ndarray:
    import argparse as a, json, textwrap, string  # noqa: E401  (their source is the text)
    text = "".join(inspect.getsource(m) for m in (a, json, textwrap, string))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("int64")


def report(text: str) -> None:
    """Rank 0's report lines; tools/demo.sh shows the lines tagged [demo]."""
    for line in text.splitlines():
        print(f"[demo] {line}", flush=True)


SIZES = {  # hidden, heads, layers: all run here in well under 3 minutes at the defaults
    "small": (64, 4, 3),
    "medium": (128, 4, 4),
    "large": (256, 8, 6),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="model size: " + ", ".join(
                            f"{k} (hidden {h}, {n} layers)" for k, (h, _, n) in SIZES.items()))
    parser.add_argument("--model", choices=("dense", "moe"), default="dense",
                        help="moe: each block's MLP is a mixture of 4 experts")
    parser.add_argument("--layout", default="2x2",
                        help="OUTERxINNER over the 4 ranks (2x2, 1x4, 4x1); by hand, without "
                             "--config")
    parser.add_argument("--config", default=None,
                        help="shard from this YAML file (tools/configs/) instead of by hand")
    parser.add_argument("--run-dir", default=None,
                        help="where rank 0 writes metrics.jsonl, loss.png, comm.json "
                             "(default: runs/demo-<time>)")
    args = parser.parse_args()
    outer, _, inner = args.layout.partition("x")
    if not (outer.isdigit() and inner.isdigit()) or int(outer) * int(inner) != 4:
        parser.error(f"--layout: expected OUTERxINNER with OUTER * INNER = 4 ranks (2x2, "
                     f"1x4, 4x1), got {args.layout!r}")
    if args.config and args.layout != "2x2":
        parser.error("--layout and --config both set the layout: give one of them")
    args.outer = int(outer)
    return args


def shard(model, args):
    """By hand (one unit per block, the root last) or from ``--config``; returns the
    HCG and the config's plan (None by hand)."""
    if args.config:  # the config shapes the layout (and initialises fleet)
        model, plan = paddle_hsdp.apply_config(model, args.config)
        plan.micro_steps = args.micro
        return fleet.get_hybrid_communicate_group(), plan
    hcg = init_hsdp(sharding=4, outer=args.outer)
    for block in model.blocks:  # one communication unit per block ...
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)  # ... and the root takes embedding, head, norms
    return hcg, None


class RunDir:
    """Rank 0's record of the run: metrics.jsonl (a line per step), loss.png, comm.json
    (per group and op: calls, payload and wire bytes per step; the plan's, with
    --config) and args.json."""

    def __init__(self, path, args):
        self.path = path or os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs",
            time.strftime("demo-%Y%m%d-%H%M%S"))
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
        self.metrics = open(os.path.join(self.path, "metrics.jsonl"), "w")

    def step(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def finish(self, losses, steps, plan) -> None:
        self.metrics.close()
        per_step = {f"{label} {op}": {"calls": s.calls / steps,
                                      "payload_bytes": s.payload_bytes / steps,
                                      "wire_bytes": s.wire_bytes / steps}
                    for (label, op), s in sorted(paddle_hsdp.comm.counter.snapshot().items())}
        if plan is not None:
            for (label, op), planned in plan.comm_bytes().items():
                per_step.setdefault(f"{label} {op}", {})["planned_wire_bytes"] = planned
        with open(os.path.join(self.path, "comm.json"), "w") as f:
            json.dump(per_step, f, indent=1)
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # the test extra brings it; the run itself does not need it
            report("(matplotlib not installed: no loss.png)")
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (global batch)")
        ax.set_title("paddle_hsdp demo")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(self.path, "loss.png"), dpi=120)
        plt.close(fig)


def main():
    args = parse_args()
    paddle.seed(0)
    hidden, heads, layers = SIZES[args.size]
    model = CharLM(hidden=hidden, heads=heads, layers=layers, seq=args.seq,
                   moe=args.model == "moe")
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    hcg, plan = shard(model, args)
    rank, world = dist.get_rank(), dist.get_world_size()
    table = group_table(hcg)
    run = RunDir(args.run_dir, args) if rank == 0 else None
    if rank == 0:
        report(f"HSDP layout: fsdp_outer_degree={hcg.get_fsdp_outer_degree()}, "
               f"world size {world}\n{table}\n")
        if plan is not None:
            report(f"{plan}\n")
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters(),
                                 grad_clip=nn.ClipGradByGlobalNorm(1.0))

    paddle_hsdp.comm.counter.reset()  # from here on: training traffic only
    data = corpus()
    rng = np.random.default_rng(1234)
    tokens_per_step = world * args.micro * args.batch * args.seq
    losses = []
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc="train", unit="step", ncols=90)
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(args.micro):
            starts = rng.integers(0, len(data) - args.seq - 1, size=(world, args.batch))
            rows = np.stack([data[s:s + args.seq + 1] for s in starts[rank]])
            ids = paddle.to_tensor(rows)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape([-1, 256]), ids[:, 1:].reshape([-1, 1]))
            (loss / args.micro).backward()
            total += float(loss) / args.micro
        opt.step()
        opt.clear_grad()
        mean = paddle.to_tensor([total])
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        seconds = time.perf_counter() - t0
        if rank == 0:
            run.step({"step": step + 1, "loss": losses[-1], "seconds": seconds,
                      "tokens_per_s": tokens_per_step / seconds})
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / seconds:,.0f}")
            bar.update(1)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    held = paddle_hsdp.memory_report(model)
    if rank == 0:
        units = len(hsdp_registry.units_under(model))
        report(f"model: {n_params:,} params in {units} units; this rank holds "
               f"{held['shard']:,} B of shards ({held['shard'] / (4 * n_params):.0%} of "
               f"the model)\n"
               f"{args.steps} steps x {tokens_per_step:,} tokens in {elapsed:.1f} s "
               f"({args.steps * tokens_per_step / elapsed:,.0f} tokens/s on {world} CPU ranks)\n"
               f"loss: step 1 {losses[0]:.3f} -> step {args.steps} {losses[-1]:.3f} "
               f"({losses[-1] / losses[0]:.0%} of the first step)")
        if plan is not None:  # the plan's bytes against the communication counter's
            measured = paddle_hsdp.comm.counter.snapshot()
            # (an op the plan has and the run had not, e.g. DiLoCo's outer sync every H
            # steps, which the plan does not model: shown as 0)
            report("communication per step, measured / planned: " + ", ".join(
                f"{label} {op} "
                f"{getattr(measured.get((label, op)), 'wire_bytes', 0) / args.steps / planned:.3f}"
                for (label, op), planned in plan.comm_bytes().items() if planned))
        run.finish(losses, args.steps, plan)
        report(f"run directory: {run.path} (metrics.jsonl, loss.png, comm.json, args.json)")
    dist.barrier()


if __name__ == "__main__":
    main()
