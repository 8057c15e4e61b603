"""What a rejoin's integrity check adds to its transfer: the same tensors sent from one
rank to another (paddle_hsdp/ft/transfer.py's own send and receive, gloo, CPU), without
the check, with it as it was (each side an HMAC per tensor after the tensors moved)
and as it is now (the transfer's code: a large tensor hashed on a thread while the
next ones move, a run of small ones under one HMAC as they come).

    python tools/bench_transfer.py [--mib 0] [--reps 7]

The tensors are the demo's character LM's (tools/demo.py: its parameters and AdamW's
state after one step, what a rejoining group of one rank takes), and ``--mib`` more of
float32 in tensors of 16 MiB (a larger state, where the hash costs more). The check is
the one a job with ``PADDLE_HSDP_FT_SECRET`` makes (an HMAC-SHA256 per tensor). Runs the
three ways in turn, ``--reps`` times, and prints the receiver's seconds (from the start
until it holds every tensor, checked): the fastest, the 10th percentile and the
median of each way, and its ratios to the unchecked transfer (of the fastest runs, of
the 10th percentiles; and the median of each rep's ratio, the three ways of a rep run
back to back). This machine is shared and
noisy: read the ratios, not the seconds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("unchecked", "serial", "overlapped")
CHUNK_MIB = 16


def _tensors(mib: int) -> list:
    import numpy as np
    import paddle

    from demo import build_model
    from demo_ft import batch_loss
    from paddle_hsdp.ft import transfer
    paddle.seed(0)
    model = build_model()
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters())
    batch_loss(model, 0)
    opt.step()
    pairs, _ = transfer._flatten(opt.state_dict())
    tensors = [p for p in model.parameters()] + [t for _, t in pairs]
    rng = np.random.default_rng(0)
    per = CHUNK_MIB * 2 ** 20 // 4
    for _ in range(mib // CHUNK_MIB):
        tensors.append(paddle.to_tensor(rng.standard_normal(per, dtype=np.float32)))
    return tensors


def _per_tensor(store, number: int, tensors: list) -> list:
    """The check as it was before it overlapped the transfer: an HMAC per tensor."""
    from paddle_hsdp.ft import transfer
    return [store.signer.tensor_digest(transfer._bytes_of(t), (number, "model", i))
            for i, t in enumerate(tensors)]


def worker(out: str, mib: int, reps: int) -> None:
    import types

    import paddle
    import paddle.distributed as dist

    from demo import init_hsdp
    from paddle_hsdp.ft import transfer
    from paddle_hsdp.ft.trust import Signer

    init_hsdp(2, 1)
    rank = dist.get_rank()
    link = dist.new_group([0, 1])
    group = types.SimpleNamespace(virtual_rank=lambda replica: replica)
    store = types.SimpleNamespace(signer=Signer("a-bench-secret-of-32-characters-x"))
    tensors = _tensors(mib)
    if rank == 1:  # the receiver's own tensors, overwritten by each transfer
        tensors = [paddle.zeros(t.shape, t.dtype) for t in tensors]
    nbytes = sum(int(t.numel()) * t.element_size() for t in tensors)
    times = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES:
            check = transfer._Digests(store, rep, ("model",))
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "unchecked":
                for t in tensors:
                    transfer._move(link, t, 0, group)
            elif mode == "overlapped" and rank == 0:
                transfer._send_checked(link, tensors, 0, group, check, None)
            elif mode == "overlapped":
                _, bad, _ = transfer._take_checked(link, tensors, 0, group, check)
                assert not bad, bad
            else:  # as before: the tensors, then each side an HMAC per tensor in turn
                for t in tensors:
                    transfer._move(link, t, 0, group)
                filled = [t for t in tensors if int(t.numel())]
                if rank == 0:
                    sums = paddle.to_tensor(_per_tensor(store, rep, filled), dtype="int64")
                    transfer.comm.broadcast(sums, src=0, group=link)
                else:
                    sums = paddle.zeros([len(filled)], dtype="int64")
                    transfer.comm.broadcast(sums, src=0, group=link)
                    assert _per_tensor(store, rep, filled) == sums.numpy().tolist()
            times[mode].append(time.perf_counter() - t0)
    if rank == 1:
        with open(out, "w") as f:
            json.dump({"times": times, "bytes": nbytes, "tensors": len(tensors)}, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=0,
                        help=f"MiB of float32 added to the demo's state, in {CHUNK_MIB} MiB "
                             "tensors (0: the demo's state alone)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mib < 0 or args.reps < 1:
        parser.error(f"--mib must be >= 0 and --reps >= 1, got {args.mib} and {args.reps}")
    if args.worker:
        worker(args.out, args.mib, args.reps)
        return 0
    work = tempfile.mkdtemp(prefix="hsdp_bench_transfer_")
    out = os.path.join(work, "times.json")
    env = dict(os.environ, GLOG_minloglevel="2",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "paddle.distributed.launch",
                          "--nproc_per_node", "2", "--log_dir", os.path.join(work, "log"),
                          os.path.abspath(__file__), "--worker", "--out", out,
                          "--mib", str(args.mib), "--reps", str(args.reps)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         timeout=900)
    if run.returncode:
        raise SystemExit(f"bench_transfer: the run failed (exit code {run.returncode}); "
                         f"logs in {work}/log")
    with open(out) as f:
        got = json.load(f)
    times = got["times"]
    print(f"{got['tensors']} tensors, {got['bytes'] / 2 ** 20:.1f} MiB, {args.reps} reps "
          "(the receiver's seconds; ratios to the unchecked transfer: of the fastest runs, "
          "and the median of each rep's ratio, the three ways run back to back)")
    for mode in MODES:
        paired = statistics.median(t / u for t, u in zip(times[mode], times["unchecked"],
                                                        strict=True))
        tenth = statistics.quantiles(times[mode], n=10)[0] if len(times[mode]) > 1 else \
            times[mode][0]
        base = statistics.quantiles(times["unchecked"], n=10)[0] \
            if len(times["unchecked"]) > 1 else times["unchecked"][0]
        print(f"  {mode:10s} fastest {min(times[mode]) * 1000:7.1f} ms "
              f"x{min(times[mode]) / min(times['unchecked']):.3f}  10th percentile "
              f"{tenth * 1000:7.1f} ms x{tenth / base:.3f}  median "
              f"{statistics.median(times[mode]) * 1000:7.1f} ms  paired x{paired:.3f}")
    with open(os.path.join(work, "times.json")) as f:
        print(f"  (every rep's seconds: {f.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
