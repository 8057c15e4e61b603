"""The checks of time on a Llama-shaped model (tools/bench_model.py): ``overlap`` (step
time with overlap on and off) and ``profile`` (a profiler trace: the share of the
all-gather and reduce-scatter kernels' time under compute)."""

from __future__ import annotations

import glob
import math
import os
import time

from gpucheck.kernels import kernels_from_chrome_trace, kernels_from_nodes, overlap_report
from gpucheck.run import Run, synchronize
from gpucheck.table import row

OVERLAP_MIN = 0.10  # fraction of reduce-scatter / all-gather time under compute
SPEED_MIN = 0.98  # off/on step time: overlap must not be slower (2% for noise)
TIMED_ROUNDS = 2  # overlap on / off alternate this many times; the best of each counts


def llama(run: Run, overlap: bool):
    """A Llama-shaped model sharded per decoder layer, its AdamW and a step function."""
    import numpy as np

    import bench_model
    import paddle_hsdp

    paddle = run.paddle
    shape = bench_model.SHAPES[run.args.shape]
    model = bench_model.build(shape)
    for layer in model.layers:
        paddle_hsdp.fully_shard(layer, enable_tensor_fusion_and_overlap=overlap)
    paddle_hsdp.fully_shard(model, enable_tensor_fusion_and_overlap=overlap)
    if not overlap:
        model.set_prefetch_count(forward=0, backward=0)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    rng = np.random.default_rng(100 + run.rank)
    per_rank = 8 if not run.args.cpu_rehearsal else 2
    ids = [paddle.to_tensor(rng.integers(0, shape.vocab, size=(per_rank, shape.seq + 1)))
           for _ in range(4)]
    count = [0]

    def step():
        loss = bench_model.loss_of(model, ids[count[0] % len(ids)])
        loss.backward()
        opt.step()
        opt.clear_grad()
        count[0] += 1
        return loss

    return model, step


def timed(run: Run, step, steps: int) -> float:
    """Seconds per step over ``steps`` steps, from a barrier to the device going idle."""
    synchronize(run)
    run.dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(run)
    return (time.perf_counter() - start) / steps


def check_overlap(run: Run) -> list:
    steps = 2 * run.args.steps
    steppers = {}
    for overlap in (True, False):
        _, steppers[overlap] = llama(run, overlap)
        for _ in range(2):  # warm-up: allocations, communicators, the recorded order
            steppers[overlap]()
    best = {True: math.inf, False: math.inf}
    for _ in range(TIMED_ROUNDS):
        for overlap in (True, False):
            best[overlap] = min(best[overlap], timed(run, steppers[overlap], steps))
    ratio = best[False] / best[True]
    figures = (f"on {best[True] * 1e3:.1f} ms/step, off {best[False] * 1e3:.1f} ms/step: "
               f"off/on {ratio:.2f}x ({run.args.shape} model, best of {TIMED_ROUNDS} x "
               f"{steps} steps; PASS at >= {SPEED_MIN})")
    return [row("overlap step time", "PASS" if ratio >= SPEED_MIN else "FAIL", figures,
                on_s=best[True], off_s=best[False], ratio=ratio)]


def check_profile(run: Run) -> list:
    name = "profile: comm under compute"
    if run.layout[1] == 1:
        return [row(name, "SKIP", "inner size 1: no all-gather or reduce-scatter to see")]
    trace_dir = os.path.join(run.out, "trace")
    _, step = llama(run, True)
    for _ in range(2):  # warm-up, outside the profiler: a failure here is the engine's
        step()
    try:
        import paddle.profiler as profiler

        prof = profiler.Profiler(
            targets=[profiler.ProfilerTarget.CPU, profiler.ProfilerTarget.GPU],
            scheduler=(1, 3),
            on_trace_ready=profiler.export_chrome_tracing(trace_dir,
                                                          worker_name=f"rank{run.rank}"))
        prof.start()
        for _ in range(4):
            step()
            prof.step()
        prof.stop()
        synchronize(run)
    except Exception as e:  # a Paddle whose profiler API differs
        return [row(name, "SKIP", f"paddle.profiler failed: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}")]
    kernels, source = [], "profiler result"
    try:
        kernels = kernels_from_nodes(prof.profiler_result.get_data())
    except Exception as e:
        source = f"profiler result unreadable ({type(e).__name__}); chrome trace"
    traces = sorted(glob.glob(os.path.join(trace_dir, f"rank{run.rank}*.json")),
                    key=os.path.getmtime)
    if not kernels and traces:
        try:
            kernels, source = kernels_from_chrome_trace(traces[-1]), "chrome trace"
        except Exception as e:
            source = f"chrome trace unreadable ({type(e).__name__}: {e})"
    return [profile_row(name, overlap_report(kernels), source,
                        traces[-1] if traces else None)]


def profile_row(name: str, rep: dict, source: str, trace) -> dict:
    """PASS when reduce-scatter and all-gather kernels (or, if their names do not say,
    all NCCL kernels) spent at least OVERLAP_MIN of their time under compute kernels."""
    where = f"trace {trace}" if trace else "no trace file"
    if not rep.get("compute_kernels") and "nccl_all" not in rep:
        return row(name, "SKIP", f"no GPU kernels recorded ({source}); {where}", report=rep)
    if "nccl_all" not in rep:
        return row(name, "FAIL", f"{rep['compute_kernels']} compute kernels but no NCCL "
                                 f"kernel ({source}); {where}", report=rep)
    named = [k for k in ("reduce_scatter", "all_gather") if k in rep]
    judged = named or ["nccl_all"]
    parts = [f"{k} {rep[k]['overlapped']:.0%} of {rep[k]['time'] / 1e3:.2f} ms under compute "
             f"({rep[k]['count']} kernels, streams {','.join(rep[k]['streams'])})"
             for k in judged + [k for k in ("all_reduce", "nccl") if k in rep]]
    ok = all(rep[k]["overlapped"] >= OVERLAP_MIN for k in judged)
    return row(name, "PASS" if ok else "FAIL",
               "; ".join(parts) + f" (PASS at >= {OVERLAP_MIN:.0%}); {where}", report=rep)
