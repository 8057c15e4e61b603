"""Long-run check: memory and bookkeeping stay flat over many steps.

    python tools/longrun.py                  # 300 steps of the demo model, 2 x 2, 4 ranks
    python tools/longrun.py --steps 20 --warmup 10 --every 5     # what the tests run

Trains the demo's CharLM (tools/demo.py) with gradient accumulation (2 micro-steps per
step) under HSDP 2 x 2 and samples, on every rank every ``--every`` steps:

* resident memory (VmRSS) and Paddle's host allocator's allocated bytes (every live
  tensor's storage);
* the bytes the engine holds (``paddle_hsdp.memory_report``);
* tensors reachable from Python objects (found through the garbage collector's
  referents; tensors only autograd holds show up in the allocator's bytes instead);
* forward hooks on the model's modules, the engine's registries (units, in-flight
  reductions, active units) and process groups.

After ``--warmup`` steps, memory must grow by less than ``--tolerance`` (1%) and the
counts must not grow at all. Prints a table and the verdict; writes ``--out`` JSON.
Exit status 0 when every rank is flat.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------- one rank
def _vm_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _python_reachable_tensors() -> int:
    import paddle

    seen = set()
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            if isinstance(ref, paddle.Tensor):
                seen.add(id(ref))
    return len(seen)


def sample(model) -> dict:
    from paddle.base import core
    from paddle.distributed import collective

    import paddle_hsdp
    from paddle_hsdp.engine import reductions
    from paddle_hsdp.engine.context import context
    from paddle_hsdp.engine.registry import registry

    gc.collect()
    modules = model.sublayers(include_self=True)
    return {
        "rss_kb": _vm_rss_kb(),
        "allocated_bytes": int(core.host_memory_stat_current_value("Allocated", 0)),
        "engine_bytes": int(sum(paddle_hsdp.memory_report(model).values())),
        "tensors": _python_reachable_tensors(),
        "module_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_post_hooks)
                            for m in modules),
        "engine_registries": len(registry) + len(registry.owner_of) + reductions.in_flight()
        + len(context.backward.active) + len(context.backward.roots_in_backward),
        "process_groups": len(collective._group_map),
    }


def worker(args) -> None:
    import numpy as np

    import paddle_hsdp  # noqa: F401  (before fleet.init)
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F

    import demo

    demo.init_hsdp(sharding=4, outer=2)
    rank = dist.get_rank()
    paddle.seed(0)
    model = demo.build_model(seq=args.seq)
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    opt = paddle.optimizer.AdamW(3e-3, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    data = demo.corpus()
    rng = np.random.default_rng(rank)
    samples = []
    for step in range(1, args.steps + 1):
        for _ in range(2):  # gradient accumulation
            starts = rng.integers(0, len(data) - args.seq - 1, size=args.batch)
            ids = paddle.to_tensor(np.stack([data[s:s + args.seq + 1] for s in starts]))
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape([-1, 256]), ids[:, 1:].reshape([-1, 1]))
            (loss / 2).backward()
        opt.step()
        opt.clear_grad()
        if step % args.every == 0 or step == args.warmup:
            samples.append({"step": step, "loss": float(loss), **sample(model)})
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(samples, f)
    dist.barrier()


# ---------------------------------------------------------------- the launcher
def verdict(samples: list, warmup: int, tolerance: float) -> tuple[bool, list[str]]:
    """Growth from the warm-up sample to the last: memory within ``tolerance``, counts
    not at all."""
    base = next(s for s in samples if s["step"] == warmup)
    last = samples[-1]
    lines, ok = [], True
    for key in ("rss_kb", "allocated_bytes", "engine_bytes"):
        growth = (last[key] - base[key]) / max(base[key], 1)
        good = growth < tolerance
        ok &= good
        lines.append(f"{key:18s} {base[key]:>14,d} -> {last[key]:>14,d}  "
                     f"growth {growth:+.3%}  {'ok' if good else 'GROWS'}")
    for key in ("tensors", "module_hooks", "engine_registries", "process_groups"):
        good = last[key] <= base[key]
        ok &= good
        lines.append(f"{key:18s} {base[key]:>14,d} -> {last[key]:>14,d}  "
                     f"{'ok' if good else 'GROWS'}")
    return ok, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--out", default=None, help="write the samples and verdict as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not 0 < args.warmup < args.steps:
        ap.error("--warmup must be between 0 and --steps")
    out_dir = tempfile.mkdtemp(prefix="hsdp_longrun_")
    env = dict(os.environ, GLOG_minloglevel="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "4",
           "--log_dir", os.path.join(out_dir, "logs"), os.path.abspath(__file__), "--worker",
           "--out-dir", out_dir, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--every", str(args.every), "--batch", str(args.batch), "--seq", str(args.seq)]
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"launch failed (rc={proc.returncode}); logs in {out_dir}/logs\n"
              f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return 1
    report, all_ok = {}, True
    for rank in range(4):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            samples = json.load(f)
        ok, lines = verdict(samples, args.warmup, args.tolerance)
        all_ok &= ok
        report[f"rank{rank}"] = {"samples": samples, "ok": ok}
        print(f"rank {rank}: steps {args.warmup} -> {samples[-1]['step']} "
              f"(loss {samples[-1]['loss']:.3f})")
        print("\n".join("  " + line for line in lines))
    print(f"{'FLAT' if all_ok else 'NOT FLAT'}: memory growth under {args.tolerance:.0%} "
          "and no growth in tensors, hooks, registries or process groups after warm-up"
          if all_ok else "NOT FLAT: see the lines marked GROWS")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
