"""Before anything runs: is there a CUDA build with 2+ GPUs (one line and status 2 if
not), and are the parity workers' modules importable (their folder is the caller's to
put on PYTHONPATH: tools/gpu_check.sh does)."""

from __future__ import annotations

import sys

from pythonpath import WORKERS, require

EXIT_NO_GPU = 2
NO_GPU = "needs 2+ GPUs with a CUDA build of Paddle"
# one launch by hand: the workers' folder on PYTHONPATH, as tools/gpu_check.sh sets it
LAUNCH = (f"PYTHONPATH={WORKERS} python -m paddle.distributed.launch --devices 0,1 "
          "tools/gpu_check.py")


def gpu_problem(cuda_build: bool, gpus: int, world: int, version: str = "?",
                launched: bool = False):
    """Why this process cannot run the GPU checks (one line), or None."""
    if not cuda_build:
        return (f"gpu_check: {NO_GPU}; found a CPU-only build of Paddle {version} "
                f"({gpus} GPUs visible)")
    if not launched:
        if gpus < 2:
            return f"gpu_check: {NO_GPU}; found {gpus} GPU{'s' if gpus != 1 else ''}"
        return None
    if world < 2:
        return (f"gpu_check: {NO_GPU} and a rank on each; found {gpus} GPUs and 1 rank: run "
                f"{LAUNCH}, or bash tools/gpu_check.sh")
    if gpus < 1:
        return f"gpu_check: {NO_GPU}; this rank sees no GPU"
    return None


def import_paddle():
    """``import paddle`` without its import-time warnings (no ccache, ...): the no-GPU
    answer stays one line."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import paddle
    return paddle


def fail_fast(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.exit(EXIT_NO_GPU)


def require_workers() -> None:
    """The checks run TinyLM, its data and reference trainer (test_collective/workers'
    common and models) and the workers' measure (parity) in this process: their folder
    must be on PYTHONPATH (tools/gpu_check.sh puts it there)."""
    require("gpu_check", WORKERS, ("common", "models", "parity"),
            f"bash tools/gpu_check.sh, or {LAUNCH}")
