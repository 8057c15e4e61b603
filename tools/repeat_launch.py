"""Repeat a short 4-rank launch many times and report every exit status.

    python tools/repeat_launch.py                      # 30 launches of the exit worker
    python tools/repeat_launch.py -n 60 --worker test_collective/workers/worker_mesh.py

The default worker creates five gloo sub-groups, all-reduces on each and exits, with
and without a final barrier in turn (test_collective/workers/worker_exit.py). A
launch passes when the launcher exits 0 and every rank printed WORKER_OK; failed
launches keep their log folders. Exit code: 0 when every launch passed.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=30, help="launches (default 30)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--worker", default="test_collective/workers/worker_exit.py")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args(argv)
    worker = os.path.join(ROOT, args.worker)
    env = dict(os.environ, GLOG_minloglevel="2", PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(ROOT, "test_collective", "workers"),
         os.environ.get("PYTHONPATH", "")]))
    statuses = collections.Counter()
    failed = []
    for i in range(args.n):
        extra = [] if "worker_exit" not in args.worker else \
            ["barrier" if i % 2 == 0 else "no_barrier"]
        log_dir = tempfile.mkdtemp(prefix="hsdp_repeat_")
        start = time.time()
        try:
            rc = subprocess.run([sys.executable, "-m", "paddle.distributed.launch",
                                 "--nproc_per_node", str(args.nproc), "--log_dir", log_dir,
                                 worker, *extra], env=env, cwd=log_dir, timeout=args.timeout,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        ok = sum("WORKER_OK" in open(os.path.join(log_dir, f), errors="replace").read()
                 for f in os.listdir(log_dir) if f.startswith("workerlog"))
        status = rc if ok == args.nproc or rc != 0 else f"{rc} ({ok}/{args.nproc} OK)"
        statuses[str(status)] += 1
        print(f"launch {i + 1}/{args.n} {' '.join(extra)}: exit {status} "
              f"({time.time() - start:.1f} s)", flush=True)
        if status != 0:
            failed.append(log_dir)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    print(f"\n{args.n} launches: " + ", ".join(f"exit {k}: {v}" for k, v in statuses.items()))
    for d in failed:
        print(f"failed launch logs: {d}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
