"""fully_shard's knobs on HSDP 2 x 2 (4 CPU ranks, one launch), each against a
single-process reference: bf16 mixed precision (bf16 gather, fp32 reduce; half the
all-gather bytes, float32 reduce-scatters), the same under HFSDP (fsdp_outer_sharding
"optim"), bf16 reduce (half the outer all-reduce bytes), ignored_params, a Replicate()
placement, and CPU offload with its path forced on CPU (equal to the fp32 run bit for
bit, its copies counted; under HFSDP equal to the HFSDP run); the outer all-reduce
issued during backward equals the step-time one bit for bit and overlaps backward."""

CHECKS = ("mixed_precision", "mixed_precision_hfsdp", "bf16_reduce", "ignored_params",
          "replicate_placement")


def test_knobs(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_knobs.py, in the shared 2 x 2 launch (conftest.py)
    for name in CHECKS:
        assert f"KNOBS {name} max rel diff" in log, log[-3000:]
    assert "KNOBS offload_forced equal to the fp32 run bit for bit" in log, log[-3000:]
    assert "KNOBS offload_forced_hfsdp equal to the HFSDP run bit for bit" in log, log[-3000:]
    assert "KNOBS early_outer_sync equal to the step-time sync bit for bit" in log, log[-3000:]
