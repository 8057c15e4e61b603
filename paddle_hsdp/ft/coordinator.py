"""The coordinator of a fault-tolerant job: a Paddle ``TCPStore`` no replica hosts.

    python -m paddle_hsdp.ft.coordinator --port 29600 [--host ADDRESS]

It listens on ``--host`` (default 127.0.0.1: one-host jobs); a multi-host job gives the
address its replica groups reach it at. Its store has no authentication (what the
groups exchange through it is JSON, never unpickled, but a writer could disturb the
job: docs/fault-tolerance.md, "Trust"): keep the port on a network only the job's hosts
reach. Every interface (0.0.0.0) is allowed, with a warning.

It keeps the rounds' records and the replicas' heartbeats (paddle_hsdp.ft.store) and
runs until stopped. It holds no model state: every replica group can die and restart
around it. If it dies, start it again with the same command within the replicas' round
timeout (PADDLE_HSDP_FT_ROUND_TIMEOUT): their clients reconnect and write again what
the rounds need (docs/fault-tolerance.md).
"""

from __future__ import annotations

import argparse
import signal
import sys

from .store import serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paddle_hsdp.ft.coordinator",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; a multi-host job "
                             "gives the address its groups reach)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.host in ("0.0.0.0", "::", ""):
        print(f"paddle_hsdp.ft coordinator: WARNING: listening on every interface "
              f"({args.host!r}) with no authentication; whoever reaches the port can "
              "write what every replica group reads. Give --host the address of the "
              "job's own network.", file=sys.stderr, flush=True)
    server = serve(args.host, args.port)  # serves while it lives
    print(f"paddle_hsdp.ft coordinator listening on {args.host}:{args.port}", flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
