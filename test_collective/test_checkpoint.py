"""Sharded checkpoints (workers/worker_checkpoint.py): save in 2x2 on 4 ranks, resume in
2x2 (bit for bit), 1x4, 4x1, 1x2 on 2 ranks and one plain process (float64, within
workers/parity.py's bound of the uninterrupted run), and from a checkpoint the engine
wrote before its segment layout (test/data/checkpoint_v2_row_blocks) in 2x2;
a failed save keeps the previous checkpoint on every rank; corruption and another
model are refused on every rank."""

from launcher import part_of, run_single


def test_save_resume_across_layouts_and_failures(hsdp_2x2_log, launch_2_log, single_resume_out):
    # worker_checkpoint.py runs in the shared 2 x 2 launch (conftest.py), saving into
    # shared_2x2_work
    log = hsdp_2x2_log
    for label in ("2x2", "1x4", "4x1", "row-block checkpoint"):
        assert log.count(f"RESUME {label}:") == 1, log[-3000:]
    assert "SAVE_FAILURE" in log and "REFUSED" in log and "CORRUPTED rank 0" in log, log[-3000:]
    assert "FLEX_CHECKPOINT" in log, log[-3000:]
    # the 2-rank launch (conftest.py), from the checkpoint in shared_2x2_work
    log2 = part_of(launch_2_log, "worker_checkpoint_2ranks.py")
    assert log2.count("RESUME 1x2") == 1 and "BF16 1x2 -> 2x1" in log2, log2[-3000:]
    out = single_resume_out  # single_process_resume.py, from the checkpoints of the launches
    assert "SINGLE_RESUME" in out and "CONSOLIDATE_OK" in out, out[-2000:]
    assert "HFSDP_SINGLE_LOAD: equals full_state_dict" in out, out[-2000:]  # test_hfsdp.py


def test_experts_across_expert_parallel_degrees(launch_4_log, single_resume_out):
    """workers/worker_checkpoint_moe.py: EP 2 -> EP 1 and EP 1 -> EP 2 resumes match the
    uninterrupted run (float64, parity.py's bound), and EP 2 -> one plain process
    (single_process_resume.py); experts without global indices are refused;
    MixPrecisionLayer / MixPrecisionOptimizer over the EP-2 model, after and before
    fully_shard, match the plain model under the same wrappers (float32)."""
    log = part_of(launch_4_log, "worker_checkpoint_moe.py")  # the second 4-rank launch
    assert "MOE_RESUME ep2->ep1" in log and "MOE_RESUME ep1->ep2" in log, log[-3000:]
    assert "MOE_SINGLE_RESUME ep2 -> one process" in single_resume_out, single_resume_out[-3000:]
    assert "MOE_CLASH refused" in log, log[-3000:]
    # the same launch: Paddle's master-grad wrappers over the EP-2 model (float32)
    for order in ("after", "before"):
        assert f"MOE_MASTER_GRAD {order} ep2:" in log, log[-3000:]


def test_pipeline_checkpoint_resumes_in_two_stages_and_one(launch_4_log):
    """workers/worker_pipeline.py: a PipelineLayer trained with train_batch at pp2 x
    sharding2 outer 2 saves after step 2 (float64); resumed there, the last step and
    every parameter are bit-identical; resumed in one stage at pp1 x sharding4 outer 2,
    within parity.py's bound of the one-process reference."""
    log = part_of(launch_4_log, "worker_pipeline.py")
    assert "PIPELINE checkpoint pp2: resumed in the same layout, bit-identical" in log, log[-3000:]
    assert "PIPELINE checkpoint pp2 -> pp1 sharding4 outer2: max rel diff" in log, log[-3000:]


def test_tensor_and_pipeline_parallel_checkpoints_and_exports(paddleformers_4_log, threed_work):
    """workers/worker_tp_checkpoint.py (a PaddleFormers Llama at mp2 x sharding2 outer 2,
    float64): resumed in the same layout bit for bit, at mp1 x sharding4 outer 2 and in
    one process (single_process_3d.py) within parity.py's bound of the one-process
    reference; other full shapes refused naming the parameter; the mp2 export loads
    with from_pretrained exactly. workers/worker_llama_pipe.py (PaddleFormers' pipeline
    Llama at pp2 x sharding2 outer 2): its checkpoint loads into the plain Llama and its
    export with from_pretrained, both exactly."""
    log = part_of(paddleformers_4_log, "worker_tp_checkpoint.py")
    for line in ("TP_CKPT uninterrupted: max rel diff",
                 "TP_CKPT resume mp2 x sharding2 outer2: steps 3-4 and final params bit-identical",
                 "TP_CKPT other full shapes refused on every rank, naming the parameter",
                 "TP_EXPORT written", "TP_CKPT resume mp1 x sharding4 outer2: max rel diff"):
        assert line in log, log[-3000:]
    log = part_of(paddleformers_4_log, "worker_llama_pipe.py")
    assert "PIPE_LLAMA checkpoint and export written under the one-process names" in log, \
        log[-3000:]
    out = run_single("single_process_3d.py", threed_work)
    for line in ("TP_CKPT resume in one process: max rel diff", "TP_CONSOLIDATE",
                 "TP_EXPORT from_pretrained: ", "PIPE_CKPT pp2 -> one process: ",
                 "PIPE_EXPORT from_pretrained: "):
        assert line in out, out[-3000:]
