"""Run a worker script on N CPU ranks with ``python -m paddle.distributed.launch``."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def launch(nproc: int, worker: str, *args: str, timeout: int = 300) -> str:
    """Launch ``workers/<worker>`` on ``nproc`` ranks; return rank 0's log.

    Fails the calling test with every rank's log tail when the launch fails or times
    out, so a hang on one rank shows up as a readable failure, never a stuck CI job.
    """
    log_dir = tempfile.mkdtemp(prefix=f"hsdp_{os.path.splitext(worker)[0]}_")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("GLOG_minloglevel", "2")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", log_dir, os.path.join(HERE, "workers", worker), *args]
    try:
        proc = subprocess.run(cmd, env=env, cwd=log_dir, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(
            e.stdout, bytes) else (e.stdout or "")
    logs = {p: open(p, errors="replace").read()
            for p in sorted(glob.glob(os.path.join(log_dir, "workerlog.*")))}
    if rc != 0:
        tails = "\n".join(f"--- {p} ---\n" + "\n".join(t.splitlines()[-40:])
                          for p, t in logs.items())
        raise AssertionError(f"launch of {worker} {' '.join(args)} failed (rc={rc}).\n"
                             f"launcher:\n{out[-3000:]}\n{tails}")
    ok = [p for p, t in logs.items() if "WORKER_OK" in t]
    assert len(ok) == nproc, f"only {len(ok)}/{nproc} ranks reported WORKER_OK: {log_dir}"
    return logs[os.path.join(log_dir, "workerlog.0")]
