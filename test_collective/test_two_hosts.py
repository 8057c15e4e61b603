"""HSDP across two hosts: 2 network namespaces (each its own loopback, joined by a veth
pair) with 2 ranks each, launched with --nnodes 2 --master. The inner groups stay on a
host and the outer groups cross it, as on two real machines; anything that assumed
127.0.0.1 (gloo sub-group stores included) would fail here.

With root and iproute2 (CI runs as root) the hosts are network namespaces; elsewhere the
same two launchers run on this host's loopback (what a user without root can run), so
the tests run everywhere and never skip. The namespace hosts are the stricter of the two
(real addresses, no shared loopback), so one kind per run is enough.
The namespace hosts use TEST-NET-1 addresses (192.0.2.0/24) inside namespaces this test
creates and deletes.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest

from launcher import HERE, ROOT

IPS = ("192.0.2.30", "192.0.2.31")


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two hosts: network namespaces where root and iproute2 allow, else both launchers
    on this host's loopback (same launch, same --nnodes 2)."""
    if not _can_make_namespaces():
        yield [(None, None, "127.0.0.1"), (None, None, "127.0.0.1")]
        return
    tag = f"{os.getpid() % 100000}"
    ns, dev = [f"hsdpt{tag}h{i}" for i in (0, 1)], [f"vhsdp{tag}{i}" for i in (0, 1)]
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in (0, 1):
            _run("ip", "link", "set", dev[i], "netns", ns[i])
            _run("ip", "-n", ns[i], "addr", "add", f"{IPS[i]}/24", "dev", dev[i])
            _run("ip", "-n", ns[i], "link", "set", dev[i], "up")
            _run("ip", "-n", ns[i], "link", "set", "lo", "up")
        yield list(zip(ns, dev, IPS))
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def run_two_hosts(hosts, nproc: int, worker: str, *args: str, timeout: int = 300,
                  env_extra=None) -> tuple[list, dict, str]:
    """Both launchers; ``(exit codes, {host/workerlog.N: text}, log dir)``."""
    log_dir = tempfile.mkdtemp(prefix="hsdp_twohost_")
    port = random.randint(30000, 45000)
    # the trainers' ports (rank 0's job store among them) drawn per launch too: with
    # launch's fixed default (6070) a launch right after another sometimes found rank
    # 0's store port still taken, and Paddle 3.3.1's libuv store server then aborts
    # at creation (uv__finish_close assertion) and the other host waits for it forever
    start_port = random.randint(46000, 60000)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "workers"),
                                                       os.environ.get("PYTHONPATH", "")]),
               GLOG_minloglevel="2", **(env_extra or {}))
    procs = []
    for i, (ns, dev, ip) in enumerate(hosts):
        where = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}"] if ns else []
        cmd = [*where, sys.executable,
               "-m", "paddle.distributed.launch", "--master", f"{hosts[0][2]}:{port}",
               "--host", ip, "--nnodes", "2", "--nproc_per_node", str(nproc),
               "--start_port", str(start_port),
               "--log_dir", os.path.join(log_dir, f"host{i}"),
               os.path.join(HERE, "workers", worker), *args]
        out = open(os.path.join(log_dir, f"launcher{i}.out"), "w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=log_dir, stdout=out,
                                      stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    logs = {}
    for host in ("host0", "host1"):
        d = os.path.join(log_dir, host)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if name.startswith("workerlog"):
                logs[f"{host}/{name}"] = open(os.path.join(d, name), errors="replace").read()
    return codes, logs, log_dir


def launch_two_hosts(hosts, nproc: int, worker: str, *args: str, timeout: int = 300) -> str:
    codes, logs, log_dir = run_two_hosts(hosts, nproc, worker, *args, timeout=timeout)
    ok = sum("WORKER_OK" in t for t in logs.values())
    assert codes == [0, 0] and ok == 2 * nproc, (
        f"two-host launch failed: exit codes {codes}, {ok}/{2 * nproc} ranks OK; logs in "
        f"{log_dir}\n" + "\n".join(f"--- {k} ---\n" + "\n".join(t.splitlines()[-25:])
                                   for k, t in logs.items()))
    return logs["host0/workerlog.0"]


def test_hsdp_training_across_two_hosts(two_hosts):
    """HSDP 2x2 with one replica per host: the engine parity worker (losses, every
    param, grad norm and comm counts against single-process training)."""
    log = launch_two_hosts(two_hosts, 2, "worker_engine.py",
                           json.dumps({"sharding_degree": 4, "outer": 2}))
    assert log.count("PARITY 2x2") == 3, log[-2000:]


def test_a_rank_killed_on_one_host_ends_the_job_on_both(two_hosts):
    """Rank 3 (on host 1) is killed mid-step: both launchers exit non-zero within the
    bound and a survivor names the failed operation and group."""
    import time

    start = time.time()
    codes, logs, log_dir = run_two_hosts(two_hosts, 2, "worker_rank_death.py", "3", "kill",
                                         timeout=120,
                                         env_extra={"PADDLE_HSDP_COLLECTIVE_TIMEOUT": "20"})
    took = time.time() - start
    assert all(c not in (0, "timeout") for c in codes) and took < 120, (codes, took, log_dir)
    named = [k for k, t in logs.items() if "on group '" in t and "ranks [" in t]
    assert named, f"no survivor named the failure; logs in {log_dir}"
