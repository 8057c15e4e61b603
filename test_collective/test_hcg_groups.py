"""fleet.init with fsdp_outer_degree on real CPU ranks (gloo): groups exist and work.

Every launch of this tier checks the HSDP and HCG groups of its layout
(``workers/common.py: init_fleet -> check_groups``), so the layouts the parity tests
already run are checked there: sharding4 outer2 on 4 ranks (test_comm_ops, test_knobs,
test_recipes, ...), sharding8 outer2 (test_engine_parity 2x4), mp2 sharding4 outer2
(test_mp_pp), sharding8 ep2 moe_sharding4 outer2 (test_moe), dp2 sharding2 outer2 on 4
ranks (test_degenerate_layouts' dp test). This 8-rank layout runs nowhere else: before
paddle_hsdp made gloo sub-group creation safe, Paddle's own fleet.init failed or hung on
layouts like it. It is the first fleet.init of the 8-rank launch (conftest.py:
HCG_8 in launch_8_log), as it would be in a job of its own.
"""

from launcher import worker_sections


def test_groups_8_ranks_dp2_mp2_sharding2_outer2(launch_8_log):
    worker, log = worker_sections(launch_8_log)[0]
    assert worker == "worker_groups.py", worker  # the launch's first fleet.init
    assert "rank 0 dense" in log and "rank 0 expert" in log, log[-2000:]
