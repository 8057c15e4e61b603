"""Run a worker script on N CPU ranks with ``python -m paddle.distributed.launch``."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Every PARITY_CHECK a worker printed this session (workers/parity.py); conftest.py
# prints their margins at the end of the run.
PARITY_RECORDS: list[dict] = []
# (launch, worker, seconds) of every run_many.py worker this session (conftest.py
# prints them at the end of the run: what each worker costs the suite)
WORKER_TIMES: list[tuple[str, str, float]] = []


def collect_parity(log: str, test: str) -> None:
    """Keep the PARITY_CHECK records of one process's output (under run_many.py, each
    record is named by the worker that printed it)."""
    for line in log.splitlines():
        if line.startswith("RUN_MANY "):
            test = line[len("RUN_MANY "):]
        elif line.startswith("PARITY_CHECK "):
            PARITY_RECORDS.append(dict(json.loads(line[len("PARITY_CHECK "):]), test=test))


def worker_sections(log: str) -> list[tuple[str, str]]:
    """A run_many.py launch's log cut at its ``RUN_MANY <worker>`` lines:
    ``[(worker, its lines), ...]`` in the order the workers ran (without run_many's
    ``RUN_MANY_TIME`` lines: :func:`worker_times`)."""
    sections: list[tuple[str, list]] = []
    for line in log.splitlines():
        if line.startswith("RUN_MANY "):
            sections.append((line[len("RUN_MANY "):], []))
        elif sections and not line.startswith("RUN_MANY_TIME "):
            sections[-1][1].append(line)
    return [(worker, "\n".join(lines)) for worker, lines in sections]


def worker_times(log: str) -> list[tuple[str, float]]:
    """Each worker's wall time in a run_many.py launch, in seconds, in run order."""
    return [(line.split()[1], float(line.split()[2])) for line in log.splitlines()
            if line.startswith("RUN_MANY_TIME ")]


def part_of(log: str, worker: str) -> str:
    """The lines ``worker`` printed in a run_many.py launch's log (every run of it)."""
    return "\n".join(text for name, text in worker_sections(log) if name == worker)


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
    rank0 = logs[os.path.join(log_dir, "workerlog.0")]
    collect_parity(rank0, f"{worker} {' '.join(args)}")
    WORKER_TIMES.extend((f"{nproc} ranks", name, seconds) for name, seconds in worker_times(rank0))
    return rank0


def run_single(worker: str, *args: str, timeout: int = 300) -> str:
    """Run ``workers/<worker>`` in one plain process (no launcher); return its stdout,
    failing the calling test with its output when it exits non-zero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "workers")]),
               GLOG_minloglevel="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "workers", worker), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    collect_parity(proc.stdout, f"{worker} {' '.join(args)}")
    return proc.stdout
