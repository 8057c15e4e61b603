"""Sharded checkpoints (workers/worker_checkpoint.py): save in 2x2 on 4 ranks, resume in
2x2 (bit for bit), 1x4, 4x1, 1x2 on 2 ranks and one plain process (float64, within
workers/parity.py's bound of the uninterrupted run);
a failed save keeps the previous checkpoint on every rank; corruption and another
model are refused on every rank."""

from launcher import part_of, run_single


def test_save_resume_across_layouts_and_failures(hsdp_2x2_log, shared_2x2_work, launch_2_log):
    # worker_checkpoint.py runs in the shared 2 x 2 launch (conftest.py), saving into
    # shared_2x2_work
    log, work = hsdp_2x2_log, shared_2x2_work
    for label in ("2x2", "1x4", "4x1"):
        assert log.count(f"RESUME {label}:") == 1, log[-3000:]
    assert "SAVE_FAILURE" in log and "REFUSED" in log and "CORRUPTED rank 0" in log, log[-3000:]
    assert "FLEX_CHECKPOINT" in log, log[-3000:]
    # the 2-rank launch (conftest.py), from the checkpoint in shared_2x2_work
    log2 = part_of(launch_2_log, "worker_checkpoint_2ranks.py")
    assert log2.count("RESUME 1x2") == 1 and "BF16 1x2 -> 2x1" in log2, log2[-3000:]
    out = run_single("single_process_resume.py", work)
    assert "SINGLE_RESUME" in out and "CONSOLIDATE_OK" in out, out[-2000:]
    assert "HFSDP_SINGLE_LOAD: equals full_state_dict" in out, out[-2000:]  # test_hfsdp.py


def test_experts_across_expert_parallel_degrees(launch_4_log):
    """workers/worker_checkpoint_moe.py: EP 2 -> EP 1 and EP 1 -> EP 2 resumes match the
    uninterrupted run (float64, parity.py's bound); experts without global indices are
    refused; MixPrecisionLayer / MixPrecisionOptimizer over the EP-2 model, after and
    before fully_shard, match the plain model under the same wrappers (float32)."""
    log = part_of(launch_4_log, "worker_checkpoint_moe.py")  # the second 4-rank launch
    assert "MOE_RESUME ep2->ep1" in log and "MOE_RESUME ep1->ep2" in log, log[-3000:]
    assert "MOE_CLASH refused" in log, log[-3000:]
    # the same launch: Paddle's master-grad wrappers over the EP-2 model (float32)
    for order in ("after", "before"):
        assert f"MOE_MASTER_GRAD {order} ep2:" in log, log[-3000:]
