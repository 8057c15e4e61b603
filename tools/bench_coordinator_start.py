"""How long a (re)started coordinator takes until etcd answers: what a restart costs the
groups' outage budget (docs/fault-tolerance.md, "The coordinator restarted").

    python tools/bench_coordinator_start.py [--rounds 5]

Side by side, alternating: ``python -m paddle_hsdp.ft.coordinator`` as it starts (etcd
without Paddle), and the same ``main()`` after ``import paddle_hsdp`` (Paddle first, as
the coordinator started before 2026-12-07). Each start: from the process's launch to
the first answered request; medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until_answers(port: int, timeout_s: float) -> None:
    """Poll etcd's gateway (this process imports nothing of the package: its own start
    is not what is measured, and the package would bring Paddle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            requests.post(f"http://127.0.0.1:{port}/v3/maintenance/status", json={},
                          timeout=1).raise_for_status()
            return
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_start(paddle_first: bool, folder: str) -> float:
    port, peer = _free_port(), _free_port()
    args = ["--port", str(port), "--peer-port", str(peer), "--data-dir", folder]
    command = ([sys.executable, "-c", "import sys, paddle_hsdp; from paddle_hsdp.ft.coordinator "
                "import main; sys.exit(main(sys.argv[1:]))", *args] if paddle_first else
               [sys.executable, "-m", "paddle_hsdp.ft.coordinator", *args])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until_answers(port, 120)
        return time.perf_counter() - started
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times: dict[bool, list[float]] = {False: [], True: []}
    work = tempfile.mkdtemp(prefix="coordinator_start_")
    try:
        for i in range(rounds):
            for paddle_first in (False, True):
                folder = os.path.join(work, f"{i}_{int(paddle_first)}")
                times[paddle_first].append(one_start(paddle_first, folder))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    now, before = statistics.median(times[False]), statistics.median(times[True])
    print(f"etcd answers after (median of {rounds}, range): without Paddle {now:.2f} s "
          f"({min(times[False]):.2f}-{max(times[False]):.2f}); Paddle imported first "
          f"{before:.2f} s ({min(times[True]):.2f}-{max(times[True]):.2f}); "
          f"ratio {before / now:.1f}x")


if __name__ == "__main__":
    main()
