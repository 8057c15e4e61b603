"""What a checkpoint save stalls training for, sync against async: the benchmark's
140M Llama-shaped model (tools/bench_model.py) as HSDP 2 x 2 on 4 CPU ranks, AdamW,
one step, then a save of each kind, alternated, timed on every rank:

* the **stall**: from the call to its return (what the training loop waits for);
* the **total**: from the call to the checkpoint published (``wait()`` for async).

    python tools/bench_save.py [--rounds 3] [--model 140m]

Prints the medians over the rounds of the slowest rank's times and the ratio async /
sync of the stall. This machine is shared and noisy: read the ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time

from benchkit import rounds_tool


def worker(args) -> None:
    import paddle
    import paddle.distributed as dist

    import paddle_hsdp
    from bench_model import SHAPES, build, loss_of
    from demo import init_hsdp

    init_hsdp(4, 2)
    rank = dist.get_rank()
    shape = SHAPES[args.model]
    model = build(shape)
    for layer in model.layers:
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    ids = paddle.randint(0, shape.vocab, [2, shape.seq])
    loss_of(model, ids).backward()
    opt.step()
    opt.clear_grad()
    times = {"sync": [], "async": []}
    for r in range(args.rounds):
        for kind in ("sync", "async"):
            path = os.path.join(args.out, f"ck_{kind}")
            dist.barrier()
            t0 = time.perf_counter()
            handle = paddle_hsdp.save_checkpoint(path, model, opt, async_save=kind == "async")
            stall = time.perf_counter() - t0
            if handle is not None:
                handle.wait()
            times[kind].append((stall, time.perf_counter() - t0))
    slowest = {}
    for kind, runs in times.items():  # every rank's, the slowest of each round
        t = paddle.to_tensor([x for run in runs for x in run], dtype="float64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[kind] = t.numpy().reshape(-1, 2).tolist()
    if rank == 0:
        with open(os.path.join(args.out, "times.json"), "w") as f:
            json.dump(slowest, f)


def main() -> int:
    args = rounds_tool.parse(__doc__)
    if args.worker:
        worker(args)
        return 0
    work = rounds_tool.launch_worker(__file__, args)
    if work is None:
        return 1
    with open(os.path.join(work, "times.json")) as f:
        times = json.load(f)
    med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in times.items()}
    size = sum(os.path.getsize(os.path.join(work, "ck_sync", f))
               for f in os.listdir(os.path.join(work, "ck_sync")))
    for kind in ("sync", "async"):
        print(f"{kind:5s}  stall {med[kind][0] * 1e3:8.1f} ms   total {med[kind][1] * 1e3:8.1f} ms")
    print(f"async / sync stall: {med['async'][0] / med['sync'][0]:.2f}x  "
          f"(checkpoint {size / 2 ** 20:.0f} MiB, {args.model}, medians of {args.rounds} "
          f"rounds, the slowest rank's)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
