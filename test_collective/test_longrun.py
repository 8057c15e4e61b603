"""The long-run check, short (tools/longrun.py: 20 steps, 2 x 2, gradient accumulation):
memory flat within 1% after warm-up and no growth in tensors, hooks, engine registries or
process groups on any rank. The 300-step run is the tool's default."""

import os
import subprocess
import sys

from launcher import ROOT


def test_memory_and_bookkeeping_stay_flat():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "longrun.py"),
                           "--steps", "20", "--warmup", "10", "--every", "5"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0 and "FLAT:" in proc.stdout, \
        proc.stdout[-4000:] + proc.stderr[-2000:]
