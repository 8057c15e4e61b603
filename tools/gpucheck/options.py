"""The command line's flags and layouts: which checks, how many steps, the fleet layout
OUTERxINNER and the one the mesh front end checks next to it."""

from __future__ import annotations

import argparse
import os
import re

CHECKS = ("layout", "overlap", "profile", "offload", "bf16", "mismatch", "mismatch_hang")
DEFAULT_CHECKS = CHECKS[:-1]  # mismatch_hang may end the process: asked for by name


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="paddle_hsdp's first GPU run: layouts, overlap, a profiler trace, CPU "
                    "offload, bf16 and a mismatched unit on 2+ GPUs with NCCL. Launch: "
                    "PYTHONPATH=test_collective/workers python -m paddle.distributed.launch "
                    "--devices 0,1 tools/gpu_check.py, or bash tools/gpu_check.sh (every "
                    "check, one table).")
    ap.add_argument("--only", type=_check_list, default=list(DEFAULT_CHECKS),
                    help=f"comma-separated checks, in this order: {', '.join(CHECKS)} "
                         f"(default: all but mismatch_hang)")
    ap.add_argument("--steps", type=_positive, default=5,
                    help="training steps per check (default 5; step times are measured "
                         "over 2 x steps)")
    ap.add_argument("--out", default=os.path.join("runs", "gpu_check"),
                    help="folder for the JSON results, traces and logs "
                         "(default runs/gpu_check)")
    ap.add_argument("--layout", default=None,
                    help="the fleet layout OUTERxINNER (default 1xN, N ranks); the layout "
                         "check also runs the other one (2x(N/2), or Nx1) on a ProcessMesh")
    ap.add_argument("--shape", default="73m", choices=("tiny", "4m", "73m", "140m"),
                    help="tools/bench_model.py shape for the overlap and profile checks "
                         "(default 73m; tiny in --cpu-rehearsal)")
    ap.add_argument("--timeout", type=_positive, default=60,
                    help="PADDLE_HSDP_COLLECTIVE_TIMEOUT in seconds when it is not set "
                         "(default 60): the bound the mismatch checks expect")
    ap.add_argument("--phase", default="main",
                    help="name of this launch's results file (tools/gpu_check.sh sets it)")
    ap.add_argument("--report", metavar="OUT",
                    help="no launch: merge OUT's results and worker logs into one table")
    ap.add_argument("--preflight", action="store_true",
                    help="only check the flags, 2+ GPUs and a CUDA build; print the GPU "
                         "count")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run on CPU ranks (gloo) to rehearse the script; measures nothing")
    return ap.parse_args(argv)


def _check_list(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {unknown or text!r}; choose from {', '.join(CHECKS)}")
    return [c for c in CHECKS if c in names]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_layout(text: str, world: int) -> tuple:
    """``"OUTERxINNER"`` -> (outer, inner), their product the world size."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text or "")
    if not m:
        raise ValueError(f"--layout {text!r}: write it as OUTERxINNER, e.g. 1x{world}")
    outer, inner = int(m.group(1)), int(m.group(2))
    if outer < 1 or inner < 1 or outer * inner != world:
        raise ValueError(f"--layout {text}: OUTER x INNER must be the {world} ranks")
    return outer, inner


def other_layout(layout: tuple, world: int) -> tuple:
    """The layout the mesh front end checks next to the fleet one: 2x(N/2) (Nx1 for an
    odd N) next to 1xN; 1xN next to anything else."""
    if layout[0] != 1:
        return 1, world
    return (2, world // 2) if world % 2 == 0 else (world, 1)
