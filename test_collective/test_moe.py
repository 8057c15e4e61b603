"""Expert parameters under HSDP on real CPU ranks, against a single-process reference:
losses, every final parameter and the global grad norm every step (float64 within workers/parity.py's bound; the fleet-optimizer run in float32), with an
expert that gets no tokens on some ranks and clipping active in both clip set-ups; and
HFSDP (fsdp_outer_sharding "optim", float32): dense and expert buffers each sub-sharded
across their own outer group."""

import json

import pytest

from launcher import launch

# 8 ranks: expert shards in an inner group of 2 under 2 outer replicas. The 4-rank layout
# (moe_sharding 2: expert inner group of 1) trains in test_checkpoint.py's MoE test
# (EP 2 steps before the save and after the load, against the same single-process run).
LAYOUTS = [
    (8, {"sharding_degree": 8, "ep_degree": 2, "moe_sharding_degree": 4, "outer": 2}),
]


@pytest.mark.parametrize("ranks,config", LAYOUTS, ids=["8ranks-ep2-ms4"])
def test_moe_parity(ranks, config):
    log = launch(ranks, "worker_moe.py", json.dumps(config), timeout=600)
    assert log.count("MOE_PARITY") == 3, log[-2000:]
    assert log.count("MOE_PARITY float32 fleet_opt=False hfsdp") == 1, log[-2000:]
