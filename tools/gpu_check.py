"""The first GPU run of paddle_hsdp (issue 24): what only NCCL on real GPUs can show.

On one machine with 2+ GPUs and a CUDA build of Paddle (docs/gpu.md, "First GPU run"):

    bash tools/gpu_check.sh                     # every check, 3 launches, then one table
    PYTHONPATH=test_collective/workers \
        python -m paddle.distributed.launch --devices 0,1 tools/gpu_check.py   # one launch

Rank 0 prints one table, a row a check (PASS / FAIL / SKIP with its figures), and writes
it as JSON under ``--out``. The checks (``--only`` takes a comma-separated list):

* ``layout``: TinyLM (test_collective/workers/models.py) trained on the fleet layout
  (``--layout``, default 1xN: ``fsdp_outer_degree`` 1) and on the other one (2x(N/2))
  through an explicit ``ProcessMesh``, against single-GPU training on the whole batch:
  losses and every full parameter, fp32, within ``FP32_BOUND``;
* ``overlap``: step time of a Llama-shaped model (tools/bench_model.py) with overlap on
  (the defaults: async collectives, one unit of prefetch) and off
  (``enable_tensor_fusion_and_overlap=False``, prefetch 0), and the ratio;
* ``profile``: a ``paddle.profiler`` trace of two steps (chrome trace under ``--out``),
  and the fraction of reduce-scatter / all-gather kernel time that overlaps compute
  kernels;
* ``offload``: ``CPUOffloadPolicy(pin_memory=True)`` against no offload (losses and
  params), and where the optimizer's tensors live: every shard, its grad and every
  optimizer accumulator on a plain CPU place (not the GPU, not pinned);
* ``bf16``: ``MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")``
  against fp32: loss curves within ``BF16_LOSS_BOUND``, nothing NaN or inf;
* ``mismatch``: odd ranks run TinyLM's blocks in another order (equal sizes: the
  collectives pair up and nothing else fails) in an eval forward and in a training
  step: ``CollectiveMismatchError`` expected on every rank, with the seconds it took;
* ``mismatch_hang`` (only when asked for: it can end the process): the last rank calls a
  block once more than the others; expected: ``CollectiveMismatchError`` where the
  pairing shows it, and the watchdog (``PADDLE_HSDP_COLLECTIVE_TIMEOUT``) ending the
  rank left waiting, naming what it waited for. tools/gpu_check.sh runs it in a launch
  of its own and ``--report`` reads the outcome from the records and worker logs.

Without 2+ GPUs and a CUDA build it exits at once with status 2 and one line.
``--cpu-rehearsal`` runs the same code on CPU ranks (gloo; device-side tag flags and the
offload path forced on, as the tests do) to rehearse the script, not to measure anything. Unverified on a GPU: no GPU was
available to the project when it was written.

The checks import TinyLM and the parity measure from test_collective/workers: that folder
goes on PYTHONPATH (tools/gpu_check.sh puts it there; a launch without it stops with one
line saying so). The pieces, one job a module, are in tools/gpucheck/ (its __init__
lists them).
"""

import sys

# what test/test_gpu_check.py reaches through gpu_check (tools/ is on pytest.ini's pythonpath)
from gpucheck.cli import main
from gpucheck.kernels import (intersection_length, kernel_kind, kernels_from_chrome_trace,
                              kernels_from_nodes, length, overlap_report, union)
from gpucheck.mismatch_outcomes import HANG, MISMATCH_VARIANTS, summarise_mismatch
from gpucheck.options import DEFAULT_CHECKS, other_layout, parse_args, parse_layout
from gpucheck.parity_checks import parity_row
from gpucheck.placement import place_kind, storage_report
from gpucheck.preflight import EXIT_NO_GPU, gpu_problem
from gpucheck.speed_checks import profile_row
from gpucheck.table import exit_status, format_table, row

__all__ = ["DEFAULT_CHECKS", "EXIT_NO_GPU", "HANG", "MISMATCH_VARIANTS", "exit_status",
           "format_table", "gpu_problem", "intersection_length", "kernel_kind",
           "kernels_from_chrome_trace", "kernels_from_nodes", "length", "main", "other_layout",
           "overlap_report", "parity_row", "parse_args", "parse_layout", "place_kind",
           "profile_row", "row", "storage_report", "summarise_mismatch", "union"]

if __name__ == "__main__":
    sys.exit(main())
