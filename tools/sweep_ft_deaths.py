"""Deaths during a fault-tolerant round's set-up, swept: who dies (the donor, another
member, the joiner) and where (d seconds into the creation of the round's outer
groups, or at the n-th state tensor of the transfer).

Each run: three replica groups of 2 CPU ranks (HSDP) train the test's MLP; replica 2
is killed at step 3 and started again after step 5; before step 7 the others wait
for it, so step 7's round takes it in: new outer groups over [0, 1, 2] and replica 0
(the donor) copies the state to it. The victim dies there. A run passes when every
group that should live exits 0 and every live group's losses and parameters equal
the single-process reference fed the live groups' batches (workers/single_process_ft.py).

    python tools/sweep_ft_deaths.py                       # the whole sweep (~10 min)
    python tools/sweep_ft_deaths.py --victims donor --points connect:0.05 --repeat 10

Prints one line per run and a table; ``--json PATH`` writes the runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test_collective"))

from launcher import run_single  # noqa: E402
from test_fault_tolerance import FaultTolerantJob  # noqa: E402

STEPS = 10
KILL_AT, RESTART_AFTER, JOIN_AT = 3, 5, 7
POINTS = ("connect:0", "connect:0.05", "connect:0.2", "transfer:1", "transfer:4")
VICTIMS = ("donor", "member", "joiner")


def _death_env(point: str, armed_at: int) -> dict:
    where, _, value = point.partition(":")
    if where == "connect":
        return {"FT_TEST_DIE_IN_CONNECT": f"{value}@{armed_at}"}
    if where == "transfer":
        return {"FT_TEST_DIE_IN_TRANSFER": f"{value}@{armed_at}"}
    raise SystemExit(f"--points: {point!r} is not connect:<seconds> or transfer:<n>")


def run_once(victim: str, point: str, bound_s: float = 240) -> dict:
    job = FaultTolerantJob(replicas=3, steps=STEPS)
    waits = f"2@{JOIN_AT}"
    member_death = _death_env(point, JOIN_AT - 1)  # the members' step-7 round
    env = {r: {"FT_TEST_WAIT_JOIN": waits} for r in (0, 1)}
    if victim in ("donor", "member"):
        env[0 if victim == "donor" else 1].update(member_death)
    started, outcome = time.time(), {"victim": victim, "point": point}
    try:
        procs = {r: job.start(r, f"replica{r}", **env[r]) for r in (0, 1)}
        doomed = job.start(2, "replica2", FT_TEST_KILL_AT=str(KILL_AT))
        deadline = started + bound_s
        while doomed.poll() is None or min(job.steps_done(0), job.steps_done(1)) < RESTART_AFTER:
            if time.time() > deadline:
                raise TimeoutError("the first phase did not end")
            time.sleep(0.2)
        procs[2] = job.start(2, "replica2_again",
                             **(_death_env(point, 0) if victim == "joiner" else {}))
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.2)
        codes = {r: p.poll() for r, p in procs.items()}
        dead = {"donor": 0, "member": 1, "joiner": 2}[victim]
        survivors_ok = all(code == 0 for r, code in codes.items() if r != dead)
        outcome.update(exit_codes=codes, survivors_ok=survivors_ok,
                       victim_died=codes[dead] not in (0, None))
        if not survivors_ok:
            outcome["logs"] = job.logs()[-4000:]
    except Exception as e:  # noqa: BLE001 - a run that went wrong is a result
        outcome.update(survivors_ok=False, error=f"{type(e).__name__}: {e}",
                       logs=job.logs()[-4000:])
    finally:
        job.stop()
    outcome["work"] = job.work
    outcome["slowest"] = _slowest_attempts(job.work)
    if outcome.get("survivors_ok"):
        try:
            out = run_single("single_process_ft.py", job.work, str(STEPS))
            outcome["parity_ok"] = "FT_PARITY_OK" in out
            outcome["members"] = json.loads(out.split("MEMBERS ", 1)[1].splitlines()[0])
        except Exception as e:  # noqa: BLE001
            outcome.update(parity_ok=False, error=str(e)[-2000:])
    outcome["seconds"] = round(time.time() - started, 1)
    return outcome


def _slowest_attempts(work: str, top: int = 3) -> list:
    """The longest attempts any surviving rank recorded: (replica, kind, step, seconds,
    error): where a run's time went."""
    entries = []
    for path in glob.glob(os.path.join(work, "replica*_rank*.json")):
        with open(path) as f:
            run = json.load(f)
        entries += [(run["replica"], e["kind"], e["step"], round(e["seconds"], 1),
                     e.get("error", "")[:160]) for e in run["history"]]
    return sorted(entries, key=lambda e: -e[3])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--victims", nargs="+", default=list(VICTIMS), choices=VICTIMS)
    parser.add_argument("--points", nargs="+", default=list(POINTS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        for victim in args.victims:
            for point in args.points:
                run = run_once(victim, point)
                runs.append(run)
                tail = "" if run.get("parity_ok") else f"  {run.get('error', '')[:200]}"
                print(f"{victim:7s} {point:13s} survivors ok {run.get('survivors_ok')!s:5s} "
                      f"parity {run.get('parity_ok')!s:5s} {run['seconds']:6.1f} s{tail}",
                      flush=True)
                print(f"        slowest attempts: {run['slowest']}", flush=True)
    good = sum(bool(r.get("survivors_ok") and r.get("parity_ok")) for r in runs)
    print(f"{good} of {len(runs)} runs: every survivor finished and equals the reference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    if good != len(runs):
        for run in runs:
            if not (run.get("survivors_ok") and run.get("parity_ok")):
                print(f"--- {run['victim']} {run['point']} ---\n{run.get('logs', '')}")
        sys.exit(1)


if __name__ == "__main__":
    main()
