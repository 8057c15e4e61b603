"""fully_shard's knobs on HSDP 2 x 2 (4 CPU ranks, one launch), each against a
single-process reference: bf16 mixed precision (bf16 gather, fp32 reduce; half the
all-gather bytes, float32 reduce-scatters), bf16 reduce (half the outer all-reduce
bytes), ignored_params, and a Replicate() placement."""

from launcher import launch

CHECKS = ("mixed_precision", "bf16_reduce", "ignored_params", "replicate_placement")


def test_knobs():
    log = launch(4, "worker_knobs.py", timeout=600)
    for name in CHECKS:
        assert f"KNOBS {name} max rel diff" in log, log[-3000:]
