"""fleet.init with fsdp_outer_degree on real CPU ranks (gloo): groups exist and work.

Every launch of this tier checks the HSDP and HCG groups of its layout
(``workers/common.py: init_fleet -> check_groups``), so the layouts the parity tests
already run are checked there: sharding4 outer2 on 4 ranks (test_comm_ops, test_knobs,
test_recipes, ...), sharding8 outer2 (test_engine_parity 2x4), mp2 sharding4 outer2
(test_mp_pp), sharding8 ep2 moe_sharding4 outer2 (test_moe), dp2 sharding2 outer2 on 4
ranks (test_degenerate_layouts' dp test). This 8-rank layout runs nowhere else: before
paddle_hsdp made gloo sub-group creation safe, Paddle's own fleet.init failed or hung on
layouts like it.
"""

import json

import pytest

from launcher import launch

LAYOUTS_8 = [
    {"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2, "outer": 2},
]


@pytest.mark.parametrize("config", LAYOUTS_8, ids=lambda c: "-".join(
    f"{k.replace('_degree', '')}{v}" for k, v in c.items()))
def test_groups_8_ranks(config):
    log = launch(8, "worker_groups.py", json.dumps(config))
    assert "rank 0 dense" in log and "rank 0 expert" in log
