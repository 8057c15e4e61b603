"""The YAML front end on real CPU ranks (workers/worker_config.py): a model sharded
from a config file alone trains bit for bit like the same model sharded by hand, and
the plan's per-step bytes equal the communication counter's; the demo runs a shipped
config."""

import json
import os
import subprocess
import tempfile

from launcher import ROOT, part_of


def test_yaml_run_matches_hand_sharding_and_plan_bytes(launch_4_log):
    # in the second 4-rank launch (conftest.py), whose first fleet.init is this worker's
    log = part_of(launch_4_log, "worker_config.py")
    assert "PLAN_BYTES_EQUAL" in log and "YAML_EQUALS_HAND" in log, log[-3000:]
    assert "LIVE_TOPOLOGY_CHECKED" in log, log[-3000:]
    for stage in (1, 2, 3):
        assert f"PLAN_BYTES_EQUAL zero_stage {stage}" in log, log[-3000:]


def test_demo_runs_the_shipped_moe_config():
    """tools/configs/moe_lm.yaml through the demo (2 steps): it trains, the
    communication it measures is the plan's, group by group, and it leaves a run
    directory."""
    run_dir = tempfile.mkdtemp(prefix="hsdp_demo_run_")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "demo.sh"), "--steps", "2",
                           "--run-dir", run_dir,
                           "--model", "moe", "--config",
                           os.path.join(ROOT, "tools", "configs", "moe_lm.yaml")],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if "measured / planned" in x)
    ratios = [float(part.split()[-1]) for part in line.split(": ", 1)[1].split(", ")]
    # inner all_gather, its tags' all_gather_tags, inner reduce_scatter, outer all_reduce
    assert len(ratios) == 4 and all(r == 1.0 for r in ratios), line
    # the run directory: a metrics line per step, the loss curve, traffic per group
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000
    with open(os.path.join(run_dir, "comm.json")) as f:
        comm = json.load(f)
    assert comm["outer all_reduce"]["wire_bytes"] == comm["outer all_reduce"]["planned_wire_bytes"]
    assert f"run directory: {run_dir}" in proc.stdout
