"""Paddle's master-grad mixed precision over HSDP (workers/worker_master_grad.py, in the
shared 2 x 2 launch): MixPrecisionLayer / MixPrecisionOptimizer after and before
fully_shard (2 x 2, ZeRO-1 with the torch toggle, the explicit 1 x 4 mesh) and
amp.decorate(level="O2") in PaddleFormers' order each match the unsharded model under
the same wrappers (float32, workers/parity.py's bound; synced main grads and clip norm
every step), a checkpoint round trip through the wrappers is exact, and the two
combinations that cannot be right are refused on every rank before any collective.
On CPU Paddle's bf16 autocast and decorate change nothing: the wrapper logic is what
is checked. The MoE (EP 2) run is in test_checkpoint.py's MoE launch."""

RUNS = ("after 2x2", "before 2x2 zero1", "after 1x4", "decorate_o2 2x2")
REFUSED = ("part_of_a_buffer", "decorate_after_fully_shard")


def test_master_grad_wrappers(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_master_grad.py, in the shared 2 x 2 launch
    for name in RUNS:
        assert log.count(f"MASTER_GRAD {name}: max rel diff") == 1, (name, log[-3000:])
    for name in REFUSED:
        assert log.count(f"MASTER_GRAD refused {name}") == 1, (name, log[-3000:])
    assert "MASTER_GRAD checkpoint: model and optimizer state back bit for bit" in log
