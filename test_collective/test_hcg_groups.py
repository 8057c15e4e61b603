"""fleet.init with fsdp_outer_degree on real CPU ranks (gloo): groups exist and work.

The 8-rank launches run back to back: before paddle_hsdp made gloo sub-group creation
safe, Paddle's own fleet.init failed or hung on several of these layouts.
"""

import json

import pytest

from launcher import launch

LAYOUTS_8 = [
    {"sharding_degree": 8, "outer": 2},
    {"mp_degree": 2, "sharding_degree": 4, "outer": 2},
    {"dp_degree": 2, "sharding_degree": 4, "outer": 2},
    {"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2, "outer": 2},
    {"sharding_degree": 8, "ep_degree": 2, "moe_sharding_degree": 4, "outer": 2},
]


def test_groups_4_ranks_sharding4_outer2():
    log = launch(4, "worker_groups.py", json.dumps({"sharding_degree": 4, "outer": 2}))
    assert "rank 0 dense: fsdp [0, 1, 2, 3] inner [0, 1] outer [0, 2]" in log


@pytest.mark.parametrize("config", LAYOUTS_8, ids=lambda c: "-".join(
    f"{k.replace('_degree', '')}{v}" for k, v in c.items()))
def test_groups_8_ranks(config):
    log = launch(8, "worker_groups.py", json.dumps(config))
    assert "rank 0 dense" in log and "rank 0 expert" in log
