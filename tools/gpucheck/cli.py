"""The command line (tools/gpu_check.py's): ``--report``, ``--preflight``, or one launch's
checks in order, each row saved as it comes and printed by rank 0."""

from __future__ import annotations

import os
import sys
import time

from gpucheck.mismatch_checks import check_mismatch, check_mismatch_hang, record_path
from gpucheck.options import parse_args, parse_layout
from gpucheck.parity_checks import check_bf16, check_layout, check_offload
from gpucheck.preflight import fail_fast, gpu_problem, import_paddle, require_workers
from gpucheck.report import describe, report, write_report
from gpucheck.run import Run
from gpucheck.speed_checks import check_overlap, check_profile
from gpucheck.table import exit_status, format_table, row
from pythonpath import WORKERS


RUNNERS = {"layout": check_layout, "overlap": check_overlap, "profile": check_profile,
           "offload": check_offload, "bf16": check_bf16, "mismatch": check_mismatch,
           "mismatch_hang": check_mismatch_hang}


def run_checks(args) -> int:
    # Before CUDA starts: fp32 parity without TF32, and the bound the mismatch expects.
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    os.environ.setdefault("PADDLE_HSDP_COLLECTIVE_TIMEOUT", str(args.timeout))
    launched = "PADDLE_TRAINER_ID" in os.environ
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if args.cpu_rehearsal:
        if world < 2:
            fail_fast(f"gpu_check --cpu-rehearsal: launch it on 2+ CPU ranks: "
                      f"PYTHONPATH={WORKERS} python -m paddle.distributed.launch "
                      "--nproc_per_node 2 tools/gpu_check.py --cpu-rehearsal")
        if args.shape == "73m":
            args.shape = "tiny"
    else:
        paddle = import_paddle()
        problem = gpu_problem(paddle.is_compiled_with_cuda(),
                              paddle.device.cuda.device_count()
                              if paddle.is_compiled_with_cuda() else 0,
                              world, paddle.__version__, launched)
        if problem:
            fail_fast(problem)
    if args.layout:
        try:
            parse_layout(args.layout, world)
        except ValueError as e:
            fail_fast(f"gpu_check: {e}")
    require_workers()
    run = Run(args)
    os.makedirs(os.path.join(run.out, "results"), exist_ok=True)
    if os.path.exists(record_path(run)):
        os.remove(record_path(run))  # this rank's records of an earlier run of this phase
    if args.cpu_rehearsal:  # the device paths, on CPU: the tests' switches
        from paddle_hsdp.comm import gather_tags
        from paddle_hsdp.engine import offload

        gather_tags.DEFER_ON_CPU = True  # tag flags read at the boundaries
        offload.EXERCISE_ON_CPU = True  # offload copies real, the CPU as the "device"
    if run.rank == 0:
        print(describe(run.meta()), flush=True)
    for name in args.only:
        started = time.perf_counter()
        try:
            new = RUNNERS[name](run)
        except Exception as e:
            text = (str(e).splitlines() or [""])[0][:300]
            new = [row(name, "FAIL", f"{type(e).__name__}: {text}")]
        for r in new:
            r["detail"]["seconds"] = round(time.perf_counter() - started, 2)
        run.add(name, new)
        if run.rank == 0:
            for r in new:
                print(f"[gpu_check] {r['check']}: {r['status']} {r['figures']}", flush=True)
    if run.rank == 0:
        print(format_table(run.rows, describe(run.meta())), flush=True)
        if "mismatch_hang" in args.only:
            print(f"mismatch_hang: python tools/gpu_check.py --report {run.out} merges the "
                  "ranks' records and the watchdog's lines", flush=True)
    if "mismatch_hang" not in args.only and "mismatch" not in args.only:
        run.dist.barrier()  # rank 0 owns the store; after a mismatch, no more collectives
    # 0 once the rows are written, FAILs included (--report's status counts them): a
    # launch that exits non-zero crashed.
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        rows, header = report(args.report)
        if not rows:
            print(f"gpu_check --report: no results under {args.report}", file=sys.stderr)
            return 1
        path = write_report(args.report, rows, header)
        print(format_table(rows, header))
        print(f"(written to {path})")
        return exit_status(rows)
    if args.preflight and args.cpu_rehearsal:
        print(2)  # the flags parsed; two CPU ranks
        return 0
    if args.preflight:
        paddle = import_paddle()
        cuda = paddle.is_compiled_with_cuda()
        gpus = paddle.device.cuda.device_count() if cuda else 0
        problem = gpu_problem(cuda, gpus, 1, paddle.__version__)
        if problem:
            fail_fast(problem)
        print(gpus)
        return 0
    return run_checks(args)
