"""What fault tolerance costs in steady state: the same training, side by side, as plain
HSDP 2 x 2 (one launch of 4 ranks) and as two fault-tolerant replica groups of 2 ranks
(paddle_hsdp.ft: two launches and a coordinator), on the demo's character LM. No
fault happens; the difference is the attempt's extra one-element all-reduces (the
joiner check over the outer group, the replica's vote) and the watcher threads.

    python tools/bench_ft.py [--steps 40] [--rounds 2]

Runs plain, ft, plain, ft, ... (``--rounds`` each) and prints each run's median step
time (the first 5 steps left out) and the ratio ft / plain of the medians over the
runs. This machine is shared and noisy: read the ratio, not the seconds.
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
WARMUP = 5


def worker(mode: str, out: str, steps: int) -> None:
    import paddle.distributed as dist

    from demo import init_hsdp
    from demo_ft import batch_loss, sharded_model

    init_hsdp(4, 2) if mode == "plain" else init_hsdp(2, 1)
    replica = None
    if mode == "ft":
        from paddle_hsdp import ft
        replica = ft.init()
    model, opt = sharded_model()
    if replica is not None:
        replica.attach(model, opt)
    rank = dist.get_rank() + (2 * replica.replica_id if replica is not None else 0)

    def forward_backward(step):
        return batch_loss(model, [step, rank])

    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        if replica is not None:
            replica.train_step(lambda: forward_backward(step))
        else:
            forward_backward(step)
            opt.step()
            opt.clear_grad()
        times.append(time.perf_counter() - t0)
    if replica is not None:
        replica.finish()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def run(mode: str, steps: int, work: str) -> float:
    env = dict(os.environ, GLOG_minloglevel="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = os.path.join(work, f"{mode}_{time.time():.0f}.json")
    launch = [sys.executable, "-m", "paddle.distributed.launch"]
    me = [os.path.abspath(__file__), "--worker", mode, "--out", out, "--steps", str(steps)]
    procs, coordinator = [], None
    from demo_ft import _free_port
    if mode == "plain":
        procs.append(subprocess.Popen([*launch, "--nproc_per_node", "4", "--log_dir",
                                       os.path.join(work, "plain"), *me], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    else:
        port = _free_port()
        coordinator = subprocess.Popen([sys.executable, "-m", "paddle_hsdp.ft.coordinator",
                                        "--host", "127.0.0.1", "--port", str(port)], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env.update(PADDLE_HSDP_FT_COORDINATOR=f"127.0.0.1:{port}",
                   PADDLE_HSDP_FT_START_REPLICAS="2")
        for replica in (0, 1):
            procs.append(subprocess.Popen(
                [*launch, "--nproc_per_node", "2", "--log_dir",
                 os.path.join(work, f"ft{replica}"), *me],
                env=dict(env, PADDLE_HSDP_FT_REPLICA_ID=str(replica)),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if coordinator is not None:
            coordinator.terminate()
    if any(codes):
        raise SystemExit(f"bench_ft: the {mode} run failed (exit codes {codes}); logs in {work}")
    with open(out) as f:
        return statistics.median(json.load(f)[WARMUP:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=("plain", "ft"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.steps)
        return 0
    if args.steps <= WARMUP + 2:
        parser.error(f"--steps must be > {WARMUP + 2}")
    work = tempfile.mkdtemp(prefix="hsdp_bench_ft_")
    medians = {"plain": [], "ft": []}
    for _ in range(args.rounds):
        for mode in ("plain", "ft"):
            medians[mode].append(run(mode, args.steps, work))
            print(f"{mode:5s} median step {medians[mode][-1] * 1000:.1f} ms", flush=True)
    ratio = statistics.median(medians["ft"]) / statistics.median(medians["plain"])
    print(f"ft / plain step time: {ratio:.2f}x (medians over {args.rounds} runs each, "
          f"{args.steps - WARMUP} steps a run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
