"""Two "hosts" on one machine: network namespaces joined by a veth pair, optionally
rate-limited, for benchmarks of what crosses machines.

Each host is a network namespace with its own loopback and one end of a veth pair,
addressed from TEST-NET-1 (192.0.2.0/24, RFC 5737: never routed anywhere real). Names
carry a tag (by default this process's id), so parallel runs never collide. ``rate``
(e.g. ``100mbit``) puts a tbf qdisc on both veth ends: each direction of the cross-host
link then carries at most that rate, while ranks on the same host talk over its loopback
(``loopback_rate`` limits that too: both directions of a host's own traffic share it).

    python tools/two_hosts.py check              # root, ip, tc, and can we make a namespace?
    python tools/two_hosts.py up 100mbit         # create (tag "cli") and leave them up
    python tools/two_hosts.py down               # delete the "cli" hosts and stale ones
    python tools/two_hosts.py calibrate 100mbit  # alpha-beta figures, printed as JSON
    python tools/two_hosts.py ft 100mbit         # fault-tolerant HSDP: host 1 dies, rejoins

From Python::

    with TwoHosts(rate="100mbit") as hosts:
        codes = hosts.launch(2, "train.py", ["--steps", "10"], log_dir="logs")

``launch`` starts ``python -m paddle.distributed.launch --master IP0:PORT --host IPi
--nnodes 2`` in each namespace (``GLOO_SOCKET_IFNAME`` set to its veth). Everything is
torn down on leaving the ``with`` block, on an exception, Ctrl-C, SIGTERM/SIGHUP or at
interpreter exit. Needs root and iproute2 (``ip``; ``tc`` for a rate); without them the
command line says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

PREFIX = "hsdp2h"  # every namespace and device this tool makes starts with it
IPS = ("192.0.2.40", "192.0.2.41")  # TEST-NET-1
EXIT_UNAVAILABLE = 2
TIMEOUT_CODE = 124  # a host's exit code when launch() had to kill it (as timeout(1) does)
FAILED_PEER_GRACE_S = 30.0  # how long the other host may finish after one failed
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12, per frame
CLI_TAG = "cli"

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_UNIT_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
                   "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


class Unavailable(Exception):
    """The hosts cannot be made here: not root, no iproute2, or the kernel refused."""


class LaunchFailed(RuntimeError):
    """A launch on the hosts did not finish cleanly (the message names its logs)."""


@dataclass(frozen=True)
class Host:
    namespace: str
    device: str
    ip: str


# ---------------------------------------------------------------- pure helpers


def parse_rate(text: str | None) -> float | None:
    """Bytes per second of a tc rate (``100mbit``, ``1gbit``, ``500kbps``: tc's units,
    where ``bps`` means bytes); None for no limit (None, ``none``)."""
    if text is None or str(text).lower() == "none":
        return None
    match = _RATE.match(str(text).lower())
    if not match:
        raise ValueError(f"rate {text!r}: expected a number and one of "
                         f"{', '.join(_RATE_UNIT_BITS)} (e.g. 100mbit), or none")
    return float(match.group(1)) * _RATE_UNIT_BITS[match.group(2)] / 8


def hosts_for(tag: str) -> list[Host]:
    """The namespaces, veth ends and addresses of the hosts tagged ``tag``."""
    if not re.fullmatch(r"[a-z0-9]{1,7}", tag):
        raise ValueError(f"tag {tag!r}: 1 to 7 lowercase letters or digits (interface "
                         "names have 15 characters at most)")
    return [Host(f"{PREFIX}{tag}n{i}", f"{PREFIX}{tag}v{i}", ip) for i, ip in enumerate(IPS)]


def tag_of(namespace: str) -> str | None:
    """The tag of a namespace this tool made, or None for anyone else's."""
    match = re.fullmatch(rf"{PREFIX}([a-z0-9]{{1,7}})n[01]", namespace)
    return match.group(1) if match else None


def tbf_args(rate: str) -> list[str]:
    """tbf options for ``rate``: a burst of 4 ms of traffic (at least 64 KiB, so one
    TCP segmentation-offload frame passes whole) and a queue of 100 ms."""
    bytes_per_s = parse_rate(rate)
    burst = max(64 * 1024, int(bytes_per_s * 0.004))
    return ["rate", rate, "burst", str(burst), "latency", "100ms"]


def ring_cross_bytes(wire_bytes: float, group_ranks: list[int], rank: int,
                     host_of: dict[int, str]) -> float:
    """Bytes ``rank`` sends across hosts when a ring collective in group order moves
    ``wire_bytes`` from each rank to its successor: all of it if the successor is on
    another host, else none. Summed over ranks: what the cross-host link carries (both
    directions)."""
    if len(group_ranks) < 2:
        return 0.0
    successor = group_ranks[(group_ranks.index(rank) + 1) % len(group_ranks)]
    return float(wire_bytes) if host_of[successor] != host_of[rank] else 0.0


def gloo_reduce_scatter_cross_bytes(payload: float, group_ranks: list[int], rank: int,
                                    host_of: dict[int, str]) -> float:
    """Bytes ``rank`` sends across hosts in a reduce-scatter of ``payload`` bytes made, as
    paddle_hsdp does on gloo (which has none), of one gloo reduce per owner's slice, if
    each reduce is a ring reduce-scatter of the slice followed by every rank sending its
    reduced piece straight to the owner. Per rank that is ``1 + 1/n`` times a ring
    reduce-scatter's bytes, and the pieces to owners cross wherever the owner is. Two
    ranks exchange their slices instead (a ring's bytes)."""
    n = len(group_ranks)
    if n < 2:
        return 0.0
    if n == 2:  # the two ranks exchange slices (one all-gather of a slice each): a ring
        return ring_cross_bytes(payload / 2, group_ranks, rank, host_of)
    piece = payload / n / n  # a slice per owner, a piece of it per rank
    ring = n * ring_cross_bytes((n - 1) * piece, group_ranks, rank, host_of)
    to_owners = sum(piece for owner in group_ranks
                    if owner != rank and host_of[owner] != host_of[rank])
    return ring + to_owners


def payload_bytes(frame_bytes: int, frames: int) -> int:
    """TCP payload in ``frames`` frames of ``frame_bytes`` in all (headers taken off;
    pure ACKs carry none)."""
    return frame_bytes - HEADER_BYTES * frames


def alpha_beta(small_s: float, big_s: float, big_wire_bytes: float) -> dict:
    """Latency (the tiny op's time) and bandwidth (wire bytes per second of the big op
    once the latency is taken off) of ``t = alpha + wire_bytes / beta``."""
    return {"alpha_s": small_s, "beta_bytes_per_s": big_wire_bytes / max(big_s - small_s, 1e-9)}


# ---------------------------------------------------------------- system


def missing_requirements(need_tc: bool) -> list[str]:
    """What this machine lacks for the hosts, one line each (empty: nothing)."""
    missing = []
    if os.name != "posix" or os.geteuid() != 0:
        missing.append("not root: network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
    if shutil.which("ip") is None:
        missing.append("no `ip` command: install iproute2")
    if need_tc and shutil.which("tc") is None:
        missing.append("no `tc` command (needed for a rate limit): install iproute2")
    return missing


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def existing_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(namespace: str) -> list[int]:
    out = _run("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def end_processes(namespaces: list[str], grace_s: float = 5.0) -> None:
    """SIGTERM every process in our namespaces (all started by us: the names are ours),
    then SIGKILL what is left after ``grace_s``. The ranks run in sessions of their own,
    so a process group kill would miss them; the namespace finds them all."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = [p for ns in namespaces for p in pids_in(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while pids and time.time() < deadline:
            time.sleep(0.1)
            pids = [p for ns in namespaces for p in pids_in(ns)]
        if not pids:
            return


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through finally blocks: the hosts go away


# ---------------------------------------------------------------- the hosts


class TwoHosts:
    """Two network namespaces joined by a veth pair; see the module docstring."""

    def __init__(self, rate: str | None = None, tag: str | None = None,
                 loopback_rate: str | None = None):
        self.rate = None if rate is None or str(rate).lower() == "none" else str(rate)
        # a limit on each host's loopback too: traffic between ranks of one host (both
        # directions share it), so every link is slower than the CPU that drives it
        self.loopback_rate = None if loopback_rate is None or \
            str(loopback_rate).lower() == "none" else str(loopback_rate)
        for r in (self.rate, self.loopback_rate):
            if r is not None:
                parse_rate(r)  # refuse a malformed rate before touching anything
        self.tag = tag or str(os.getpid() % 10_000_000)
        self.hosts = hosts_for(self.tag)
        self._made = False
        self._old_handlers: dict[int, object] = {}

    # -- lifetime
    def __enter__(self) -> "TwoHosts":
        self._install_signal_handlers()
        atexit.register(self.destroy)
        try:
            self.create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.destroy()
        finally:
            atexit.unregister(self.destroy)
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal() needs it
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def create(self) -> None:
        """Make both hosts (and the rate limit). Raises :class:`Unavailable`."""
        missing = missing_requirements(need_tc=(self.rate or self.loopback_rate) is not None)
        if missing:
            raise Unavailable("; ".join(missing))
        taken = set(existing_namespaces()) & {h.namespace for h in self.hosts}
        if taken:
            raise Unavailable(f"namespaces {sorted(taken)} exist already (python "
                              f"tools/two_hosts.py down --tag {self.tag} removes them)")
        self._made = True  # from here destroy() removes whatever part exists
        try:
            self._make_link()
        except Unavailable:
            self.destroy()
            raise

    def _make_link(self) -> None:
        h0, h1 = self.hosts
        for h in self.hosts:
            _run("ip", "netns", "add", h.namespace)
        _run("ip", "link", "add", h0.device, "type", "veth", "peer", "name", h1.device)
        for h in self.hosts:
            _run("ip", "link", "set", h.device, "netns", h.namespace)
            _run("ip", "-n", h.namespace, "addr", "add", f"{h.ip}/24", "dev", h.device)
            _run("ip", "-n", h.namespace, "link", "set", h.device, "up")
            _run("ip", "-n", h.namespace, "link", "set", "lo", "up")
            if self.rate is not None:
                _run("tc", "-n", h.namespace, "qdisc", "add", "dev", h.device, "root", "tbf",
                     *tbf_args(self.rate))
            if self.loopback_rate is not None:
                _run("tc", "-n", h.namespace, "qdisc", "add", "dev", "lo", "root", "tbf",
                     *tbf_args(self.loopback_rate))

    def destroy(self) -> None:
        """End our processes in the hosts and delete them (idempotent)."""
        if not self._made:
            return
        names = [h.namespace for h in self.hosts]
        present = [n for n in names if n in existing_namespaces()]
        end_processes(present)
        for n in present:
            _run("ip", "netns", "del", n, check=False)  # takes its veth end, and so the pair
        _run("ip", "link", "del", self.hosts[0].device, check=False)  # made, never moved
        self._made = False

    def adopt(self) -> "TwoHosts":
        """Treat hosts made by another process (``up``) as ours to destroy."""
        self._made = True
        return self

    # -- running
    def launch(self, nproc: int, script: str, args=(), log_dir: str | None = None,
               env: dict | None = None, timeout: float = 600.0,
               on_hosts: tuple[int, ...] = (0, 1)) -> list[int]:
        """Run ``script args`` with ``nproc`` ranks on each host in ``on_hosts`` (one
        paddle launcher per host, the first one's address the master). Returns each
        launcher's exit code; a launcher still running at ``timeout``, or
        ``FAILED_PEER_GRACE_S`` after another failed, is killed with its ranks and
        reported as ``TIMEOUT_CODE``. ``env``: the launchers' environment (default:
        this process's). Logs: ``log_dir/host{i}/workerlog.N`` and
        ``log_dir/launcher{i}.out``."""
        log_dir = log_dir or tempfile.mkdtemp(prefix="two_hosts_")
        os.makedirs(log_dir, exist_ok=True)
        hosts = [self.hosts[i] for i in on_hosts]
        master = f"{hosts[0].ip}:{random.randint(30000, 45000)}"
        # the trainers' ports too (launch's fixed 6070 reused right after another launch
        # sometimes aborts Paddle's libuv store server at creation)
        start_port = random.randint(46000, 60000)
        procs, outs = [], []
        try:
            for host in hosts:
                i = self.hosts.index(host)
                outs.append(open(os.path.join(log_dir, f"launcher{i}.out"), "w"))
                cmd = launcher_command(host, master, len(hosts), nproc,
                                       os.path.join(log_dir, f"host{i}"), script, args,
                                       start_port)
                procs.append(subprocess.Popen(cmd, env=env, cwd=log_dir, stdout=outs[-1],
                                              stderr=subprocess.STDOUT))
            return _wait_all(procs, timeout)
        finally:  # timed out, a failed peer, Ctrl-C: nothing may outlive the call
            end_processes([h.namespace for h in hosts])
            for p in procs:
                p.wait()
            for f in outs:
                f.close()

    # -- counters
    def link_stats(self) -> dict:
        """Host 0's veth counters: everything that crossed, both directions."""
        h = self.hosts[0]
        out = _run("ip", "-n", h.namespace, "-s", "-j", "link", "show", h.device).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def veth_bytes(self) -> int:
        """Bytes (frames, headers included) that crossed between the hosts so far."""
        s = self.link_stats()
        return s["tx_bytes"] + s["rx_bytes"]

    def qdisc_drops(self) -> int:
        """Packets the rate limit dropped so far, both directions (0 without a rate)."""
        drops = 0
        for h in self.hosts:
            out = _run("tc", "-n", h.namespace, "-s", "-j", "qdisc", "show", "dev", h.device,
                       check=False).stdout
            drops += sum(q.get("drops", 0) for q in json.loads(out or "[]"))
        return drops


def launcher_command(host: Host, master: str, nnodes: int, nproc: int, log_dir: str,
                     script: str, args, start_port: int = 6070) -> list[str]:
    return ["ip", "netns", "exec", host.namespace, "env", f"GLOO_SOCKET_IFNAME={host.device}",
            sys.executable, "-m", "paddle.distributed.launch", "--master", master,
            "--host", host.ip, "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
            "--start_port", str(start_port), "--log_dir", log_dir, script, *map(str, args)]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):  # a failed host: its peer may hang
            deadline = min(deadline, time.time() + FAILED_PEER_GRACE_S)
        if time.time() >= deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return [TIMEOUT_CODE if c is None else c for c in codes]
        time.sleep(0.2)


# ---------------------------------------------------------------- calibration

CALIBRATION_BYTES = 8 * 2 ** 20


def calibrate(rate: str | None, big_bytes: int = CALIBRATION_BYTES, repeats: int = 5,
              timeout: float = 300.0) -> dict:
    """Alpha-beta figures of a 2-rank float32 all-reduce (gloo) across the hosts (one
    rank each, through the rate limit) and inside one host (two ranks, its loopback)."""
    out_dir = tempfile.mkdtemp(prefix="two_hosts_calibrate_")
    result = {"rate": rate, "nominal_bytes_per_s": parse_rate(rate),
              "op": "all_reduce of float32 between 2 ranks (gloo), rank 0's median time",
              "model": "t = alpha_s + wire_bytes / beta_bytes_per_s; wire_bytes = per-rank "
                       "ring bytes as paddle_hsdp.comm.counter counts them (an all-reduce "
                       "of S bytes over 2 ranks: S)",
              "big_bytes": big_bytes, "repeats": repeats}
    with TwoHosts(rate=rate) as hosts:
        for name, nproc, on_hosts in (("inter_host", 1, (0, 1)), ("intra_host", 2, (0,))):
            path = os.path.join(out_dir, f"{name}.json")
            cfg = {"bytes": big_bytes, "repeats": repeats, "out": path}
            codes = hosts.launch(nproc, os.path.abspath(__file__),
                                 ["_calibrate_worker", json.dumps(cfg)],
                                 log_dir=os.path.join(out_dir, name), env=_child_env(),
                                 timeout=timeout, on_hosts=on_hosts)
            if codes != [0] * len(on_hosts) or not os.path.exists(path):
                raise LaunchFailed(f"calibration {name} failed: exit codes {codes}; logs in "
                                   f"{out_dir}/{name}")
            with open(path) as f:
                timing = json.load(f)
            result[name] = {**alpha_beta(timing["small_s"], timing["big_s"], big_bytes),
                            **timing}
    return result


def _child_env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, GLOG_minloglevel="2",
                PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def calibrate_worker(cfg: dict) -> None:
    """Runs on each rank under the launcher: median times of a 4-byte and a big
    all-reduce, each after a barrier; rank 0 writes them."""
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()

    def median_time(numel: int, repeats: int) -> float:
        t = paddle.ones([numel], dtype="float32")
        dist.all_reduce(t)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    small = median_time(1, max(20, cfg["repeats"]))
    big = median_time(cfg["bytes"] // 4, cfg["repeats"])
    dist.barrier()
    if dist.get_rank() == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"small_s": small, "big_s": big, "small_bytes": 4}, f)


# ---------------------------------------------------------------- command line


def cmd_check(_args) -> int:
    missing = missing_requirements(need_tc=True)
    print(f"root: {'yes' if os.geteuid() == 0 else 'no'}")
    print(f"ip:   {shutil.which('ip') or 'missing'}")
    print(f"tc:   {shutil.which('tc') or 'missing'}")
    if not missing:
        probe = f"{PREFIX}probe{os.getpid() % 100000}"
        made = _run("ip", "netns", "add", probe, check=False)
        _run("ip", "netns", "del", probe, check=False)
        if made.returncode != 0:
            missing.append(f"the kernel refused a namespace: {made.stderr.strip()}")
        print(f"netns: {'ok' if made.returncode == 0 else 'refused'}")
    for line in missing:
        print(f"missing: {line}")
    return EXIT_UNAVAILABLE if missing else 0


def cmd_up(args) -> int:
    hosts = TwoHosts(rate=args.rate, tag=args.tag)
    hosts.create()  # no teardown at exit: `down` removes them
    print(json.dumps({"rate": hosts.rate, "hosts": [h.__dict__ for h in hosts.hosts]}))
    h = hosts.hosts[0]
    print(f"run inside: ip netns exec {h.namespace} env GLOO_SOCKET_IFNAME={h.device} ...",
          file=sys.stderr)
    return 0


def cmd_down(args) -> int:
    missing = missing_requirements(need_tc=False)
    if missing:
        raise Unavailable("; ".join(missing))
    TwoHosts(tag=args.tag).adopt().destroy()
    for ns in existing_namespaces():  # left by runs that were SIGKILLed
        tag = tag_of(ns)
        if tag and tag.isdigit() and not os.path.exists(f"/proc/{tag}"):
            end_processes([ns])
            _run("ip", "netns", "del", ns, check=False)
            print(f"removed stale {ns}")
    return 0


def cmd_calibrate(args) -> int:
    try:
        print(json.dumps(calibrate(args.rate, args.bytes, args.repeats), indent=1))
    except LaunchFailed as e:
        print(f"two_hosts: {e}", file=sys.stderr)
        return 1
    return 0


def kill_host(host: Host) -> None:
    """A machine dies: SIGKILL every process in the host's namespace at once."""
    for pid in pids_in(host.namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cmd_ft(args) -> int:
    """Fault-tolerant HSDP across the two hosts (tools/demo_ft.py's scenario): the
    coordinator and replica group 0 on host 0, group 1 on host 1; host 1's processes
    are all killed mid-run, and group 1 is started there again."""
    import demo_ft
    work = tempfile.mkdtemp(prefix="two_hosts_ft_")
    with TwoHosts(rate=None if args.rate == "none" else args.rate) as hosts:
        def on(host: Host, cmd: list[str]) -> list[str]:
            return ["ip", "netns", "exec", host.namespace, "env",
                    f"GLOO_SOCKET_IFNAME={host.device}", *cmd]

        def group_command(replica: int, log_dir: str) -> list[str]:
            host = hosts.hosts[replica]
            return on(host, [sys.executable, "-m", "paddle.distributed.launch", "--host",
                             host.ip, "--nproc_per_node", str(demo_ft.RANKS), "--log_dir",
                             log_dir, *demo_ft.worker_command(work, args.steps)])

        h0 = hosts.hosts[0]
        port = random.randint(30000, 45000)
        scenario = argparse.Namespace(replicas=2, steps=args.steps, kill_at=args.kill_at,
                                      restart_after=args.restart_after)
        return demo_ft.run_scenario(
            scenario, work, _child_env(),
            # the namespaces' link is the job's own: no TLS (--insecure)
            on(h0, [sys.executable, "-m", "paddle_hsdp.ft.coordinator", "--host", h0.ip,
                    "--insecure", "--port", str(port)]),
            f"{h0.ip}:{port}", group_command,
            lambda replica, proc: kill_host(hosts.hosts[replica]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_calibrate_worker"]:  # under paddle.distributed.launch
        calibrate_worker(json.loads(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="are root, ip and tc available?")
    up = sub.add_parser("up", help="create the hosts and leave them up")
    up.add_argument("rate", help="cross-host rate limit (e.g. 100mbit) or none")
    down = sub.add_parser("down", help="delete the hosts `up` made, and stale ones")
    for p in (up, down):
        p.add_argument("--tag", default=CLI_TAG, help=f"name tag (default {CLI_TAG})")
    cal = sub.add_parser("calibrate", help="alpha-beta of the link, as JSON")
    cal.add_argument("rate", help="cross-host rate limit (e.g. 100mbit) or none")
    cal.add_argument("--bytes", type=int, default=CALIBRATION_BYTES)
    cal.add_argument("--repeats", type=int, default=5)
    ft = sub.add_parser("ft", help="fault-tolerant HSDP: host 1 dies mid-run and rejoins")
    ft.add_argument("rate", help="cross-host rate limit (e.g. 100mbit) or none")
    ft.add_argument("--steps", type=int, default=80)
    ft.add_argument("--kill-at", type=int, default=10)
    ft.add_argument("--restart-after", type=float, default=3.0)
    args = ap.parse_args(argv)
    commands = {"check": cmd_check, "up": cmd_up, "down": cmd_down, "calibrate": cmd_calibrate,
                "ft": cmd_ft}
    try:
        return commands[args.command](args)
    except (Unavailable, ValueError) as e:
        print(f"two_hosts: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
