"""Goodput at scale: the fraction of GPU-hours that train, restart against ft.

Three ways of surviving failures, costed from the project's measured figures and a
failure model (issue 63, item 5).

    python tools/sim_goodput.py [--gpus 1024 16384 100000] [--json]

Strategies, all on one job of N GPUs in R = N / G replica groups of G GPUs:

* ``restart``: restart from the last checkpoint only. Every failure stops all N GPUs:
  detection, the job's relaunch, the checkpoint's load, and the work since the last
  completed save is lost (Daly's model: a failure during the recovery restarts it).
* ``ft-rejoin``: paddle_hsdp.ft as built, HFSDP with ``--redundancy`` holders per
  optimizer piece. A failure costs every survivor a stall (detection, the round, the
  new outer groups' set-up, the failed attempt redone); the job trains on R - 1 groups
  while the dead group's G GPUs idle for ``--repair-min``; the replacement then rejoins
  (a round, a set-up and the transfer of a rank's state, which every group waits for).
  If every other holder of the dead group's piece also fails before it rejoins, the
  piece is lost (``PieceLostError``) and the job restarts from its checkpoint.
* ``ft-recut``: as ft-rejoin, but the pieces are re-cut among the survivors in the
  failure's round (not built: docs/fault-tolerance.md), so a piece is lost only if its
  other holders fail within that round, not within the repair time; the re-cut adds
  to the failure's stall the transfer of the dead group's piece to a survivor (optimizer
  state / (G x P) per rank at the link speed, P = R // redundancy pieces).

Every strategy runs the same layout, HFSDP in groups of G: a rank holds params / G and
optimizer state / (G x P) (a 70B model's state fits groups of 8 GPUs that way).

A restart (``restart``'s every failure, ft's lost piece) relaunches the job on spare
hosts in ``--relaunch-min``; ft's dead groups come back after ``--repair-min`` either
way, and the checkpoint's load gives every piece its full set of holders again.

Goodput counts a GPU as training only while its group is alive and not stalled, and
only for work that is kept (a restart's lost work is subtracted). Two estimates: an
analytic one (Daly's exact expected time for ``restart``; first order in the failure
rate for the ft strategies) and a seeded Monte Carlo of the same model (events one by
one: overlapping stalls, failures during a recovery, which piece each group holds),
printed side by side with their difference.

Inputs (each a flag; where each default comes from):

* ``--mtbf-gpu-h`` 50,677 GPU-hours: Llama 3's 405B run, 419 unexpected interruptions
  in 54 days on 16,384 GPUs ("The Llama 3 Herd of Models", Meta 2024),
  every cause counted against a GPU. Failures are independent, exponential.
* ``--detect-s`` 11 s: a dead or hung group heard by every other group, bounded by the
  lease TTL + 1 s (heartbeat timeout 10 s); measured 7.4-8.7 s (dead) and 10.0-11.0 s
  (hung) by ``tools/sim_ft.py`` at 16-512 groups (docs/fault-tolerance.md, "The control
  plane at scale", 2026-12-05).
* ``--round-s-per-group`` 0.33/128 s: the failure round measured by ``tools/sim_ft.py``
  at 128 groups (0.33 s, same section), extrapolated linearly in R (a round is about
  1.4 requests to etcd per group: 183 per round at 128 groups). Linear is the cautious
  reading: at 512 groups the simulator's own CPU made it 2.7 s (0.0053 s per group).
  The rejoin's round uses the same figure (measured 0.24 s at 128 groups).
* ``--setup-s`` 1.12 s: building a round's new outer group, measured 0.96-1.12 s on a
  bystander group (HFSDP scenario, docs/fault-tolerance.md, "What happens"; gloo, 4
  groups of one rank). Not extrapolated: NCCL communicators over thousands of ranks
  were never built here (the weakest input: raise it with the flag).
* ``--step-s`` 6 s (an assumption, not a measurement): the failed attempt's compute is
  redone, half a step on average. 6 s is a Llama-3-405B step (16 M tokens x 6 FLOPs
  per parameter per token at 400 TFLOPs per GPU on 16,384 GPUs, the Llama 3 report's
  figures).
* ``--params-gb`` 141.1 GB and ``--optim-gb`` 846.7 GB: the 988 GB of distinct state of
  the Llama-70B-shaped model of ``tools/sim_checkpoint.py``, 2 bytes of bf16 params and
  12 of fp32 master weights and AdamW moments per parameter.
* ``--link-gbit`` 400 Gbit/s per GPU (Llama 3's RoCE and InfiniBand fabrics): a
  rejoin's transfer is a rank's state (params / G + optimizer state / (G x P)) at this
  rate, each rank of the group in parallel. The project's measured transfers (1.0-1.26
  s on loopback, 0.61-0.75 s over 100 Mbit/s) moved the demo's tiny state and are
  latency-bound: they give no bandwidth, so the transfer is extrapolated from the link
  speed.
* ``--write-gb-s`` 0.127 GB/s per rank: ``tools/bench_save.py``'s sync save, 1.6 GiB
  over 4 CPU ranks in 3.35-3.39 s (docs/checkpoints.md, 2026-12-05); each distinct
  byte is written once, so a save is the whole state / N per rank x
  ``--writer-imbalance`` 1.113 (the slowest writer against the mean at 8,192 ranks,
  ``tools/sim_checkpoint.py``) at this rate, or state / ``--storage-gb-s`` 2,000 GB/s
  (Llama 3's Tectonic, 2 TB/s sustained), whichever is slower, plus ``--index-s`` 0.9 s (rank 0's check and
  index, 0.7-0.9 s for HSDP at 128-8,192 ranks, ``tools/sim_checkpoint.py``).
* ``--read-gb-s`` (default: the write rate; a load was not timed): a load reads each
  byte once (the outer replicas split the reading), then each rank receives the rest
  of its state from its readers over the outer group (at the link speed).
* ``--relaunch-min`` 10 min and ``--repair-min`` 10 min (not measured here): Meta's
  published recovery stall of fully synchronous training at O(100k) GPUs (Salpekar et
  al., "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", arXiv 2602.00277)
  for the job's relaunch; the same for a group's replacement (a spare host and the
  group's start, as in a relaunch).
* ``--ft-stall-s`` (none): replaces ft's whole stall per failure (the failure's and the
  rejoin's, split in the model's proportions), e.g. Meta's measured 3 min.
* ``--ckpt-interval-min`` 30 min (an assumption): the time trained between saves, for
  every strategy; ``restart`` is also given at Young/Daly's optimum
  sqrt(2 x MTBF_job x save).

With ``--json`` the last line is one JSON object: the inputs and every row.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass

STRATEGIES = ("restart", "ft-rejoin", "ft-recut")

# Llama 3 405B ("The Llama 3 Herd of Models", Meta 2024): 419 unexpected interruptions in
# 54 days on 16,384 GPUs
LLAMA3_MTBF_GPU_H = 54 * 24 * 16384 / 419


@dataclass
class Costs:
    """Seconds for one job size (``derive``): what every input turns into at N GPUs."""
    gpus: int
    groups: int
    pieces: int          # HFSDP pieces of the optimizer state, P = R // redundancy
    mtbf_job_s: float
    detect_s: float
    round_s: float
    setup_s: float
    transfer_s: float    # a rank's state at the link speed (a rejoin)
    recut_s: float       # a rank's optimizer piece at the link speed (a re-cut)
    save_s: float
    load_s: float
    restart_s: float     # detection + relaunch + load: what a restart stops N GPUs for
    fail_stall_s: float  # what every survivor waits at a failure (ft)
    rejoin_stall_s: float  # what every group waits at a rejoin (ft)
    repair_s: float
    step_s: float


def derive(args, gpus: int) -> Costs:
    g = args.group_gpus
    groups = gpus // g
    pieces = max(1, groups // args.redundancy)
    state = args.params_gb + args.optim_gb  # GB, each byte saved once
    piece = args.optim_gb / pieces / g      # GB of optimizer state a rank holds (HFSDP)
    per_rank = args.params_gb / g + piece   # GB a rank holds: what a rejoin sends it
    link = args.link_gbit / 8     # GB/s
    read = args.read_gb_s or args.write_gb_s
    save = max(state / gpus * args.writer_imbalance / args.write_gb_s,
               state / args.storage_gb_s) + args.index_s
    load = max(state / gpus / read, state / args.storage_gb_s) + per_rank / link
    round_s = args.round_s_per_group * groups
    transfer = per_rank / link
    fail = args.detect_s + round_s + args.setup_s + args.step_s / 2
    rejoin = round_s + args.setup_s + transfer
    if args.ft_stall_s is not None:  # a measured stall per failure given whole: split as ours
        share = args.ft_stall_s / (fail + rejoin)
        fail, rejoin = fail * share, rejoin * share
    return Costs(gpus=gpus, groups=groups, pieces=pieces,
                 mtbf_job_s=args.mtbf_gpu_h * 3600 / gpus, detect_s=args.detect_s,
                 round_s=round_s, setup_s=args.setup_s, transfer_s=transfer,
                 recut_s=piece / link, save_s=save, load_s=load,
                 restart_s=args.detect_s + args.relaunch_min * 60 + load,
                 fail_stall_s=fail, rejoin_stall_s=rejoin, repair_s=args.repair_min * 60,
                 step_s=args.step_s)


def holders(c: Costs) -> list[int]:
    """How many groups hold each piece (group r holds piece r % P)."""
    return [c.groups // c.pieces + (1 if k < c.groups % c.pieces else 0)
            for k in range(c.pieces)]


def window_s(c: Costs, strategy: str) -> float:
    """How long a dead group's piece stays one holder short: until its rejoin, or until
    the re-cut at the end of the failure's round."""
    return c.fail_stall_s + c.recut_s if strategy == "ft-recut" else c.repair_s


def piece_loss(c: Costs, strategy: str) -> float:
    """Probability that a group's failure loses its piece: every other holder is one
    short at that moment (each is, independently, with probability 1 - exp(-rate x
    window)), averaged over the groups."""
    rate = 1 / (c.mtbf_job_s * c.groups)  # one group's failure rate
    p = 1 - math.exp(-rate * window_s(c, strategy))
    return sum(h * p ** (h - 1) for h in holders(c)) / c.groups


def young_daly_s(c: Costs) -> float:
    return math.sqrt(2 * c.mtbf_job_s * c.save_s)


def lost_work_s(tau: float, save: float) -> float:
    """Expected training seconds lost at a restart, the failure uniform over a cycle of
    ``tau`` training then ``save`` saving (a save still running does not count)."""
    return tau * (tau / 2 + save) / (tau + save)


def analytic(c: Costs, strategy: str, tau: float) -> float:
    """Expected goodput. ``restart``: Daly's expected time to finish a cycle of tau + save
    when a failure (rate 1/MTBF_job) restarts it after a recovery that may fail too.
    ft: the failure-free fraction tau / (tau + save), less each failure's GPU-seconds
    (first order in the failure rate: stalls and repairs assumed not to overlap)."""
    lam, cycle = 1 / c.mtbf_job_s, tau + c.save_s
    if strategy == "restart":
        return tau / (math.exp(lam * c.restart_s) / lam * math.expm1(lam * cycle))
    base = tau / cycle
    n, g = c.gpus, c.gpus / c.groups
    # lam x repair groups are dead at a time (Little's law): they neither fail nor stall
    live = n * (1 - lam * c.repair_s / c.groups)
    lam *= live / n
    stall = c.fail_stall_s + (c.recut_s if strategy == "ft-recut" else 0.0)
    per_failure = ((live - g) * stall + g * c.repair_s + live * c.rejoin_stall_s) / n * base
    per_restart = c.restart_s * base + lost_work_s(tau, c.save_s)
    return base - lam * per_failure - lam * piece_loss(c, strategy) * per_restart


class Job:
    """One Monte Carlo run of the model: events in time order, training GPU-seconds
    integrated between them (rates are constant between events)."""

    def __init__(self, c: Costs, strategy: str, tau: float, rng: random.Random):
        self.c, self.strategy, self.tau, self.rng = c, strategy, tau, rng
        self.g = c.gpus // c.groups
        self.piece_holders = holders(c)
        self.t = 0.0
        self.work = 0.0       # GPU-seconds trained and not (yet) lost
        self.committed = 0.0  # work in the last completed save
        self.pending = None   # (completion time, work at its start) of a save under way
        self.restarts = self.failures = 0
        self.dead: set[int] = set()  # groups waiting for their repair
        self._restart_at(0.0, 0.0)

    def _restart_at(self, t: float, recovery: float) -> None:
        self.anchor = t + recovery  # the save cycle starts when the job trains again
        self.stall_until = self.anchor
        # the checkpoint's load cuts the pieces anew over the live groups: none is short
        self.short: dict[int, list[float]] = {}  # piece -> when each missing holder is back
        self.pending = None

    def _trained(self, t: float) -> float:
        """Training seconds (one GPU) from the anchor to t: cycles of tau then save."""
        if t <= self.anchor:
            return 0.0
        cycle = self.tau + self.c.save_s
        k, rem = divmod(t - self.anchor, cycle)
        return k * self.tau + min(rem, self.tau)

    def _work_between(self, a: float, b: float) -> float:
        a = min(max(a, self.stall_until), b)
        return (self.c.groups - len(self.dead)) * self.g * (self._trained(b) - self._trained(a))

    def advance(self, b: float) -> None:
        """Integrate the training to time b, and the saves that start or end on the way."""
        a, cycle = self.t, self.tau + self.c.save_s
        if self.pending and self.pending[0] <= b:
            self.committed, self.pending = self.pending[1], None
        last = math.floor((b - self.anchor - self.tau) / cycle)  # the last save starting <= b
        for k in (last - 1, last):  # the one before it has ended by b; it may not have
            start = self.anchor + k * cycle + self.tau
            if k < 0 or start <= a:
                continue
            done, work = start + self.c.save_s, self.work + self._work_between(a, start)
            if done <= b:
                self.committed, self.pending = work, None
            else:
                self.pending = (done, work)
        self.work += self._work_between(a, b)
        self.t = b

    def restart(self) -> None:
        """Every live group stops and loads the last checkpoint; ``restart``'s relaunch
        finds spare hosts, ft's dead groups come back after their repair as before."""
        self.restarts += 1
        self.work = self.committed  # the work since the last completed save is lost
        self._restart_at(self.t, self.c.restart_s)  # a failure in a recovery restarts it

    def fail(self, group: int, events: list) -> None:
        self.failures += 1
        if self.strategy == "restart":
            return self.restart()
        piece = group % self.c.pieces
        short = [x for x in self.short.get(piece, ()) if x > self.t]
        self.dead.add(group)
        heapq.heappush(events, (self.t + self.c.repair_s, group))
        if len(short) + 1 >= self.piece_holders[piece]:
            return self.restart()  # PieceLostError: no holder of the piece is left
        self.short[piece] = short + [self.t + window_s(self.c, self.strategy)]
        stall = self.c.fail_stall_s + (self.c.recut_s if self.strategy == "ft-recut" else 0)
        self.stall_until = max(self.stall_until, self.t) + stall

    def rejoin(self, group: int) -> None:
        self.dead.discard(group)
        if self.t >= self.anchor:  # (during a restart's relaunch it joins that instead)
            self.stall_until = max(self.stall_until, self.t) + self.c.rejoin_stall_s

    def run(self, horizon: float) -> float:
        rate = 1 / (self.c.mtbf_job_s * self.c.groups)  # one live group's failure rate
        events: list = []  # rejoins: (time, group)
        while True:
            live = self.c.groups - len(self.dead)
            # memoryless: redrawn at every event; none while every group is dead (a
            # restart that lost the last holders waits for their repair)
            next_failure = self.t + self.rng.expovariate(live * rate) if live else math.inf
            if events and events[0][0] < min(next_failure, horizon):
                when, group = heapq.heappop(events)
                self.advance(when)
                self.rejoin(group)
                continue
            if next_failure >= horizon:
                self.advance(horizon)
                return self.work / (self.c.gpus * horizon)
            self.advance(next_failure)
            group = self.rng.randrange(self.c.groups)
            while group in self.dead:  # a live group fails (few are dead at a time)
                group = self.rng.randrange(self.c.groups)
            self.fail(group, events)


def monte_carlo(c: Costs, strategy: str, tau: float, trials: int, failures: int,
                seed: int, deadline: float) -> tuple[float, float, int]:
    """Mean goodput over ``trials`` seeded runs of ``failures / trials`` job MTBFs each,
    its standard error, and the trials run (fewer once ``deadline`` passes)."""
    horizon = max(1, failures // trials) * c.mtbf_job_s
    results = []
    for trial in range(trials):
        if results and time.monotonic() > deadline:
            break
        key = f"{seed}/{c.gpus}/{strategy}/{trial}"  # one stream per row and trial
        results.append(Job(c, strategy, tau, random.Random(key)).run(horizon))
    mean = sum(results) / len(results)
    var = sum((x - mean) ** 2 for x in results) / max(1, len(results) - 1)
    return mean, math.sqrt(var / len(results)), len(results)


def rows(args) -> list[dict]:
    deadline = time.monotonic() + args.mc_seconds
    out = []
    for gpus in args.gpus:
        c = derive(args, gpus)
        runs = [(s, args.ckpt_interval_min * 60) for s in STRATEGIES]
        runs.append(("restart@daly", young_daly_s(c)))
        for name, tau in runs:
            strategy = name.split("@")[0]
            goodput = analytic(c, strategy, tau)
            mc, se, trials = monte_carlo(c, strategy, tau, args.trials, args.mc_failures,
                                         args.seed, deadline)
            stall = c.restart_s if strategy == "restart" else \
                c.fail_stall_s + c.rejoin_stall_s + (c.recut_s if strategy == "ft-recut" else 0)
            out.append({"gpus": gpus, "strategy": name, "interval_min": tau / 60,
                        "mtbf_job_h": c.mtbf_job_s / 3600, "stall_per_failure_min": stall / 60,
                        "restarts_per_failure": 1.0 if strategy == "restart"
                        else piece_loss(c, strategy),
                        "analytic": goodput, "monte_carlo": mc, "mc_stderr": se,
                        "mc_trials": trials, "difference": goodput - mc,
                        "costs": asdict(c)})
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 16384, 100000])
    p.add_argument("--group-gpus", type=int, default=8, help="GPUs per replica group (G)")
    p.add_argument("--redundancy", type=int, default=2,
                   help="HFSDP holders per optimizer piece (PADDLE_HSDP_FT_REDUNDANCY)")
    p.add_argument("--mtbf-gpu-h", type=float, default=round(LLAMA3_MTBF_GPU_H),
                   help="mean time between failures of one GPU, hours (Llama 3's)")
    p.add_argument("--repair-min", type=float, default=10.0,
                   help="from a group's failure to its replacement's rejoin, minutes")
    p.add_argument("--relaunch-min", type=float, default=10.0,
                   help="a whole job's relaunch after a failure, minutes (Meta's stall)")
    p.add_argument("--detect-s", type=float, default=11.0,
                   help="a failure heard by every group (lease TTL + 1), s")
    p.add_argument("--round-s-per-group", type=float, default=0.33 / 128,
                   help="a round's seconds per replica group (sim_ft: 0.33 s at 128)")
    p.add_argument("--setup-s", type=float, default=1.12,
                   help="a round's new outer groups, s (measured on gloo, 4 groups)")
    p.add_argument("--step-s", type=float, default=6.0,
                   help="one training step, s (assumed; half of one is redone)")
    p.add_argument("--ft-stall-s", type=float, default=None,
                   help="replace the ft stall per failure (failure + rejoin) with this, s")
    p.add_argument("--params-gb", type=float, default=141.1,
                   help="the model's bf16 params, GB (sim_checkpoint's 70B)")
    p.add_argument("--optim-gb", type=float, default=846.7,
                   help="its fp32 master weights and AdamW moments, GB")
    p.add_argument("--link-gbit", type=float, default=400.0, help="per GPU, Gbit/s")
    p.add_argument("--write-gb-s", type=float, default=0.127,
                   help="checkpoint write rate per rank, GB/s (bench_save)")
    p.add_argument("--read-gb-s", type=float, default=0.0,
                   help="checkpoint read rate per rank, GB/s (0: the write rate)")
    p.add_argument("--storage-gb-s", type=float, default=2000.0,
                   help="the file system's aggregate rate, GB/s (Llama 3's Tectonic)")
    p.add_argument("--writer-imbalance", type=float, default=1.113,
                   help="slowest writer / mean (sim_checkpoint at 8,192 ranks)")
    p.add_argument("--index-s", type=float, default=0.9,
                   help="rank 0's check and index of a save, s (sim_checkpoint)")
    p.add_argument("--ckpt-interval-min", type=float, default=30.0,
                   help="training minutes between checkpoint saves")
    p.add_argument("--trials", type=int, default=8, help="Monte Carlo runs per row")
    p.add_argument("--mc-failures", type=int, default=20000,
                   help="job MTBFs simulated per row, over all its trials")
    p.add_argument("--mc-seconds", type=float, default=120.0,
                   help="stop starting trials after this (every row keeps at least one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last line: inputs and rows as JSON")
    return p


def check(p: argparse.ArgumentParser, args) -> None:
    for gpus in args.gpus:
        if gpus % args.group_gpus or gpus // args.group_gpus < 2:
            p.error(f"--gpus {gpus} is not a multiple of --group-gpus {args.group_gpus} "
                    f"with at least 2 groups")
    if args.redundancy < 2:
        p.error("--redundancy must be >= 2 (ft refuses HFSDP without redundancy)")
    if min(args.mtbf_gpu_h, args.ckpt_interval_min, args.trials, args.mc_failures) <= 0:
        p.error("--mtbf-gpu-h, --ckpt-interval-min, --trials, --mc-failures must be > 0")


def table(result: list[dict]) -> str:
    head = ("| GPUs | job MTBF | strategy | save every | stall per failure | restarts per "
            "failure | goodput, analytic | Monte Carlo (+- se) | difference |")
    lines = [head, "|" + "---|" * 9]
    for r in result:
        lines.append(
            f"| {r['gpus']:,} | {r['mtbf_job_h']:.2f} h | {r['strategy']} | "
            f"{r['interval_min']:.1f} min | {r['stall_per_failure_min']:.2f} min | "
            f"{r['restarts_per_failure']:.2g} | {r['analytic']:.4f} | "
            f"{r['monte_carlo']:.4f} +- {r['mc_stderr']:.4f} | {r['difference']:+.4f} |")
    return "\n".join(lines)


def costs_table(result: list[dict]) -> str:
    names = ["groups", "round_s", "setup_s", "transfer_s", "save_s", "load_s", "restart_s",
             "fail_stall_s", "rejoin_stall_s", "repair_s"]
    seen = {r["gpus"]: r["costs"] for r in result}
    lines = ["| GPUs | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for gpus, c in seen.items():
        lines.append(f"| {gpus:,} | " + " | ".join(
            f"{c[n]:,}" if isinstance(c[n], int) else f"{c[n]:.2f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    t0 = time.monotonic()
    result = rows(args)
    print(costs_table(result))
    print()
    print(table(result))
    trials = min(r["mc_trials"] for r in result)
    print(f"\n(Monte Carlo: {args.mc_failures} job MTBFs per row over {trials}-{args.trials} "
          f"seeded trials, seed {args.seed}; {time.monotonic() - t0:.1f} s)")
    if args.json:
        print(json.dumps({"inputs": vars(args), "rows": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
