"""Bytes of a round's record that each replica group receives, at R groups.

    python tools/sim_record_bytes.py [--groups 128 512 1024] [--json]

A simulator of the record's size only (``tools/sim_ft.py`` runs the whole protocol
against etcd; this one needs neither etcd nor Paddle): it drives the protocol's own
decision (``decide``) and encodings (``Round.to_delta``, what every group's watch of
``ctl/`` and every rank's group store now get, and ``Round.to_json``, the whole record
they got before and the snapshot the decider writes once) for R groups at step 1,000
with a configuration hash, each value signed as a job with ``PADDLE_HSDP_FT_SECRET``
writes it, over three rounds after a steady one:

* ``failure``: group 3 dies mid-step; every survivor arrives ``failed`` at the same step;
* ``failed_attempt``: an attempt fails and nobody dies (every group arrives ``failed``);
* ``rejoin``: group 3 restarts and arrives fresh; the members arrive one step later.

It prints, per round and R, the bytes each group receives now and before, and the bytes
of the whole record (written once, by the decider; read once, by a joiner). With
``--json`` the last line is one JSON object of those figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import pythonpath

SECRET = "a-job-secret-of-32-characters-ab"  # the size of `openssl rand -hex 16`
CONFIG = "0123456789abcdef"  # a configuration hash (ft/config.py: 16 hex digits)
DIES = 3  # the group that dies in the failure round and rejoins after


def _protocol():
    """The protocol and its trust without Paddle (tools/pythonpath.py)."""
    return pythonpath.ft_without_paddle("protocol", "trust")


def record_bytes(groups: int) -> dict[str, dict[str, int]]:
    """``{round: {"now": B, "before": B, "whole": B}}`` for a job of ``groups`` groups:
    the signed value of round n's ``ctl/`` record as every group receives it now (a
    delta against round n-1's), before (the whole record), and the whole record the
    decider writes once beside it."""
    protocol, trust = _protocol()
    Arrival, decide, Rules = protocol.Arrival, protocol.decide, protocol.Rules
    keys, signer = protocol.Keys("default"), trust.Signer(SECRET)
    rules, step, ids = Rules(start_replicas=groups), 1000, list(range(groups))
    gone = "its lease ended (killed, hung or cut off)"

    def alive(r):
        return None

    steady = decide(10, {r: Arrival(step, config=CONFIG) for r in ids}, ids, alive, rules, 0, {},
                    decider=0)
    survivors = [r for r in ids if r != DIES]
    rounds = {
        "failure": decide(11, {r: Arrival(step, failed=True, config=CONFIG) for r in survivors},
                          ids, lambda r: gone if r == DIES else None, rules, 1, {}, decider=0),
    }
    rounds["rejoin"] = decide(
        12, {**{r: Arrival(step + 1, config=CONFIG) for r in survivors},
             DIES: Arrival(0, fresh=True, config=CONFIG)}, survivors, alive, rules, 1, {},
        decider=0)
    bases = {"failure": steady, "rejoin": rounds["failure"]}
    rounds["failed_attempt"] = decide(
        11, {r: Arrival(step, failed=True, config=CONFIG) for r in ids}, ids, alive, rules, 1,
        {}, decider=0)
    bases["failed_attempt"] = steady
    out = {}
    for name, record in rounds.items():
        base, key = bases[name], keys.record(record.number)
        delta = record.to_delta(base)
        assert protocol.Round.from_delta(delta, base) == record  # what every reader gets
        out[name] = {"now": len(signer.sign(key, delta).encode()),
                     "before": len(signer.sign(key, record.to_json()).encode()),
                     "whole": len(signer.sign(keys.snapshot(record.number),
                                              record.to_json()).encode())}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[128, 512, 1024],
                        help="replica groups (R), one job each")
    parser.add_argument("--json", action="store_true", help="last line: the figures as JSON")
    args = parser.parse_args(argv)
    if min(args.groups) <= DIES:
        parser.error(f"--groups must each be > {DIES} (group {DIES} dies and rejoins), got "
                     f"{args.groups}")
    figures = {str(r): record_bytes(r) for r in args.groups}
    print(f"{'R':>6} {'round':>15} {'B per group now':>16} {'before':>10} "
          f"{'before/now':>10} {'whole record, once':>19}")
    for r, rounds in figures.items():
        for name, b in rounds.items():
            print(f"{r:>6} {name:>15} {b['now']:>16} {b['before']:>10} "
                  f"{b['before'] / b['now']:>10.0f} {b['whole']:>19}")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
