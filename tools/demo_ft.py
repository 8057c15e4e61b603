"""paddle_hsdp.ft demo: three replica groups of 2 CPU ranks train the demo's character LM;
one group is killed (every process, SIGKILL) mid-run and started again a few seconds
later; the others keep going and the restarted group rejoins from a healthy one.

Run ``bash tools/demo_ft.sh`` (``--steps``, ``--kill-at``, ``--restart-after``); it
starts the coordinator and the launches, and prints one line per step from replica 0:
step, loss, the live replica groups. Each group trains on its own rows of the text
(chosen from the step and its id, so a redone step sees the same rows). The run ends
with what the fault cost: the stall from the kill to the next step and the rejoin.

``--compare`` runs the scenario twice, one run after the other: first with the
rejoin's state copied in the round's set-up, as before 2026-12-07 (the workers make
``ft.handoff.sits_out`` name no one), then as built (the joiner sits the round's step
out, its state handed over beside it), and prints what the rejoin cost the healthy
groups in each, side by side.
"""

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RANKS = 2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--replicas", type=int, default=3, help="replica groups (>= 2)")
    parser.add_argument("--kill-at", type=int, default=10,
                        help="kill the last group once replica 0 has finished this step")
    parser.add_argument("--restart-after", type=float, default=3.0,
                        help="seconds between the kill and the restart")
    parser.add_argument("--compare", action="store_true",
                        help="run twice: the rejoin's state in the set-up, then beside "
                             "the step (issue 63 item 4), and compare")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replicas < 2:
        parser.error(f"--replicas must be >= 2 (one is killed), got {args.replicas}")
    if not 0 < args.kill_at < args.steps:
        parser.error(f"--kill-at must be in 1..{args.steps - 1} (--steps {args.steps}), "
                     f"got {args.kill_at}")
    return args


# ---------------------------------------------------------------- one replica group's rank
def sharded_model():
    """The demo's character LM, one unit per block and the root, and its optimizer
    (the same on every rank: seeded). Also tools/bench_ft.py's."""
    import paddle
    import paddle_hsdp
    from demo import build_model
    paddle.seed(0)
    model = build_model()
    for block in model.blocks:
        paddle_hsdp.fully_shard(block)
    paddle_hsdp.fully_shard(model)
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters(),
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    return model, opt


def batch_loss(model, seed, seq: int = 64, batch: int = 8, probe: dict | None = None):
    """Forward and backward on ``batch`` rows of the demo's text, chosen by ``seed`` (a
    step's rows, so a redone step trains on the same ones); returns the loss. ``probe``
    gets the forward's seconds."""
    import numpy as np
    import paddle
    import paddle.nn.functional as F
    data = _text()
    starts = np.random.default_rng(seed).integers(0, len(data) - seq - 1, size=batch)
    began = time.perf_counter()
    ids = paddle.to_tensor(np.stack([data[s:s + seq + 1] for s in starts]))
    loss = F.cross_entropy(model(ids[:, :-1]).reshape([-1, 256]), ids[:, 1:].reshape([-1, 1]))
    if probe is not None:
        probe["forward_s"] = time.perf_counter() - began
    loss.backward()
    return loss


def _time_order_agreement(probes: list[dict]) -> None:
    """The seconds a backward spends agreeing its outer syncs' order (the broadcasts
    of a backward that records it, after a round that changed who trains) go into the
    last probe: the first collective a healthy group shares with a joiner there."""
    from paddle_hsdp.engine import outer_sync
    agreed = outer_sync.agreed_order

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return agreed(*args, **kwargs)
        finally:
            if probes:
                probes[-1]["agreeing_s"] += time.perf_counter() - began
    outer_sync.agreed_order = timed


@functools.lru_cache(maxsize=1)
def _text():
    from demo import corpus
    return corpus()  # read once per process


def worker(args) -> None:
    import paddle.distributed as dist

    from paddle_hsdp import ft
    from demo import init_hsdp

    init_hsdp(RANKS, 1)
    if os.environ.get("DEMO_FT_STATE_IN_SET_UP"):  # --compare's first run: as before
        from paddle_hsdp.ft import handoff
        handoff.sits_out = lambda *args, **kwargs: []
    replica = ft.init()
    rank = dist.get_rank()
    model, opt = sharded_model()
    replica.attach(model, opt)

    probes: list[dict] = []  # this train_step's forward_backward calls, timed
    _time_order_agreement(probes)

    def forward_backward():
        probes.append({"began": time.time(), "agreeing_s": 0.0})
        began = time.perf_counter()
        loss = batch_loss(model, [replica.step, replica.replica_id, rank], probe=probes[-1])
        probes[-1]["forward_backward_s"] = time.perf_counter() - began
        return loss

    progress = os.path.join(args.worker, f"progress{replica.replica_id}")
    while replica.step < args.steps:
        t0, logged = time.perf_counter(), len(replica.history)
        probes.clear()
        loss = float(replica.train_step(forward_backward))
        line = {"step": replica.step, "loss": loss, "replicas": replica.live_replicas,
                "seconds": time.perf_counter() - t0, "time": time.time(),
                "history": replica.history[-1], "attempts": replica.history[logged:],
                "calls": list(probes)}
        # every rank's phases; rank 0's line is also the progress the driver reads
        with open(f"{progress}.rank{rank}" if rank else progress, "a") as f:
            f.write(json.dumps(line) + "\n")
    replica.finish()


# ---------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (the launcher puts each rank in a
    process group of its own, so killing its group alone would leave the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    for victim in tree:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def worker_command(work: str, steps: int) -> list[str]:
    """What each rank of a replica group runs (under a launcher)."""
    return [os.path.abspath(__file__), "--worker", work, "--steps", str(steps)]


def driver(args) -> int:
    """One host: the coordinator and every replica group on this machine (twice with
    ``--compare``: the state in the set-up, then beside the step)."""
    if not args.compare:
        return run_once(args, {})
    costs = {}
    for mode, env in (("in the set-up", {"DEMO_FT_STATE_IN_SET_UP": "1"}),
                      ("beside the step", {})):
        print(f"=== the rejoin's state {mode}", flush=True)
        costs[mode] = {}
        if run_once(args, env, costs[mode]):
            return 1
    print_comparison(costs)
    return 0


def run_once(args, extra_env: dict, costs: dict | None = None) -> int:
    """One run of the scenario (``extra_env`` for every process); what the rejoin
    cost goes into ``costs``."""
    import tempfile
    work = tempfile.mkdtemp(prefix="hsdp_demo_ft_")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               GLOG_minloglevel="2", **extra_env)
    port = _free_port()

    def group_command(replica: int, log_dir: str) -> list[str]:
        return [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node",
                str(RANKS), "--log_dir", log_dir, *worker_command(work, args.steps)]

    return run_scenario(
        args, work, env,
        [sys.executable, "-m", "paddle_hsdp.ft.coordinator", "--host", "127.0.0.1",
         "--port", str(port)], f"127.0.0.1:{port}", group_command,
        lambda replica, proc: _kill_tree(proc.pid), costs)


def run_scenario(args, work: str, env: dict, coordinator_command: list[str], address: str,
                 group_command, kill_group, costs: dict | None = None) -> int:
    """Start the coordinator and ``args.replicas`` groups (``group_command(replica,
    log_dir)``), show replica 0's steps, kill the last group (``kill_group(replica,
    proc)``) once replica 0 has finished ``args.kill_at`` steps, start it again
    ``args.restart_after`` s later, and report the stall and the rejoin. Returns 0 if
    every group ended well."""
    coordinator = subprocess.Popen(coordinator_command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=open(os.path.join(work, "coordinator.err"), "w"))
    env = dict(env, PADDLE_HSDP_FT_COORDINATOR=address,
               PADDLE_HSDP_FT_START_REPLICAS=str(args.replicas))
    print(f"coordinator on {address}; {args.replicas} replica groups of {RANKS} CPU "
          f"ranks (logs in {work})", flush=True)

    def start(replica: int, name: str) -> subprocess.Popen:
        return subprocess.Popen(
            group_command(replica, os.path.join(work, name)),
            env=dict(env, PADDLE_HSDP_FT_REPLICA_ID=str(replica)), cwd=work,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def show(lines):
        for line in lines:
            print(f"step {line['step']:3d}  loss {line['loss']:.3f}  replicas "
                  f"{line['replicas']}  ({line['seconds']:.2f} s)", flush=True)

    groups = {r: start(r, f"replica{r}") for r in range(args.replicas)}
    victim, shown, killed_at, restarted = args.replicas - 1, 0, None, False
    progress = os.path.join(work, "progress0")
    deadline = time.time() + 600
    try:
        while groups[0].poll() is None and time.time() < deadline:
            lines = _lines(progress)
            show(lines[shown:])
            shown = len(lines)
            if killed_at is None and shown >= args.kill_at:
                kill_group(victim, groups[victim])
                killed_at = time.time()
                print(f"--- killed replica group {victim} (every process, SIGKILL)", flush=True)
            if killed_at and not restarted and time.time() - killed_at > args.restart_after:
                groups[victim] = start(victim, f"replica{victim}_again")
                restarted = True
                print(f"--- started replica group {victim} again", flush=True)
            time.sleep(0.1)
        for proc in groups.values():
            proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        for replica, proc in groups.items():
            if proc.poll() is None:
                kill_group(replica, proc)
        coordinator.terminate()
    lines = _lines(progress)
    show(lines[shown:])
    codes = {r: p.returncode for r, p in groups.items()}
    # (replica 0 may have sat steps out: left out of a round on a loaded machine)
    if any(codes.values()) or not lines or lines[-1]["step"] < args.steps:
        print(f"failed: exit codes {codes}; logs in {work}")
        return 1
    after = next(line for line in lines if line["time"] > killed_at)
    joined = next((line for line in lines if victim in line["replicas"]
                   and line["time"] > killed_at), None)
    print(f"loss {lines[0]['loss']:.3f} -> {lines[-1]['loss']:.3f} in {args.steps} steps; "
          f"from the kill to the next step {after['time'] - killed_at:.1f} s; " +
          (f"replica group {victim} back at step {joined['step']} (state copied in "
           f"{joined['history'].get('set_up_s', 0):.2f} s)" if joined else
           f"replica group {victim} did not rejoin before the end"), flush=True)
    if joined and args.replicas > 2:  # group 1 neither sends (0 does) nor takes state
        for group, role in ((0, "the donor"), (1, "neither donor nor receiver")):
            cost = rejoin_cost(_lines(os.path.join(work, f"progress{group}")), victim)
            cost["creation"] = round_creation(work, cost["round_number"])
            print(f"the rejoin cost replica group {group} ({role}) a step of "
                  f"{cost['at']:.2f} s against its median {cost['median']:.2f} s (its "
                  f"round {cost['round']:.2f} s, set-up {cost['set_up']:.2f} s; the round's "
                  f"group creation {cost['creation']:.2f} s on its slowest rank), the next "
                  f"{cost['next']:.2f} s; {cost['mib']:.2f} MiB per rank", flush=True)
            if costs is not None:
                costs[group] = cost
    return 0


def rejoin_cost(lines: list[dict], victim: int) -> dict:
    """A healthy group's steps at the rejoin (the last round that takes ``victim`` in
    and commits) and the next, beside its median step outside
    rounds, its round and set-up, and the state each rank sent (MiB)."""
    at = max(i for i, line in enumerate(lines) if "round_s" in line["history"]
             and victim in line["history"].get("receivers", ()))  # (not the first round's)
    history = lines[at]["history"]
    plain = sorted(line["seconds"] for line in lines if "round_s" not in line["history"])
    sent = history.get("snapshot_bytes", history.get("state_bytes", 0))
    return {"step": lines[at]["step"], "round_number": history["round"],
            "at": lines[at]["seconds"],
            "next": lines[at + 1]["seconds"] if at + 1 < len(lines) else float("nan"),
            "median": plain[len(plain) // 2], "round": history.get("round_s", 0.0),
            "set_up": history.get("set_up_s", 0.0), "mib": sent / 2 ** 20}


def round_creation(work: str, round_number: int) -> float:
    """Round ``round_number``'s outer-group creation on its slowest rank, over every
    group's ranks (the step's first collective waits for the last): the most
    ``creation_s`` any rank's attempt at that round logged (0 if none did)."""
    import glob
    seconds = [entry.get("creation_s", 0.0)
               for path in glob.glob(os.path.join(work, "progress*"))
               for line in _lines(path) for entry in line.get("attempts", [line["history"]])
               if entry.get("round") == round_number]
    return max(seconds, default=0.0)


def print_comparison(costs: dict) -> None:
    """The two runs' rejoin costs, side by side (seconds; ratios to the median), and
    the rejoin step's excess over its median, its round and the round's group creation
    (issue 63 item 4 asks for none beyond the creation)."""
    print("| replica group | the state | step at the rejoin | the next | median | round | "
          "set-up | group creation (slowest rank) | excess over median + round + "
          "creation | MiB per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for group in (0, 1):
        for mode, cost in costs.items():
            c = cost.get(group)
            if c is None:
                continue
            excess = c["at"] - c["median"] - c["round"] - c["creation"]
            print(f"| {group} | {mode} | {c['at']:.2f} s (x{c['at'] / c['median']:.1f}) | "
                  f"{c['next']:.2f} s (x{c['next'] / c['median']:.1f}) | {c['median']:.2f} s "
                  f"| {c['round']:.2f} s | {c['set_up']:.2f} s | {c['creation']:.2f} s | "
                  f"{excess:+.2f} s (x{excess / c['median']:+.1f}) | {c['mib']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        worker(parsed)
    else:
        sys.exit(driver(parsed))
