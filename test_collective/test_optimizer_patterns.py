"""Paddle's own optimizer patterns over HSDP (issue 47; workers/worker_optimizer_patterns.py
at 1 x 2 in the 2-rank launch and 2 x 2 in the shared 4-rank launch), each against the
unsharded model trained in one process on the whole batch with the same optimizer,
losses and every parameter within the parity bound, the clip active at every step:
an optimizer that overrides ``step`` and ``_apply_optimize`` (a hand-written SGD, a
Muon-style optimizer over ``Replicate()`` matrices), ``MixPrecisionOptimizer`` inside
``fleet.distributed_optimizer`` (Momentum, AdamW), parameter groups with a clip (one
micro-step and two), the Muon-style optimizer over the default row shards too (its
first step moves the matrices onto owners; issue 64); a full optimizer state dict in
``set_state_dict`` loads (each rank its rows) and comes back out exactly."""

import pytest

from launcher import part_of

CHECKS = ("hand_sgd", "toy_muon_replicated", "toy_muon_moved", "master_grad_fleet_momentum",
          "master_grad_fleet_adamw", "param_groups", "param_groups_accumulated")


@pytest.mark.parametrize("launch_name,layout", [("launch_2_log", "1x2"),
                                                ("hsdp_2x2_log", "2x2")])
def test_optimizer_patterns_match_one_process(request, launch_name, layout):
    log = part_of(request.getfixturevalue(launch_name), "worker_optimizer_patterns.py")
    for name in CHECKS:
        assert log.count(f"OPT_PATTERNS {name} {layout}: max rel diff") == 1, (name, log[-3000:])
    assert f"OPT_PATTERNS loaded full_optimizer_state {layout}: " in log, log[-3000:]
    assert f"OPT_PATTERNS {layout} done" in log, log[-3000:]
