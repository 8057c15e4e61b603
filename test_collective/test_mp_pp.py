"""HSDP next to tensor (mp2) and pipeline (pp2) parallelism on 8 CPU ranks, each with
sharding4 as [2 outer, 2 inner]: global clip norm per step, every final parameter and
the loss match an independent single-process reference (float32, workers/parity.py's bound), for the
plain ClipGradByGlobalNorm optimizer and for fleet.distributed_optimizer."""

import json

import pytest

from launcher import launch

CONFIGS = [{"mp_degree": 2, "sharding_degree": 4, "outer": 2, "tag": "MP"},
           {"pp_degree": 2, "sharding_degree": 4, "outer": 2, "tag": "PP"}]


@pytest.mark.parametrize("config", CONFIGS, ids=["mp2-sharding4-outer2", "pp2-sharding4-outer2"])
def test_parity(config):
    log = launch(8, "worker_mp_pp.py", json.dumps(config), timeout=600)
    lines = [line for line in log.splitlines() if f"{config['tag']}_PARITY" in line]
    print("\n".join(lines))
    assert len(lines) == 2, log[-2000:]
