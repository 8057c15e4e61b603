"""What making the ranks agree costs at fully_shard (issue 61): the benchmark's 140M
Llama-shaped model (tools/bench_model.py) sharded as HSDP 2 x 2 on 4 CPU ranks, one
unit per decoder layer and the root, three ways, alternated per round:

* ``sync``: ``sync_module_states=True`` (the default): each buffer's rows scattered
  from its inner group's first rank, then the outer broadcast every unit makes;
* ``check``: ``sync_module_states=False``: a fingerprint per tensor compared across
  the FSDP group (the weights are equal here, so it passes);
* ``own``: each rank cuts its rows from its own weights with no agreement at all (what
  fully_shard did before issue 61; the check switched off in this tool only), the
  baseline of the ratios.

    python tools/bench_agreement.py [--rounds 3] [--model 140m]

Prints, per way, the median over the rounds of the slowest rank's fully_shard time,
its ratio to ``own``, and the bytes each rank received for the agreement (the comm
counter's "agreement" label) against the theory (a scatter brings 1/I of the model's
bytes, a broadcast of it would bring all). This machine is shared and noisy: read the
ratios, measured side by side in one run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from benchkit import rounds_tool

WAYS = ("own", "sync", "check")


def worker(args) -> None:
    import time

    import paddle
    import paddle.distributed as dist

    import paddle_hsdp
    from bench_model import SHAPES, build
    from demo import init_hsdp
    from paddle_hsdp.comm import collectives as comm
    from paddle_hsdp.engine import agreement

    init_hsdp(4, 2)
    rank = dist.get_rank()
    shape = SHAPES[args.model]
    real_verify = agreement.verify
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    received: dict[str, float] = {}
    for r in range(args.rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            model = build(shape)
            agreement.verify = real_verify if way != "own" else (lambda *a, **k: None)
            comm.counter.reset()
            dist.barrier()
            t0 = time.perf_counter()
            for layer in model.layers:
                paddle_hsdp.fully_shard(layer, sync_module_states=way == "sync")
            paddle_hsdp.fully_shard(model, sync_module_states=way == "sync")
            times[way].append(time.perf_counter() - t0)
            received[way] = sum(s.payload_bytes for (label, op), s in
                                comm.counter.snapshot().items() if label == "agreement")
            agreement.verify = real_verify
            paddle_hsdp.forget(model)
            del model
    model_bytes = shape.params() * paddle.zeros([1]).element_size()
    slowest = {}
    for way in WAYS:
        t = paddle.to_tensor(times[way], dtype="float64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[way] = t.numpy().tolist()
    if rank == 0:
        with open(os.path.join(args.out, "agreement.json"), "w") as f:
            json.dump({"times": slowest, "received": received, "model_bytes": model_bytes,
                       "inner": 2}, f)


def main() -> int:
    args = rounds_tool.parse(__doc__)
    if args.worker:
        worker(args)
        return 0
    work = rounds_tool.launch_worker(__file__, args)
    if work is None:
        return 1
    with open(os.path.join(work, "agreement.json")) as f:
        result = json.load(f)
    med = {w: statistics.median(result["times"][w]) for w in WAYS}
    full = result["model_bytes"]
    print(f"{args.model} ({full / 2 ** 20:.0f} MiB), HSDP 2 x 2 on 4 CPU ranks, medians of "
          f"{args.rounds} rounds, the slowest rank's fully_shard:")
    for way in WAYS:
        got = result["received"].get(way, 0)
        print(f"  {way:5s}  {med[way]:6.2f} s  ({med[way] / med['own']:.2f}x own)   "
              f"agreement bytes {got / 2 ** 20:9.3f} MiB ({got / full:.5f} of the model)")
    print(f"  theory for sync: 1/inner = {1 / result['inner']:.3f} of the model's bytes "
          "(plus the module buffers; this model has none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
