"""Expert parameters under HSDP on real CPU ranks, against a single-process reference:
losses, every final parameter and the global grad norm every step (float64 within workers/parity.py's bound; the fleet-optimizer run in float32), with an
expert that gets no tokens on some ranks and clipping active in both clip set-ups; and
HFSDP (fsdp_outer_sharding "optim", float32): dense and expert buffers each sub-sharded
across their own outer group."""

from launcher import part_of

# 8 ranks: expert shards in an inner group of 2 under 2 outer replicas, in the 8-rank
# launch (conftest.py: launch_8_log). The 4-rank layout (moe_sharding 2: expert
# inner group of 1) trains in test_checkpoint.py's MoE test (EP 2 steps before the save
# and after the load, against the same single-process run).


def test_moe_parity_8ranks_ep2_ms4(launch_8_log):
    log = part_of(launch_8_log, "worker_moe.py")  # conftest.py: MOE_8
    assert log.count("MOE_PARITY") == 3, log[-2000:]
    assert log.count("MOE_PARITY float32 fleet_opt=False hfsdp") == 1, log[-2000:]
