"""One benchmark variant on this process's rank (launched by tools/bench.py).

argv: JSON with variant (hsdp2x2, hsdp1x4, dp, stage3, single), shape, steps,
per_rank (sequences per rank), world (ranks of the distributed variants) and out
(where rank 0 writes its JSON result).

Every variant trains the same LlamaLike model (same seed) on the same token ids with
AdamW, no clipping; step times are rank 0's wall time per step after a barrier (the
first step, which allocates optimizer state, is timed but reported apart). Memory is
the training peak RSS per rank above the idle runtime: VmRSS before the model exists,
and VmHWM after training, with the peak mark reset (``/proc/self/clear_refs``) once
everything is set up.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_model  # noqa: E402

import paddle_hsdp  # noqa: E402,F401  (before fleet.init)
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: VmHWM then includes set-up


def batches(shape, steps, n_rows):
    rng = np.random.default_rng(7)
    return [rng.integers(0, shape.vocab, size=(n_rows, shape.seq + 1)).astype("int64")
            for _ in range(steps)]


def init(variant: str, world: int):
    if variant == "single":
        return 0, 1
    if variant.startswith("hsdp"):
        outer = 2 if variant == "hsdp2x2" else 1
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1,
                                   "sharding_degree": world,
                                   "sharding_configs": {"fsdp_outer_degree": outer}}
        fleet.init(is_collective=True, strategy=strategy)
    else:
        dist.init_parallel_env()
    return dist.get_rank(), dist.get_world_size()


def wrap(variant: str, model):
    """The model and optimizer of a variant, after everything that shards or wraps."""
    def adamw(params):
        return paddle.optimizer.AdamW(learning_rate=1e-3, parameters=params)

    if variant.startswith("hsdp"):
        for layer in model.layers:
            paddle_hsdp.fully_shard(layer)
        paddle_hsdp.fully_shard(model)
        return model, adamw(model.parameters())
    if variant == "dp":
        return paddle.DataParallel(model), adamw(model.parameters())
    if variant == "stage3":
        return stage3(model, adamw(model.parameters()))
    return model, adamw(model.parameters())


def stage3(model, opt):
    """Paddle's GroupShardedStage3 on CPU: its constructor asserts a CUDA build, but the
    class runs with device="cpu" when that check is bypassed during construction.
    segment_size=0 shards every parameter, as paddle_hsdp does."""
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import (
        GroupShardedStage3,
    )

    original = core.is_compiled_with_cuda
    core.is_compiled_with_cuda = lambda: True
    try:
        wrapped = GroupShardedStage3(model, opt, device="cpu", segment_size=0)
    finally:
        core.is_compiled_with_cuda = original
    return wrapped, wrapped._optim


def theoretical_comm(units, inner: int, outer: int) -> dict:
    """Per-step wire bytes per rank from DESIGN's formulas, unpadded (one micro-step)."""
    gather = reduce = 0.0
    for unit in units:
        for buf in unit.buffers:
            nbytes = buf.logical_numel * buf.element_size
            times = 2 if unit.should_reshard_after_forward() else 1
            gather += times * (inner - 1) / inner * nbytes
            if buf.trainable:
                reduce += nbytes
    return {"inner all_gather": gather,
            "inner reduce_scatter": (inner - 1) / inner * reduce,
            "outer all_reduce": 2 * (outer - 1) / outer * reduce / inner}


def measured_comm() -> dict:
    c = paddle_hsdp.comm.counter
    return {"inner all_gather": c.get("inner", "all_gather").wire_bytes,
            "inner reduce_scatter": c.get("inner", "reduce_scatter").wire_bytes,
            "outer all_reduce": c.get("outer", "all_reduce").wire_bytes}


def main():
    cfg = json.loads(sys.argv[1])
    variant, shape = cfg["variant"], bench_model.SHAPES[cfg["shape"]]
    rank, world = init(variant, cfg["world"])
    n_rows = cfg["per_rank"] * cfg["world"]
    data = batches(shape, cfg["steps"], n_rows)
    idle_kb = vm_kb("VmRSS")
    model, opt = wrap(variant, bench_model.build(shape))
    units = paddle_hsdp.api._units_under(model) if variant.startswith("hsdp") else []
    rows = slice(None) if variant == "single" else slice(rank * cfg["per_rank"],
                                                         (rank + 1) * cfg["per_rank"])
    reset_peak_rss()
    times, losses, comm_steps = [], [], []
    for step, ids in enumerate(data):
        if world > 1:
            dist.barrier()
        paddle_hsdp.comm.counter.reset()
        start = time.perf_counter()
        loss = bench_model.loss_of(model, paddle.to_tensor(ids[rows]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        times.append(time.perf_counter() - start)
        comm_steps.append(measured_comm())
        t = paddle.to_tensor([float(loss)])
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    peak_kb = vm_kb("VmHWM") - idle_kb
    peaks = [peak_kb]
    if world > 1:
        gathered = []
        dist.all_gather(gathered, paddle.to_tensor([peak_kb], dtype="int64"))
        peaks = [int(x.item()) for x in gathered]
    result = {"variant": variant, "shape": cfg["shape"], "params": shape.params(),
              "world": world, "step_times": times, "losses": losses,
              "peak_rss_mb": [p / 1024 for p in peaks]}
    if units:
        inner = units[0].buffers[0].inner.nranks
        outer = units[0].buffers[0].outer.nranks
        result["layout"] = [outer, inner]
        result["comm_measured"] = comm_steps[-1]
        result["comm_theoretical"] = theoretical_comm(units, inner, outer)
        result["units"] = [sum(b.logical_numel for b in u.buffers) for u in units]
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(result, f)
    if world > 1:
        dist.barrier()


if __name__ == "__main__":
    if os.environ.get("HSDP_BENCH_PROFILE"):  # cProfile of rank 0, for reading hot spots
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(main)
        if os.environ.get("PADDLE_TRAINER_ID", "0") == "0":
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        main()
