"""Does a rejoin's handoff (ft/handoff.py) run beside Paddle's compute in one process?

The donor sends its copy on a thread (socket and HMAC let go of Python's lock while
they work) while its main thread trains. Here one process times a Paddle compute loop
(eager matmuls, forward and backward of a small MLP, the shape of a step) alone, the
send of ``--mib`` MiB alone (to a receiver process that takes and checks it, as a
joiner does), and the two at once, in turn, ``--reps`` times; it prints the medians
and, side by side, how much the send slowed the compute and how much of the shorter of
the two was hidden under the other (1: fully overlapped, 0: one after the other).

    python tools/bench_handoff.py --mib 16 --reps 7
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
WHERE = (1, "handoff", 0, 1, 0)
SECRET = "the-handoff-bench-secret"


def receiver(port: int, size: int, reps: int) -> None:
    """The joiner's side, in a process of its own: each stream taken and checked."""
    import numpy as np

    from paddle_hsdp.ft import handoff
    from paddle_hsdp.ft.trust import signer_from_env
    blob, signer = np.empty(size, dtype=np.uint8), signer_from_env()
    with socket.create_server(("127.0.0.1", port)) as server:
        server.accept()[0].close()  # the sender's probe that it listens
        for _ in range(reps):
            conn, _ = server.accept()
            with conn:
                handoff.receive_state(conn, blob, signer, WHERE)
                conn.sendall(b"k")


def compute(steps: int) -> float:
    import paddle
    model = paddle.nn.Sequential(paddle.nn.Linear(512, 1024), paddle.nn.GELU(),
                                 paddle.nn.Linear(1024, 512))
    x = paddle.randn([256, 512])
    began = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
        model.clear_gradients()
    return time.perf_counter() - began


def send(port: int, blob, signer) -> float:
    from paddle_hsdp.ft import handoff
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:  # (it listens: see main)
        handoff.send_state(conn, blob, signer, WHERE)
        conn.recv(1)  # taken and checked
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="compute iterations")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--receive", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        return receiver(*args.receive)
    import numpy as np

    from paddle_hsdp.ft.trust import Signer
    size, port = args.mib << 20, _free_port()
    env = dict(os.environ, PADDLE_HSDP_FT_SECRET=SECRET, GLOG_minloglevel="2")
    child = subprocess.Popen([sys.executable, __file__, "--receive", str(port), str(size),
                              str(2 * args.reps)], env=env)
    blob, signer = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8), \
        Signer(SECRET)
    deadline = time.time() + 120  # the receiver imports Paddle, then listens
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()  # (its first accept)
            break
        except ConnectionRefusedError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    compute(2)  # warm-up
    alone, sent, together, beside, sent_beside = [], [], [], [], []
    for _ in range(args.reps):
        alone.append(compute(args.steps))
        sent.append(send(port, blob, signer))
        result = {}
        thread = threading.Thread(target=lambda: result.update(s=send(port, blob, signer)))
        began = time.perf_counter()
        thread.start()
        beside.append(compute(args.steps))
        thread.join()
        together.append(time.perf_counter() - began)
        sent_beside.append(result["s"])
    child.wait(timeout=60)
    c, s, both, cb, sb = (statistics.median(v) for v in (alone, sent, together, beside,
                                                           sent_beside))
    hidden = (c + s - both) / min(c, s)
    print(f"{args.mib} MiB sent and checked (HMAC-SHA256, 1 MiB chunks) beside {args.steps} "
          f"forward+backward of a 512-1024-512 MLP, {args.reps} reps, medians:")
    print("| compute alone | send alone | both at once (wall) | compute beside the send | "
          "send beside the compute | compute slowed | overlap of the shorter |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {c:.3f} s | {s:.3f} s | {both:.3f} s | {cb:.3f} s | {sb:.3f} s | "
          f"x{cb / c:.2f} | {hidden:.2f} |")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
