"""The frame of a one-shot measuring tool that launches itself on 4 CPU ranks
(tools/bench_save.py, tools/bench_agreement.py): its flags, and the launch of its
worker half, whose result it reads from a file in the run's folder."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from benchkit.settings import ROOT


def parse(doc: str) -> argparse.Namespace:
    """``--rounds`` and ``--model`` (the tool's), ``--worker`` and ``--out`` (its own
    launch's, hidden)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="140m")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def launch_worker(script: str, args: argparse.Namespace, nproc: int = 4) -> str | None:
    """Run ``script --worker`` on ``nproc`` CPU ranks in a new folder; the folder, or
    None (after saying where the logs are) when the run failed."""
    name = os.path.splitext(os.path.basename(script))[0]
    work = tempfile.mkdtemp(prefix=f"hsdp_{name}_")
    env = dict(os.environ, GLOG_minloglevel="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", os.path.join(work, "log"), os.path.abspath(script), "--worker",
           "--out", work, "--rounds", str(args.rounds), "--model", args.model]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        print(f"{name}: the run failed; logs in {work}/log")
        return None
    return work
