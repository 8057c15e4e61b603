"""Deaths during a fault-tolerant round's set-up, swept: who dies (the donor, the other
member, the joiner of a rejoin round, or the donor of the first round's initial copy)
and where (d seconds into the creation of the round's outer groups, or at the n-th
state tensor of the transfer). Each run is test_fault_tolerance.py's
``run_with_a_death_in_set_up`` (three replica groups of 2 CPU ranks, HSDP): it passes
when every group that should live exits 0 and every live group's losses and
parameters equal the single-process reference fed the live groups' batches.

    PYTHONPATH=test_collective python tools/sweep_ft_deaths.py     # the whole sweep (~10 min)
    PYTHONPATH=test_collective python tools/sweep_ft_deaths.py --victims donor \
        --points connect:0.05 --repeat 10

(test_collective: the scenario, test_fault_tolerance.py, and its launcher.)

Prints one line per run (with the slowest attempts: where its time went) and a count;
``--json PATH`` writes the runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from pythonpath import COLLECTIVE, require

require("sweep_ft_deaths", COLLECTIVE, ("test_fault_tolerance", "launcher"))

from test_fault_tolerance import VICTIMS, run_with_a_death_in_set_up  # noqa: E402

POINTS = ("connect:0", "connect:0.05", "connect:0.2", "transfer:1", "transfer:4")


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
                try:
                    run = run_with_a_death_in_set_up(victim, point)
                except AssertionError as e:  # the reference run disagreed: a result
                    run = {"victim": victim, "point": point, "survivors_ok": True,
                           "parity_ok": False, "seconds": 0, "slowest": [],
                           "error": str(e)[-2000:]}
                runs.append(run)
                print(f"{victim:11s} {point:13s} survivors ok {run['survivors_ok']!s:5s} "
                      f"parity {run.get('parity_ok')!s:5s} {run['seconds']:6.1f} s "
                      f"{run.get('error', '')[:200]}\n    slowest attempts: {run['slowest']}",
                      flush=True)
    good = sum(bool(r["survivors_ok"] and r.get("parity_ok")) for r in runs)
    print(f"{good} of {len(runs)} runs: every survivor finished and equals the reference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    for run in runs:
        if not (run["survivors_ok"] and run.get("parity_ok")):
            print(f"--- {run['victim']} {run['point']} ---\n{run.get('logs', '')}")
    sys.exit(0 if good == len(runs) else 1)


if __name__ == "__main__":
    main()
