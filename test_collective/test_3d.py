"""HSDP inside 3D parallel jobs on CPU ranks (issues 32, 48), each run against one process
on the global batch (workers/parity.py's bounds; every figure is a PARITY_CHECK record):

* a tensor-parallel PaddleFormers ``LlamaForCausalLM`` at mp2 x sharding2, outer 1 and 2
  (float64), with ``tensor_parallel_output`` True (the ``c_softmax_with_cross_entropy``
  shim) and False (``c_concat``), with sequence parallelism and Paddle's
  ``register_sequence_parallel_allreduce_hooks`` called before and after ``fully_shard``,
  fused and not, or PaddleFormers' ``SPGradSyncCallback``; with neither it must miss
  (workers/worker_tp_llama.py, in conftest's PaddleFormers launch);
* the same Llama with SGD and with AdamW for 6 steps, the clip active at every one, every
  parameter compared, at mp2 x sharding S outer O for (S, O) = (2, 1), (2, 2) (that
  launch), (3, 3), (3, 1) (conftest's 6-rank launch: an outer degree, and an inner one,
  that is not a power of two) and (1, 1) (the 2-rank launch);
* a ``PipelineLayer`` trained with ``train_batch`` (1F1B, 4 micro-batches) at pp2 x
  sharding2 outer 2 (4 ranks) and pp2 x sharding4 outer 2 (8 ranks): float64 without
  clipping, float32 with clipping active, one outer all-reduce per buffer per step
  (workers/worker_pipeline.py);
* the CPU shims against the ops' definitions on 2 mp ranks (workers/worker_cpu_ops.py).
"""

import pytest

from launcher import part_of

TP_RUNS = [("tpo", 1), ("sp_before", 1), ("sp_after_fused", 1),
           ("concat", 2), ("sp_after", 2), ("sp_before_fused", 2),
           ("sp_callback", 2)]  # conftest.py: TP_LLAMA


@pytest.fixture(scope="module")
def tp_log(paddleformers_4_log):
    return part_of(paddleformers_4_log, "worker_tp_llama.py")


@pytest.mark.parametrize("run,outer", TP_RUNS, ids=[f"{r}-outer{o}" for r, o in TP_RUNS])
def test_tensor_parallel_llama_matches_one_process(tp_log, run, outer):
    line = f"TP_LLAMA {run} sharding=2 outer={outer}: max rel diff"
    assert line in tp_log, tp_log[-3000:]


# (launch fixture, sharding degree, outer degree): conftest.py's TP_LLAMA, TP_LLAMA_6,
# TP_LLAMA_2
CLIP_LAYOUTS = [("paddleformers_4_log", 2, 1), ("paddleformers_4_log", 2, 2),
                ("paddleformers_6_log", 3, 3), ("paddleformers_6_log", 3, 1),
                ("launch_2_log", 1, 1)]


@pytest.mark.parametrize("run", ["clip_sgd", "clip_adamw"])
@pytest.mark.parametrize("launch_name,sharding,outer", CLIP_LAYOUTS,
                         ids=[f"mp2-sharding{s}-outer{o}" for _, s, o in CLIP_LAYOUTS])
def test_clip_active_every_step_matches_one_process(request, launch_name, sharding, outer,
                                                    run):
    """Issue 48: every parameter, loss and pre-clip norm of 6 steps within the float64
    bound, the clip active at each step (asserted in the worker on the one-process
    norms, which the run's equal), in every layout of mp 2."""
    if launch_name == "launch_2_log":
        pytest.importorskip("paddleformers.trainer", reason="PaddleFormers is an optional extra")
    log = part_of(request.getfixturevalue(launch_name), "worker_tp_llama.py")
    label = f"TP_LLAMA {run} sharding={sharding} outer={outer}: max rel diff"
    lines = [line for line in log.splitlines() if line.startswith(label)]
    assert lines and "clip active at 6/6 steps" in lines[0], log[-3000:]


def test_three_replicas_match_one_process(request):
    """The 6-rank launch's AdamW run of three steps at outer 3 (the run at outer 1 and 2
    in the 4-rank launch)."""
    log = part_of(request.getfixturevalue("paddleformers_6_log"), "worker_tp_llama.py")
    assert "TP_LLAMA tpo sharding=3 outer=3: max rel diff" in log, log[-3000:]


def test_sequence_parallel_without_the_hooks_is_caught(tp_log):
    assert "TP_LLAMA sp_no_hooks sharding=2 outer=1 misses the reference" in tp_log, \
        tp_log[-3000:]


def test_paddleformers_criterion_runs_on_cpu_ranks(tp_log):
    assert "TP_LLAMA criterion loss" in tp_log, tp_log[-3000:]


def test_cpu_shims_match_the_ops_definitions(paddleformers_4_log):
    log = part_of(paddleformers_4_log, "worker_cpu_ops.py")
    assert "CPU_OPS 12 checks within 1e-10" in log, log[-3000:]


@pytest.mark.parametrize("launch_name,layout", [("launch_4_log", "pp2 sharding2 outer2"),
                                                ("launch_8_log", "pp2 sharding4 outer2")])
def test_pipeline_schedule_matches_one_process(request, launch_name, layout):
    log = part_of(request.getfixturevalue(launch_name), "worker_pipeline.py")
    for run in ("float64 clipped", "float32 clipped"):
        lines = [line for line in log.splitlines() if f"PIPELINE {run} {layout}:" in line]
        assert lines and "3 outer all-reduces per step" in lines[0], log[-3000:]
    assert "PIPELINE without topology= refused on every rank" in log, log[-3000:]
