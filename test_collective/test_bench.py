"""tools/bench.py --quick completes and writes well-formed numbers (it checks the tool,
not the engine's speed: timings are never asserted in tests)."""

import json
import math
import os
import subprocess
import sys
import tempfile

from launcher import ROOT


def test_bench_quick():
    # hsdp1x4 is hsdp2x2's code path with another inner size (its bytes against the
    # formulas: test_engine_parity's 1x4 counter check), dp a third baseline beside
    # stage3 and the one-process run (the suite's time budget): two launches fewer
    out = tempfile.mkdtemp(prefix="hsdp_bench_test_")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--quick",
                           "--variants", "hsdp2x2,stage3", "--out", out],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "bench.json")) as f:
        summary = json.load(f)
    assert set(summary["variants"]) == {"hsdp2x2", "stage3", "single"}
    for name, entry in summary["variants"].items():
        for key in ("median_step_s", "peak_rss_mb_per_rank", "theoretical_mb_per_rank",
                    "time_vs_stage3", "memory_vs_stage3"):
            assert math.isfinite(entry[key]) and entry[key] > 0, (name, key, entry[key])
        assert entry["last_loss_diff_vs_single"] < 1e-3 * abs(entry["last_loss"]), name
    for name in ("hsdp2x2",):
        for kind, c in summary["variants"][name]["comm_bytes_per_step"].items():
            if c["theoretical"]:
                assert 1.0 <= c["ratio"] <= 1.03, (name, kind, c)
    timeline = summary["variants"]["hsdp2x2"]["timeline"]  # rank 0's, every engine event
    assert timeline["at_engine_peak"]["engine"] > 0 and timeline["at_rss_peak"]["rss_above_idle"]
    assert {"shard", "gathered", "full_grad", "shard_grad", "staging", "optimizer", "rss"} \
        <= set(timeline["columns"]["bytes"])
    for png in ("loss.png", "bars.png", "timeline.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000, png
